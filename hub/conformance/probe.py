"""The probe: the kit's own client of the peer's chunk server and of its gossip links.

It needs no connection to the hub: the kit runs the hub, so the probe holds a ticket the hub's
key signed for the id PROBE_ID (`Credentials.issued`, as the hub's own checks get theirs), and
compares what the peer serves with the hub's own copy of each manifest (`VersionTracker.snapshot`, the hub core's). Each
function checks one or a few rules and records them in the report; a network failure is the
peer's failure to answer, reported as what was seen.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from echo2p2p import signing
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.frames import BASE_PROTOCOL, decode_frame, encode_frame
from echo2p2p.overlay.link import (FRAMES, LINK_LIMITS, LINK_PATH, Cancel, Have, Peers, Piece,
                                   Proof, Want)
from echo2p2p.overlay.links import answer_of, offer_headers
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import Credentials, Tickets

from . import verdicts as v

PROBE_ID = "kit-probe"
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=30)
LINK_WAIT_S = 15.0  # for the first frames of a link: proof, peers, have


class Probe:
    """The probe of one run: `hub` is the kit's running hub, `signing_key` its private key."""

    def __init__(self, hub: Any, signing_key: bytes, http: aiohttp.ClientSession):
        self.hub, self.http = hub, http
        self.creds = Credentials.issued(signing_key, hub.core.run_id, PROBE_ID)
        # A ticket of another key: well formed, but no hub of this run signed it.
        self.stranger = Credentials.issued(signing.new_private_key(), hub.core.run_id, PROBE_ID)
        self.proof_seen = ""  # what came instead of a proof naming the peer, if anything did
        self.held_keys: list[tuple[int, int | None]] = []  # whole manifests a link's haves named

    def hub_chunk(self, version: int, base: int | None, index: int) -> bytes | None:
        snap = self.hub.core.tracker.snapshot(version, base)
        return None if snap is None or index >= len(snap.chunks) else bytes(snap.chunks[index])

    async def _get(self, url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        async with self.http.get(url, headers=headers, timeout=HTTP_TIMEOUT) as resp:
            return resp.status, await resp.read()

    async def chunk_route(self, report: v.Report, base_url: str, peer_id: str,
                          keys: list[tuple[int, int | None]]) -> None:
        """TICKET, CHUNK and NOT_YET against the peer's server at `base_url`; `keys`: the
        manifests it should hold, newest first."""
        if not keys:
            report.add(v.CHUNK, False, "the peer holds no manifest the hub knows of")
            return
        version, base = keys[0]
        path = chunk_path(version, base, 0)
        try:
            bare = (await self._get(base_url + path, {}))[0]
            forged = (await self._get(base_url + path, self.stranger.header(peer_id)))[0]
            report.add(v.TICKET, bare == 403 and forged == 403,
                       f"no ticket: HTTP {bare}, a ticket no hub of this run signed: HTTP {forged}")
            for version, base in keys:  # the first it holds chunk 0 of
                status, body = await self._get(base_url + chunk_path(version, base, 0),
                                               self.creds.header(peer_id))
                if status == 200:
                    break
            want = self.hub_chunk(version, base, 0)
            report.add(v.CHUNK, status == 200 and body == want,
                       f"GET {chunk_path(version, base, 0)}: HTTP {status}, {len(body)} bytes"
                       f"{', not the chunk' if status == 200 else ''}")
            ahead = chunk_path(self.hub.statistics().newest_version + 1000, None, 0) + "?wait=0.5"
            status, body = await self._get(base_url + ahead, self.creds.header(peer_id))
            report.add(v.NOT_YET, status == 503,
                       f"GET {ahead}: HTTP {status} {body[:40]!r}, expected 503 not yet")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            _fail_rest(report, (v.TICKET, v.CHUNK, v.NOT_YET),
                       f"the chunk server did not answer: {type(exc).__name__}")

    def _dial(self, base_url: str, headers: dict[str, str]) -> Any:
        return self.http.ws_connect(base_url + LINK_PATH, params={"id": PROBE_ID, "nat": "1"},
                                    headers={**offer_headers(), **headers},
                                    max_msg_size=64 << 20,
                                    timeout=aiohttp.ClientWSTimeout(ws_close=5))

    async def gossip_link(self, report: v.Report, base_url: str, peer_id: str) -> None:
        """LINK_TICKET, LINK_PROOF, LINK_PEERS and LINK_PIECE: dial the peer's /gossip as a
        NAT'd peer would, read its first frames, want chunk 0 of a manifest it holds."""
        try:
            async with self._dial(base_url, {}):
                report.add(v.LINK_TICKET, False, "the link opened without a ticket")
        except aiohttp.WSServerHandshakeError as exc:
            report.add(v.LINK_TICKET, exc.status == 403, f"HTTP {exc.status}, expected 403")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            report.add(v.LINK_TICKET, False, f"/gossip did not answer: {type(exc).__name__}")
        try:
            async with self._dial(base_url, self.creds.header(peer_id)) as ws:
                async with asyncio.timeout(LINK_WAIT_S * 2):
                    await self._link(report, ws, peer_id)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            _fail_rest(report, (v.LINK_PROOF, v.LINK_PEERS, v.LINK_PIECE),
                       f"the link ended first: {exc or type(exc).__name__}")
        for rule in (v.LINK_PEERS, v.LINK_PIECE):
            if not report.has(rule):
                report.skip(rule, "the link was not proven")

    async def holdings(self, base_url: str, peer_id: str) -> list[Have]:
        """The `have` frames a new link gets from the peer (one per manifest it keeps, sent
        before its `peers` frame): what it holds, as it tells its neighbours."""
        async with self._dial(base_url, self.creds.header(peer_id)) as ws:
            async with asyncio.timeout(LINK_WAIT_S):
                haves, _ = await self._first_frames(ws, peer_id)
        return haves

    async def _first_frames(self, ws: Any, peer_id: str) -> tuple[list[Have], Peers | None]:
        """The haves and the peers frame that open a link (None: the first frame was no proof
        naming `peer_id`); the proof itself is judged by `_link`."""
        first = await self._frame(ws)
        who = (Tickets(self.hub.core.hub_key, self.hub.core.run_id, PROBE_ID).holder(
            first.header.decode("ascii", "replace")) if isinstance(first, Proof) else None)
        if who is None or who[0] != peer_id:
            self.proof_seen = f"first frame: {type(first).__name__}" if who is None else \
                f"the proof names {who[0]!r}, not {peer_id!r}"
            return [], None
        haves: list[Have] = []
        while not isinstance(rec := await self._frame(ws), Peers):
            haves += [rec] if isinstance(rec, Have) else []
        return haves, rec

    async def _link(self, report: v.Report, ws: Any, peer_id: str) -> None:
        haves, peers = await self._first_frames(ws, peer_id)
        if not report.add(v.LINK_PROOF, peers is not None, self.proof_seen):
            return
        vouches = Tickets(self.hub.core.hub_key, self.hub.core.run_id, PROBE_ID).vouches
        bad = [s.peer_id for s in peers.sources if not vouches(s.peer_id, s.key, s.ticket)]
        report.add(v.LINK_PEERS, not bad and bool(peers.sources),
                   f"entries without a valid key and ticket: {bad}" if bad
                   else "an empty peers frame (a peer with a chunk server names itself)")
        while not (whole := [h for h in haves if h.bits[:1] and h.bits[0] & 1]):
            haves += [rec] if isinstance(rec := await self._frame(ws), Have) else []
        have = max(whole, key=lambda h: h.version)
        snap = self.hub.core.tracker.snapshot(have.version, have.base)
        if snap is None:
            report.skip(v.LINK_PIECE, f"the hub no longer keeps {have.version}/{have.base}")
            return
        # As the hub's own check does: a have of nothing of that manifest, then the want.
        n = len(snap.chunks)
        version = agreed(ws)
        await ws.send_bytes(encode_frame(Have.TYPE, Have(have.version, have.base,
                                                         bytes((n + 7) // 8),
                                                         snap.manifest.digest), version))
        await ws.send_bytes(encode_frame(Want.TYPE, Want(have.version, have.base, 0), version))
        while not isinstance(rec := await self._frame(ws), (Piece, Cancel)):
            pass
        if isinstance(rec, Cancel):
            report.add(v.LINK_PIECE, False,
                       "a want of a chunk its have says it holds was cancelled")
            return
        report.add(v.LINK_PIECE, rec.data == bytes(snap.chunks[0]) and (rec.version, rec.base,
                   rec.index) == (have.version, have.base, 0),
                   f"piece {rec.version}/{rec.base}/{rec.index} of {len(rec.data)} bytes is not "
                   f"chunk 0 of {have.version}/{have.base}")
        self.held_keys = [(h.version, h.base) for h in whole]

    async def _frame(self, ws: aiohttp.ClientWebSocketResponse) -> Any:
        msg = await ws.receive()
        if msg.type is not aiohttp.WSMsgType.BINARY:
            raise aiohttp.ClientError(f"the link ended ({msg.type.name} {msg.extra or ''})")
        try:
            return decode_frame(msg.data, LINK_LIMITS, FRAMES, (agreed(ws),))[0]
        except RemoteProtocolError as exc:
            raise aiohttp.ClientError(f"a bad link frame: {exc.reason}") from None


def agreed(ws: aiohttp.ClientWebSocketResponse) -> int:
    """The version the peer's 101 answered our offer with (wire §1a; one we do not speak: the
    base, on which the link's first frame then fails)."""
    answer = answer_of(ws)
    return answer.protocol if answer is not None else BASE_PROTOCOL


def _fail_rest(report: v.Report, rules: tuple[str, ...], why: str) -> None:
    """Fail each of `rules` not yet judged: the exchange that would judge it broke off."""
    for rule in rules:
        if not report.has(rule):
            report.add(rule, False, why)
