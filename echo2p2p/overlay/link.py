"""One gossip link: its frames, their checks, and the wants both ways over one websocket.

Theory of operation. On a link every frame is one binary msgpack map (`echo2p2p.frames`,
`LINK_LIMITS`, every field type-checked; `Link.receive` checks values): `have` (a manifest's
bitfield, on link open and when a download starts), `had` (indices newly verified), `want` /
`piece` / `cancel` (a request, its answer, and a withdrawal or refusal), `peers` (peer
exchange: only ids with the hub's ticket), `proof` (the accepting end's first frame: its ticket
header, naming the dialler, so a dialled id is the one the hub admitted). A malformed frame, a
piece nobody asked for or of the wrong size, more than `SERVE_WINDOW` wants at once, a bitfield
that does not fit a manifest we know, or a want that goes unanswered closes the link with a
reason (`LinkError`). Remote bitfields are kept for the `KEEP_KEYS` newest manifests only, so
a link's memory is bounded. Every frame carries the link's protocol version, agreed in the
upgrade (`echo2p2p.overlay.links`; absent: 2, an older release): a frame of another version
closes the link. The set
of links, dialling and the route are
`echo2p2p.overlay.links`' (what a link uses of it is its `LinkHost`); what a download hears is
its `Listener`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from echo2p2p import messages as m
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.frames import BASE_PROTOCOL, Limits, decode_frame, encode_frame
from echo2p2p.gossip import bitfield_size, unpack_bits

from .store import Held, Key, key_order

log = logging.getLogger(__name__)

LINK_PATH = "/gossip"
MAX_PIECE_BYTES = 16 << 20  # largest chunk on the wire a link carries
MAX_BITS_BYTES = 1 << 16  # largest bitfield: 524288 chunks
MAX_HAD = 1024  # indices in one `had`
MAX_SOURCES = 16  # entries in one `peers`
SERVE_WINDOW = 2  # wants the other end may have outstanding with us
KEEP_KEYS = 3  # manifests whose remote bitfields a link keeps
WANT_TIMEOUT_S = 10.0  # default: a want unanswered this long (+ 256 KiB/s) drops the link
SEND_DEADLINE_S = 10.0  # a frame not taken this long drops the link
LINK_LIMITS = Limits(max_str_len=256, max_bin_len=MAX_PIECE_BYTES, max_array_len=MAX_SOURCES,
                     max_map_len=16, max_objects=256)
_ENDED = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
          aiohttp.WSMsgType.ERROR)
HONEST_ENDS = (None, "closed", "duplicate link", "peer stopping")  # a close that bans nobody
PEER_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # what a link may call itself
_MAX_INDEX = 2**32 - 2


@dataclass(frozen=True)
class Have:
    TYPE = "have"
    version: int
    base: int | None
    bits: bytes  # bit i (LSB first in byte i // 8) = chunk i is held
    digest: bytes = b""  # the manifest's digest: another manifest under this key is not ours


@dataclass(frozen=True)
class Had:
    TYPE = "had"
    version: int
    base: int | None
    indices: bytes  # packed <u4


@dataclass(frozen=True)
class Want:
    TYPE = "want"
    version: int
    base: int | None
    index: int


@dataclass(frozen=True)
class Piece:
    TYPE = "piece"
    version: int
    base: int | None
    index: int
    data: bytes


@dataclass(frozen=True)
class Cancel:
    TYPE = "cancel"  # from the asker: no longer wanted; from the holder: will not send it
    version: int
    base: int | None
    index: int


@dataclass(frozen=True)
class Neighbour:
    """A `peers` entry: a chunk server, and the hub's ticket for its peer id (the receiver
    dials no id without one)."""

    peer_id: str
    url: str
    key: bytes  # the peer's public key, which the ticket binds
    ticket: bytes  # signing.sign_ticket(hub, run, peer_id, key)


@dataclass(frozen=True)
class Peers:
    TYPE = "peers"
    sources: list[Neighbour]


@dataclass(frozen=True)
class Proof:
    TYPE = "proof"  # the accepting end's first frame: who it is, shown to the dialler
    header: bytes  # its ticket header (tickets.TICKET_HEADER's form, ASCII) naming the dialler


FRAMES: dict[str, type] = {c.TYPE: c for c in (Have, Had, Want, Piece, Cancel, Peers, Proof)}
LinkFrame = Have | Had | Want | Piece | Cancel | Peers | Proof

# What an end may receive in each state of its link, and the state it leads to (h11 `_state.py`
# style; docs/protocol/overlay.md section 7a prints this table and a test holds it to this one).
# A (state, frame) pair missing here closes the link. The dialler reads in AWAIT_PROOF until
# the accepting end's proof checks out (`links.Links._proof`); a `Link` starts OPEN.
AWAIT_PROOF, OPEN, PEERS_HEARD = "AWAIT_PROOF", "OPEN", "PEERS_HEARD"
_CHUNK_FRAMES = ("have", "had", "want", "piece", "cancel")
LINK_TRANSITIONS: dict[tuple[str, str], str] = {
    (AWAIT_PROOF, "proof"): OPEN,
    **{(OPEN, t): OPEN for t in _CHUNK_FRAMES},
    (OPEN, "peers"): PEERS_HEARD,  # each entry costs a signature check: one frame's worth
    **{(PEERS_HEARD, t): PEERS_HEARD for t in _CHUNK_FRAMES},
}


class LinkError(Exception):
    """The other end broke a link rule; the reason goes into the close frame."""


class Listener(Protocol):
    """What a download of one manifest hears from the links."""

    held: Held

    def link_up(self, link: Link) -> None: ...
    def link_down(self, link: Link) -> None: ...
    def heard(self, link: Link, bits: bytes | None, indices: list[int]) -> None: ...


class LinkSocket(Protocol):
    """What a link writes to: aiohttp's websocket at either end (a test's wire alike)."""

    async def send_bytes(self, data: bytes) -> None: ...
    async def close(self, *, code: int = ..., message: bytes = ...) -> bool: ...
    def __aiter__(self) -> AsyncIterator[aiohttp.WSMessage]: ...


class LinkHost(Protocol):
    """What a link uses of the set it belongs to (`echo2p2p.overlay.links.Links`)."""

    want_timeout_s: float
    advertised: dict[Key, Held]  # manifests we serve over links
    listeners: dict[Key, Listener]  # the downloads under way

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task: ...
    def changed(self) -> None: ...
    def dropped(self, link: Link) -> None: ...
    def heard_of_link(self, sources: list[Neighbour]) -> None: ...
    async def upload(self, link: Link, piece: Piece, slots: dict) -> None: ...


def _check_key(rec: Have | Had | Want | Piece | Cancel) -> Key:
    if not 0 <= rec.version <= _MAX_INDEX or not (rec.base is None or 0 <= rec.base < rec.version):
        raise LinkError(f"bad manifest key in {rec.TYPE}")
    if hasattr(rec, "index") and not 0 <= rec.index <= _MAX_INDEX:
        raise LinkError(f"bad index in {rec.TYPE}")
    return rec.version, rec.base


class Link:
    """One live link to `peer_id`; `dialled`: we opened it; `natted`: it dialled us and says it
    has no chunk server (its upload goes out over its links only)."""

    def __init__(self, links: LinkHost, peer_id: str, ws: LinkSocket, *, dialled: bool,
                 natted: bool = False, protocol: int = BASE_PROTOCOL):
        self.links, self.peer_id, self.ws, self.dialled = links, peer_id, ws, dialled
        self.protocol = protocol  # agreed in the upgrade: every frame both ways carries it
        self.natted = natted and not dialled
        self.bits: dict[Key, bytearray] = {}  # what the other end holds, per manifest
        self.digests: dict[Key, bytes] = {}  # the digest of the manifest it holds, per key
        self._asked: dict[tuple[Key, int], tuple[int, asyncio.Future]] = {}  # ours: size, answer
        self._serving: dict[tuple[Key, int], asyncio.Task] = {}  # theirs
        self._withdrawn: collections.deque[tuple[Key, int]] = collections.deque(maxlen=64)
        self._cancels: list[tuple[Key, int]] = []  # wants given up, their cancels not yet sent
        self._send_lock = asyncio.Lock()
        self.reason: str | None = None  # why it closed
        self.state = OPEN  # LINK_TRANSITIONS: an honest end sends one `peers`, as the link opens

    async def send(self, rec: LinkFrame | None) -> None:
        """Send one frame (None: none), after the cancels of wants given up: a want sent after
        a give-up reaches the other end after its cancel, which frees a place in the window
        (else the other end sees one want too many and drops the link). A frame the other end
        does not take in time closes the link."""
        async with self._send_lock:
            while self._cancels:
                key, index = self._cancels.pop(0)
                await self._write(Cancel(*key, index))
            if rec is not None:
                await self._write(rec)

    async def _write(self, rec: LinkFrame) -> None:
        deadline_s = SEND_DEADLINE_S + len(getattr(rec, "data", b"")) / (256 << 10)
        try:
            async with asyncio.timeout(deadline_s):
                await self.ws.send_bytes(encode_frame(rec.TYPE, rec, self.protocol))
        except TimeoutError:
            self.links.spawn(self.close("stopped reading"))
            raise ConnectionError("the link stopped reading") from None

    def post(self, rec: LinkFrame | None) -> None:
        """Send `rec` (None: only the cancels owed) in the background, ignoring a link that is
        going (its reader sees it end). The send is made when the task runs: a task cancelled
        before it starts (the peer stopping) leaves no coroutine never awaited behind."""
        self.links.spawn(self._post(rec))

    async def _post(self, rec: LinkFrame | None) -> None:
        await quietly(self.send(rec))

    async def want(self, key: Key, index: int, size: int) -> bytes | None:
        """Ask for chunk `index` of manifest `key` (`size` wire bytes): its bytes, or None if
        refused or the link went; a want left unanswered drops the link. A want given up (its
        task cancelled: a copy came from elsewhere, or the download ended) sends its `cancel`,
        so the other end stops serving it and frees its window."""
        fut = asyncio.get_running_loop().create_future()
        self._asked[(key, index)] = (size, fut)
        try:
            await self.send(Want(*key, index))
            async with asyncio.timeout(self.links.want_timeout_s + size / (256 << 10)):
                return await fut
        except TimeoutError:
            await self.close("a want went unanswered")
            return None
        except (ConnectionError, aiohttp.ClientError, RuntimeError):
            return None
        finally:
            asked = self._asked.pop((key, index), None) is not None
            if asked and (fut.cancelled() or not fut.done()):
                self._withdrawn.append((key, index))  # its piece may be on its way: not unasked
                if self.reason is None:  # (a cancel of a want never sent is ignored there)
                    self._cancels.append((key, index))
                    self.post(None)

    async def run(self) -> None:
        """Read frames until the link ends; then fail what is pending on it."""
        try:
            async for msg in self.ws:
                if msg.type in _ENDED:
                    break
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    raise LinkError("non-binary frame")
                try:
                    rec, _ = decode_frame(msg.data, LINK_LIMITS, FRAMES, (self.protocol,))
                except RemoteProtocolError as exc:
                    raise LinkError(exc.reason) from None
                await self.receive(rec)
                self.links.changed()
        except LinkError as exc:
            log.warning("dropping the link to %s: %s", self.peer_id, exc)
            await self.close(str(exc))
        except (ConnectionError, aiohttp.ClientError, TimeoutError):
            pass
        finally:
            self.reason = self.reason or "closed"
            for _, fut in self._asked.values():
                if not fut.done():
                    fut.set_result(None)
            for task in self._serving.values():
                task.cancel()
            self.links.dropped(self)

    async def receive(self, rec: LinkFrame) -> None:
        nxt = LINK_TRANSITIONS.get((self.state, rec.TYPE))
        if nxt is None:  # a second peers, a proof past the first frame
            raise LinkError(f"a {rec.TYPE} frame in state {self.state}")
        self.state = nxt
        if isinstance(rec, Peers):
            self.links.heard_of_link(rec.sources)
            return
        key = _check_key(rec)
        if isinstance(rec, (Have, Had)):
            self._heard(key, rec)
        elif isinstance(rec, Want):
            if len(self._serving) >= SERVE_WINDOW:
                raise LinkError(f"over {SERVE_WINDOW} wants outstanding")
            if (key, rec.index) not in self._serving:
                task = asyncio.create_task(self._serve(key, rec.index))
                self._serving[(key, rec.index)] = task
        elif isinstance(rec, Piece):
            size, fut = self._asked.get((key, rec.index), (None, None))
            if fut is None:
                if (key, rec.index) in self._withdrawn:
                    return
                raise LinkError("a piece nobody asked for")
            if len(rec.data) != size:
                raise LinkError(f"a piece of {len(rec.data)} bytes, expected {size}")
            if not fut.done():
                fut.set_result(rec.data)
        elif isinstance(rec, Cancel):
            if (task := self._serving.pop((key, rec.index), None)) is not None:
                task.cancel()  # its slot is free now: the asker may want another at once
            if (asked := self._asked.get((key, rec.index))) is not None and not asked[1].done():
                asked[1].set_result(None)

    def same(self, held: Held) -> bool:
        """Whether the other end's `have` of `held`'s key was of `held`'s manifest (a `have`
        without a digest: whatever it holds): a hub resumed from a checkpoint redoes versions
        under the numbers of the old ones. No `have` (or one forgotten): no."""
        theirs = self.digests.get(held.key)
        return theirs is not None and theirs in (b"", held.manifest.digest)

    def bits_of(self, held: Held) -> bytes | None:
        """What the other end said it holds of `held`'s manifest (None: nothing, or another
        manifest under the same key)."""
        bits = self.bits.get(held.key)
        return bytes(bits) if bits is not None and self.same(held) else None

    def _heard(self, key: Key, rec: Have | Had) -> None:
        if isinstance(rec, Have):
            if len(rec.bits) > MAX_BITS_BYTES or len(rec.digest) > 64:
                raise LinkError("bitfield or digest too large")
            self.digests[key] = rec.digest
            indices, bits = [], bytearray(rec.bits)
        else:
            if len(rec.indices) % 4 or len(rec.indices) > 4 * MAX_HAD:
                raise LinkError("had is not at most 1024 packed uint32")
            indices = m.unpack_ids(rec.indices)
            if indices and max(indices) >= 8 * MAX_BITS_BYTES:
                raise LinkError("had past any manifest")
            bits = self.bits.get(key, bytearray())
            top = max(indices, default=-1) // 8 + 1
            bits.extend(bytes(max(0, top - len(bits))))
            for i in indices:
                bits[i // 8] |= 1 << (i % 8)
        held = self.links.advertised.get(key)
        theirs = self.digests.get(key)
        if held is not None and theirs in (None, b"", held.manifest.digest):
            n = len(held.wires)  # a manifest we know: exactly its length, nothing past its end
            try:
                if isinstance(rec, Have):
                    unpack_bits(rec.bits, n)
            except ValueError as exc:
                raise LinkError(str(exc)) from None
            if indices and max(indices) >= n:
                raise LinkError("a had index past the manifest")
        self.bits[key] = bits
        for old in sorted(self.bits, key=key_order)[:-KEEP_KEYS]:
            del self.bits[old]
            self.digests.pop(old, None)
        if (listener := self.links.listeners.get(key)) is not None:
            if held is not None and not self.same(held):  # another manifest: none of ours
                if isinstance(rec, Have):
                    listener.heard(self, bytes(bitfield_size(len(held.wires))), [])
                return
            try:
                listener.heard(self, bytes(bits) if isinstance(rec, Have) else None, indices)
            except ValueError as exc:  # the core found it does not fit the manifest
                raise LinkError(str(exc)) from None

    async def _serve(self, key: Key, index: int) -> None:
        try:
            held = self.links.advertised.get(key)
            data = (held.wires[index] if held is not None and index < len(held.wires)
                    and self.same(held) else None)
            if data is None:
                await self.send(Cancel(*key, index))
                return
            await self.links.upload(self, Piece(*key, index, data), self._serving)
        except (ConnectionError, aiohttp.ClientError, RuntimeError):
            pass
        finally:
            if self._serving.get((key, index)) is asyncio.current_task():
                del self._serving[(key, index)]
            self.links.changed()

    async def close(self, reason: str) -> None:
        self.reason = self.reason or reason
        with contextlib.suppress(Exception):
            await self.ws.close(code=m.CLOSE_PROTOCOL_ERROR, message=reason.encode()[:120])


async def quietly(coro: Coroutine[Any, Any, object]) -> None:
    """Send, ignoring a link that is going (its reader sees it end)."""
    with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError, TimeoutError):
        await coro
