"""The hub's own evidence about a gossip accusation: it asks the accused for the piece itself.

No gossip `relay_report` is believed as it stands. The hub dials the accused's GET /gossip as
an ordinary peer (an id from the hub's own sequence, a fresh key, a ticket it signs for them:
`Credentials.issued`, as the tracker's checks; the link's version agreed in the upgrade as a
peer agrees it; a liar cannot tell the check from a new neighbour by who it says it is), wants
the contested chunk and judges the answer against the signed manifest. A corrupt piece is
`bad_chunk` (quarantine: no leases, no seeds, in no neighbour sample); no answer, or a `cancel`
of a chunk its `have` on that link claims, takes it out of relaying without a trust event
(slowness proves no lie). Anything else proves nothing, and a whole piece does not cost the
accuser: a liar that corrupts only one victim's pieces must not frame that victim. Bounded: a
few checks at once, one per (accuser, accused, manifest) and one per chunk of an accused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from echo2p2p import messages as m
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.frames import decode_frame, encode_frame
from echo2p2p.gossip import bitfield_size
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S
from echo2p2p.overlay.link import (FRAMES, LINK_LIMITS, LINK_PATH, MAX_PIECE_BYTES, Cancel, Had,
                                   Have, Piece, Want)
from echo2p2p.overlay.links import answer_of, offer_headers
from echo2p2p.overlay.tickets import Credentials
from echo2p2p.snapshot import chunk_digest

from ..core.peer import Peer as PeerConn

log = logging.getLogger(__name__)

CHECK_WAIT_S = 15.0  # a want of the contested chunk unanswered this long (+ per byte): stall
CHECKS_AT_ONCE = 4  # link checks in flight; more wait their turn
MAX_PENDING = 256  # checks waiting at most; accusations past that are not checked
VERDICTS = ("intact", "corrupt", "stall", "absent", "unreachable")


async def fetch_piece(http: aiohttp.ClientSession, base_url: str, audience: str,
                      credentials: Credentials, manifest: m.Manifest, index: int) -> str:
    """Chunk `index` of `manifest` over a gossip link to `audience`'s server at `base_url`, as
    the holder of `credentials`: one of VERDICTS."""
    entry = manifest.chunks[index]
    key = (manifest.version, manifest.base_version)
    try:
        async with asyncio.timeout(CHECK_WAIT_S + entry.wire_bytes / MIN_RATE_BYTES_S):
            async with http.ws_connect(base_url + LINK_PATH,
                                       params={"id": credentials.peer_id, "nat": "1"},
                                       headers={**credentials.header(audience),
                                                **offer_headers()},
                                       max_msg_size=2 * MAX_PIECE_BYTES, compress=0) as ws:
                if (agreed := answer_of(ws)) is None:  # a version no peer of ours speaks
                    return "unreachable"
                proto, nothing = agreed.protocol, bytes(bitfield_size(len(manifest.chunks)))
                await ws.send_bytes(encode_frame(Have.TYPE, Have(*key, nothing, manifest.digest),
                                                 proto))
                await ws.send_bytes(encode_frame(Want.TYPE, Want(*key, index), proto))
                claims = False  # its have (or had) on this link says it holds the chunk
                async for msg in ws:
                    if msg.type is not aiohttp.WSMsgType.BINARY:
                        break
                    rec, _ = decode_frame(msg.data, LINK_LIMITS, FRAMES, (proto,))
                    if getattr(rec, "version", None) != key[0] or rec.base != key[1]:
                        continue  # its proof, peers, other manifests: nothing to judge
                    if isinstance(rec, Have) and rec.digest in (b"", manifest.digest):
                        claims = len(rec.bits) > index // 8 and bool(
                            rec.bits[index // 8] >> (index % 8) & 1)
                    elif isinstance(rec, Had):
                        packed = rec.indices[:4096]
                        claims = claims or index in m.unpack_ids(packed[:len(packed) // 4 * 4])
                    elif isinstance(rec, Cancel) and rec.index == index:
                        return "stall" if claims else "absent"  # refused what it advertises
                    if not isinstance(rec, Piece) or rec.index != index:
                        continue
                    whole = len(rec.data) == entry.wire_bytes
                    good = whole and await asyncio.to_thread(chunk_digest, rec.data) == entry.digest
                    return "intact" if good else "corrupt"
                return "unreachable"
    except TimeoutError:
        return "stall"
    except (aiohttp.ClientError, OSError, RemoteProtocolError):
        return "unreachable"  # down, no room for a link (409), or frames no peer sends


class GossipJudge:
    """Gossip accusations, checked by the hub itself. `new_peer_id()` mints an id from the
    hub's own sequence; `distrust(conn, event)` counts a trust event; `failed(conn)` takes a
    peer out of relaying; `on_event(record)` writes the run log."""

    def __init__(self, signing_key: bytes, run_id: str, *, new_peer_id: Callable[[], str],
                 distrust: Callable[[PeerConn, str], None], failed: Callable[[PeerConn], None],
                 on_event: Callable[[dict[str, Any]], None]):
        self._key, self._run_id, self._new_peer_id = signing_key, run_id, new_peer_id
        self._distrust, self._failed, self._on_event = distrust, failed, on_event
        self._accusations: set[tuple[str, str, tuple]] = set()  # (accuser, accused, manifest)
        self._checked: set[tuple[str, tuple, int]] = set()  # (identity, manifest, chunk)
        self._slots = asyncio.Semaphore(CHECKS_AT_ONCE)
        self._http: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()

    def accused(self, accuser: PeerConn, accused: PeerConn, reason: str, manifest: m.Manifest,
                index: int) -> None:
        """`accuser` says `accused` served chunk `index` of `manifest` over a link badly."""
        key = (manifest.version, manifest.base_version)
        seen, chunk = (accuser.identity, accused.peer_id, key), (accused.identity, key, index)
        if (not self._key or accused.server_url is None or accused.relay == "failed"
                or not 0 <= index < len(manifest.chunks) or seen in self._accusations
                or chunk in self._checked):
            return  # no tickets to dial with, nobody can dial it, judged, or heard already
        if len(self._tasks) >= MAX_PENDING:
            log.warning("%d gossip checks pending: not checking %s's report", MAX_PENDING,
                        accuser.peer_id)
            return
        if len(self._accusations) >= 1 << 16 or len(self._checked) >= 1 << 16:
            self._accusations.clear()  # a long run's worth: forget the oldest all at once
            self._checked.clear()
        self._accusations.add(seen)
        self._checked.add(chunk)
        task = asyncio.create_task(self._judge(accuser, accused, reason, manifest, index))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _judge(self, accuser: PeerConn, accused: PeerConn, reason: str,
                     manifest: m.Manifest, index: int) -> None:
        async with self._slots:
            credentials = Credentials.issued(self._key, self._run_id, self._new_peer_id())
            if self._http is None:
                self._http = aiohttp.ClientSession()
            verdict = await fetch_piece(self._http, accused.server_url, accused.peer_id,
                                        credentials, manifest, index)
        log.warning("checked %s's report of %s over a gossip link (%s, chunk %d of v%d): %s",
                    accuser.peer_id, accused.peer_id, reason, index, manifest.version, verdict)
        self._on_event({"event": "relay_check", "accuser": accuser.peer_id, "relay": "gossip",
                        "accused": accused.peer_id, "reason": reason, "version": manifest.version,
                        "chunk": index, "verdict": verdict})
        if verdict == "corrupt":  # once per chunk: it is checked once
            self._distrust(accused, "bad_chunk")
        if verdict in ("corrupt", "stall") and accused.relay != "failed":
            accused.relay = "failed"
            self._failed(accused)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gossip check failed", exc_info=task.exception())

    async def close(self) -> None:
        """Stop every check under way, and the HTTP client."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None
