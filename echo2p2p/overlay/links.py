"""Peer links for the gossip overlay: one websocket per pair of peers, chunks both ways.

Theory of operation. A peer with a chunk server accepts links at GET /gossip (a websocket
upgrade admitted by the same ticket header as chunk requests; the dialer names itself with
`?id=PEER_ID`, which must be the ticket's peer id). Every peer, NAT'd or not, dials the
neighbours the hub sampled for it and the ones it hears of from its links (`peers` frames), up
to `degree` links, and accepts up to `max_links`. Every link end is a peer the hub admitted: a
dialler shows its ticket, the accepting end shows its own as its first frame (`proof`), and a
`peers` entry is dialled only with a ticket of the hub's for its id (made-up ids take no slot).
The upgrade agrees the link's protocol version and features (`echo2p2p.negotiation`: the
dialler offers in its request headers, the acceptor answers in its 101's; no header is 2, an
older release). One link per pair: when both ends dial, the lower peer id's dial wins. A link
is symmetric, so a peer nobody can dial still uploads over the links it opened; a link that
broke a rule bans its peer id for the run.

`Links` is the peer's set of links, alive across hub connections: the manifests it advertises
(`begin`), the download listening on each (a `Listener`: the gossip download, which verifies
every piece through `ChunkStore.add` and reports to the core `echo2p2p.gossip.Swarm`), uploads
under one cap and at most UPLOAD_SLOTS at once, the queued ones in the core's `serve_rank`
order (a dialler's `nat=1` marks its link NAT'd). One link's frames are
`echo2p2p.overlay.link`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.frames import decode_frame, encode_frame
from echo2p2p.gossip import pack_bits
from echo2p2p.negotiation import (FEATURES_HEADER, LINK_SPEAKS, PROTOCOL_HEADER, Agreed,
                                  features_header, read_header)

from .link import (FRAMES, HONEST_ENDS, KEEP_KEYS, LINK_LIMITS, PEER_ID, LINK_PATH, MAX_HAD,
                   MAX_PIECE_BYTES, MAX_SOURCES, SEND_DEADLINE_S, WANT_TIMEOUT_S, Had, Have, Link,
                   Listener, Neighbour, Peers, Piece, Proof, quietly)
from .link import AWAIT_PROOF, LINK_TRANSITIONS  # the dialler's first state
from .serving import UPLOAD_SLOTS, RankedSlots, TokenBucket, UploadMeter
from .store import Held, Key, key_order
from .tickets import TICKET_HEADER, Credentials, Tickets, server_base

log = logging.getLogger(__name__)

__all__ = ["LINK_PATH", "Links", "agreement", "answer_headers", "answer_of", "link_handler",
           "offer_headers"]


def offer_headers() -> dict[str, str]:
    """What a dialler's upgrade request says it speaks: its newest version and its features."""
    return {PROTOCOL_HEADER: str(LINK_SPEAKS.newest),
            FEATURES_HEADER: features_header(LINK_SPEAKS.features)}


def answer_headers(agreed: Agreed) -> dict[str, str]:
    """What an acceptor's 101 answers: the version and features the link uses."""
    return {PROTOCOL_HEADER: str(agreed.protocol),
            FEATURES_HEADER: features_header(agreed.features)}


def agreement(request: web.Request) -> Agreed | web.Response:
    """What a link dialled with `request` uses, agreed from its upgrade headers (answer it in
    the 101's: `answer_headers`), or the HTTP answer that refuses it: 400 for a version that is
    not a number, 426 with the one sentence for a dialler too old."""
    offer = read_header(request.headers.get(PROTOCOL_HEADER), request.headers.get(FEATURES_HEADER))
    if offer is None:
        return web.Response(status=400, text=f"{PROTOCOL_HEADER} must be a version number")
    try:
        return LINK_SPEAKS.answer(*offer, us="peer", them="dialling peer")
    except RemoteProtocolError as exc:
        return web.Response(status=426, text=exc.reason)


def answer_of(ws: aiohttp.ClientWebSocketResponse) -> Agreed | None:
    """The version and features the accepting end answered our upgrade with (no header: 2, an
    older release); None if it is one we do not speak. aiohttp keeps the 101's headers only on
    the client websocket's private `_response` (tests/compat read a real answer through here)."""
    headers = getattr(getattr(ws, "_response", None), "headers", {})
    answer = read_header(headers.get(PROTOCOL_HEADER), headers.get(FEATURES_HEADER))
    return None if answer is None else LINK_SPEAKS.check(*answer)


class Links:
    """This peer's links, across hub connections. `identity()`: (our peer id, credentials),
    read at each dial; `url`: our chunk server's, shared in `peers` frames (None: NAT'd)."""

    def __init__(self, identity: Callable[[], tuple[str | None, Credentials | None]],
                 meter: UploadMeter, *, degree: int = 8, max_links: int = 24,
                 upload_limit_mbps: float = 0.0, want_timeout_s: float = WANT_TIMEOUT_S,
                 tickets: Tickets | None = None):
        """`tickets`: the hub's key and run, which every link end's ticket must verify under
        (None: a rig without tickets)."""
        self.identity, self.meter, self.want_timeout_s = identity, meter, want_timeout_s
        self.tickets = tickets if tickets is not None else Tickets(b"")
        self.degree, self.max_links = degree, max_links
        self.limiter = TokenBucket(upload_limit_mbps * 1e6) if upload_limit_mbps else None
        self.url: str | None = None
        self.http: aiohttp.ClientSession | None = None  # set by the first download
        self.links: dict[str, Link] = {}
        self.advertised: dict[Key, Held] = {}  # manifests we serve over links (KEEP_KEYS newest)
        self.listeners: dict[Key, Listener] = {}
        self.known: dict[str, str] = {}  # peer id -> chunk server base URL, heard of (bounded)
        self.vouched: dict[str, tuple[bytes, bytes]] = {}  # peer id -> (key, ticket) shown us
        self.unproven = 0  # dials whose other end did not prove the id dialled
        self._dialling: set[str] = set()
        self.banned: set[str] = set()  # peers whose link broke a rule
        self._sending = RankedSlots(UPLOAD_SLOTS)
        self._tasks: set[asyncio.Task] = set()
        self.closing = False
        self._changed = asyncio.Event()  # a pulse: what `until` waits on

    def changed(self) -> None:
        """Wake `until`: a link came, went or heard a frame, a want left a serve window."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds, looked at again at each `changed` (no polling)."""
        while not condition():
            await self._changed.wait()

    def begin(self, held: Held, listener: Listener) -> None:
        """Advertise `held` and route what links hear about it to `listener`."""
        self.advertised[held.key] = held
        for old in sorted(self.advertised, key=key_order)[:-KEEP_KEYS]:
            del self.advertised[old]
            self.listeners.pop(old, None)
        self.listeners[held.key] = listener
        for link in list(self.links.values()):
            listener.link_up(link)
            self.spawn(self._have(link, held))

    def end(self, held: Held, listener: Listener) -> None:
        """`listener` is done (complete or superseded); `held` stays advertised."""
        if self.listeners.get(held.key) is listener:
            del self.listeners[held.key]

    def had(self, key: Key, indices: list[int]) -> None:
        """Tell every link we verified `indices` of manifest `key`, but the ones its `have` /
        `had` of that manifest says it holds: it wants none of them (at N peers each chunk
        would cost N - 1 frames, each a send and a wake-up at both ends)."""
        held = self.advertised.get(key)
        for link in list(self.links.values()):
            bits = link.bits.get(key) if held is not None and link.same(held) else None
            news = indices if bits is None else [
                i for i in indices if not (i >> 3 < len(bits) and bits[i >> 3] >> (i & 7) & 1)]
            for pos in range(0, len(news), MAX_HAD):
                link.post(Had(*key, m.pack_ids(news[pos:pos + MAX_HAD])))

    def heard_of(self, sources: list[m.RelaySource]) -> None:
        """Neighbours from the hub's sample (which probed them): remember (bounded), dial."""
        for s in sources:
            if (base := self._dialable(s.peer_id, s.url)) is not None:
                self.known[s.peer_id] = base
        self.dial_more()

    def heard_of_link(self, sources: list[Neighbour]) -> None:
        """Neighbours from a link's `peers`: only ids the hub's ticket vouches for, and never
        in place of an address we have (a liar could re-point an honest id at a black hole)."""
        for s in sources:
            base = self._dialable(s.peer_id, s.url)
            if (base is not None and s.peer_id not in self.known
                    and self.tickets.vouches(s.peer_id, s.key, s.ticket)):
                self.known[s.peer_id] = base
        self.dial_more()

    def _dialable(self, peer_id: str, url: str) -> str | None:
        me, _ = self.identity()
        base = server_base(url)
        if (base and peer_id != me and peer_id not in self.banned and PEER_ID.fullmatch(peer_id)
                and (peer_id in self.known or len(self.known) < 256)):
            return base
        return None

    def dial_more(self) -> None:
        if self.closing:
            return
        for peer_id, base in list(self.known.items()):
            if len(self.links) + len(self._dialling) >= self.degree or self.http is None:
                return
            if peer_id not in self.links and peer_id not in self._dialling:
                self._dialling.add(peer_id)
                self.spawn(self._dial(peer_id, base))

    async def _dial(self, peer_id: str, base: str) -> None:
        me, credentials = self.identity()
        headers = credentials.header(peer_id) if credentials is not None else {}
        ws, who, agreed = None, None, None
        try:
            async with asyncio.timeout(SEND_DEADLINE_S):
                params = {"id": me or "", "nat": "0" if self.url else "1"}
                ws = await self.http.ws_connect(base + LINK_PATH, params=params,
                                                headers={**headers, **offer_headers()},
                                                max_msg_size=2 * MAX_PIECE_BYTES,
                                                compress=0, heartbeat=30.0)
                if (agreed := answer_of(ws)) is not None:  # else a version we do not speak
                    who = await self._proof(ws, peer_id, agreed.protocol)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.debug("cannot link to %s at %s: %s", peer_id, base, type(exc).__name__)
        finally:
            self._dialling.discard(peer_id)
        if who is None:  # not reached, or not the peer the hub admitted under that id
            self.known.pop(peer_id, None)
            if ws is not None:
                self.unproven += 1
                self.changed()
                await quietly(ws.close(code=m.CLOSE_PROTOCOL_ERROR,
                                       message=b"no proof of identity"))
            return
        self.vouch(peer_id, who)
        await self.serve(Link(self, peer_id, ws, dialled=True, protocol=agreed.protocol))

    async def _proof(self, ws: aiohttp.ClientWebSocketResponse, peer_id: str, protocol: int
                     ) -> tuple[str, bytes, bytes] | None:
        """The accepting end's first frame (of the link's `protocol`) must prove it is
        `peer_id` (`Tickets.holder`)."""
        msg = await ws.receive()
        if msg.type is not aiohttp.WSMsgType.BINARY:
            return None
        try:
            rec, _ = decode_frame(msg.data, LINK_LIMITS, FRAMES, (protocol,))
        except RemoteProtocolError:
            return None
        if (AWAIT_PROOF, rec.TYPE) not in LINK_TRANSITIONS or len(rec.header) > 512:
            return None
        who = self.tickets.holder(rec.header.decode("ascii", "replace"))
        return who if who is not None and who[0] in ("", peer_id) else None

    def vouch(self, peer_id: str, who: tuple[str, bytes, bytes]) -> None:
        """Keep the ticket `peer_id` showed us, to pass on in `peers` frames (bounded)."""
        if who[1] and (peer_id in self.vouched or len(self.vouched) < 4096):
            self.vouched[peer_id] = who[1:]

    def admits(self, peer_id: str, dialled: bool) -> bool:
        """Whether a new link to `peer_id` may open (one per pair: the lower id's dial wins)."""
        me, _ = self.identity()
        old = self.links.get(peer_id)
        if peer_id in self.banned:
            return False
        if old is None:
            return len(self.links) < self.max_links
        winner_dialled = (me or "") < peer_id  # our dial wins iff our id is the lower
        return dialled == winner_dialled and old.dialled != dialled

    async def serve(self, link: Link) -> None:
        """Run `link` until it ends (an accepted link: inside its request handler)."""
        if not self.admits(link.peer_id, link.dialled):
            await link.close("duplicate link")
            return
        if (old := self.links.pop(link.peer_id, None)) is not None:
            for listener in list(self.listeners.values()):
                listener.link_down(old)
            self.spawn(old.close("duplicate link"))
        self.links[link.peer_id] = link
        self.changed()
        for listener in self.listeners.values():
            listener.link_up(link)
        for held in self.advertised.values():
            self.spawn(self._have(link, held))
        # Only peers that proved their ticket to us on a link, at an address we know (the hub's,
        # or the one we reached them at), and ourselves: the receiver dials no id without one.
        sources = [Neighbour(p, self.known[p], *self.vouched[p]) for p in list(self.links)
                   if p in self.known and p in self.vouched][:MAX_SOURCES - 1]
        me, credentials = self.identity()
        if self.url and me:
            key, ticket = (credentials.peer_key, credentials.ticket) if credentials else (b"", b"")
            sources.append(Neighbour(me, self.url, key, ticket))
        link.post(Peers(sources))
        await link.run()

    def dropped(self, link: Link) -> None:
        self.changed()
        if link.reason not in HONEST_ENDS and len(self.banned) < 4096:
            self.banned.add(link.peer_id)  # it broke a rule: never linked again
            self.known.pop(link.peer_id, None)
        if self.links.get(link.peer_id) is link:
            del self.links[link.peer_id]
            for listener in list(self.listeners.values()):
                listener.link_down(link)
            self.dial_more()

    async def upload(self, link: Link, piece: Piece, slots: dict) -> None:
        """Send `piece` under the upload cap, at most UPLOAD_SLOTS pieces at once, queued in
        `serve_rank` order. Its want leaves `slots` (the link's serve window) as it starts out:
        the asker may have the piece, and want the next, before the send returns (so a link has
        at most SERVE_WINDOW wants waiting, plus the one piece its send lock lets out)."""
        async with self._sending.hold(self.serve_rank(link, (piece.version, piece.base),
                                                      piece.index)):
            if self.limiter is not None:
                await self.limiter.take(len(piece.data))
            slots.pop(((piece.version, piece.base), piece.index), None)
            self.changed()
            await link.send(piece)
            self.meter.served_bytes += len(piece.data)

    def serve_rank(self, link: Link, key: Key, index: int) -> tuple[bool, int]:
        """`echo2p2p.gossip.Swarm.serve_rank` over the links: a NAT'd asker first (links are
        its only way to get chunks and to pass them on), then the chunk fewest of our links
        hold (the rarest spreads first)."""
        byte, bit = divmod(index, 8)
        holders = sum(1 for other in self.links.values()
                      if byte < len(bits := other.bits.get(key, b"")) and bits[byte] >> bit & 1)
        return not link.natted, holders

    async def _have(self, link: Link, held: Held) -> None:
        bits = pack_bits((i for i, wire in enumerate(held.wires) if wire is not None),
                         len(held.wires))
        await quietly(link.send(Have(*held.key, bits, held.manifest.digest)))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run `coro` until it ends or the links close."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("link task failed", exc_info=task.exception())

    async def close(self) -> None:
        """Close every link and stop every task (the peer is stopping)."""
        self.closing = True
        for link in list(self.links.values()):
            await link.close("peer stopping")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def link_handler(links: Links, tickets: Tickets):
    """The aiohttp handler of GET /gossip?id=PEER_ID&nat=0|1: a link from a peer the hub
    admitted; nat=1: it has no chunk server (what it says only orders our uploads). Its
    version is the one agreed from the request's headers (426 with the one sentence for a
    dialler too old), answered in the 101's."""

    async def handle(request: web.Request) -> web.StreamResponse:
        peer_id = request.query.get("id", "")
        if not PEER_ID.fullmatch(peer_id):
            return web.Response(status=400, text="expected /gossip?id=PEER_ID")
        if isinstance(agreed := agreement(request), web.Response):
            return agreed
        who = tickets.holder(request.headers.get(TICKET_HEADER, ""))
        if who is None:
            return web.Response(status=403, text="a ticket from this run's hub is required")
        if who[0] not in ("", peer_id):
            return web.Response(status=403, text="the ticket is another peer's")
        if not links.admits(peer_id, dialled=False):
            return web.Response(status=409, text="no room for this link")
        ws = web.WebSocketResponse(max_msg_size=2 * MAX_PIECE_BYTES, compress=False, heartbeat=30.0)
        ws.headers.update(answer_headers(agreed))
        _, credentials = links.identity()  # who we are, shown first: the dialler checks it
        proof = credentials.header(peer_id).get(TICKET_HEADER, "") if credentials else ""
        proof = proof.encode()
        try:  # the dialler may be gone already (a peer stopping mid-handshake): nothing to log
            await ws.prepare(request)
            await ws.send_bytes(encode_frame(Proof.TYPE, Proof(proof), agreed.protocol))
        except (ConnectionError, RuntimeError):
            return ws
        links.vouch(peer_id, who)
        await links.serve(Link(links, peer_id, ws, dialled=False,
                               natted=request.query.get("nat") == "1", protocol=agreed.protocol))
        return ws

    return handle
