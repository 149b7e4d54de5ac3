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
What follows from a verdict is the hub core's (`hub.core.accusations`); this module is the IO
the shell (`hub.serving.overlay_shell`) runs for its `CheckGossip`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

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

log = logging.getLogger(__name__)

CHECK_WAIT_S = 15.0  # a want of the contested chunk unanswered this long (+ per byte): stall
CHECKS_AT_ONCE = 4  # link checks in flight; more wait their turn
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


class GossipCheck:
    """Gossip checks' IO: each dials as a new neighbour under credentials of its own
    (`mint()`: an id from the hub's own sequence, a fresh key, a ticket of this run), a few at
    once; the verdicts are judged in `hub.core.accusations`."""

    def __init__(self, mint: Callable[[], Credentials]):
        self._mint = mint
        self._slots = asyncio.Semaphore(CHECKS_AT_ONCE)
        self._http: aiohttp.ClientSession | None = None

    async def check(self, base_url: str, audience: str, manifest: m.Manifest, index: int) -> str:
        """Ask `audience`'s server at `base_url` for chunk `index` of `manifest`: one of
        VERDICTS."""
        async with self._slots:
            credentials = self._mint()
            if self._http is None:
                self._http = aiohttp.ClientSession()
            return await fetch_piece(self._http, base_url, audience, credentials, manifest, index)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
