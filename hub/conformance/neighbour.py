"""The kit's neighbour: a second peer of the kit's hub, played by the kit, so that the peer
under test dials it and the kit sees the dialling side of a gossip link.

It joins as a relay (it generates nothing) with a chunk server of its own: the uplink probe
route the hub checks before it names a peer in anyone's neighbour sample, and /gossip, where a
dial from the peer under test is handed to the kit's script (`dials`); anyone else (the hub's
own checks) is answered 409, "no room", which the spec counts as nothing. Its hub connection
is `echo2p2p.peer_protocol.PeerProtocol`, the reference peer's own core: the hello, the checked
welcome, heartbeats; it fetches the seeds it is dealt from the hub, as a relay must, so the hub
keeps naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import peer_protocol as pp
from echo2p2p import signing
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.frames import decode_frame, encode_frame
from echo2p2p.overlay.link import FRAMES, LINK_LIMITS, LINK_PATH, Have, Piece, Proof, Want
from echo2p2p.overlay.links import agreement, answer_headers
from echo2p2p.overlay.serving import PROBE_PATH, probe_handler
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import TICKET_HEADER, Credentials, Tickets
from echo2p2p.runtime.process import loop_now

from . import verdicts as v

HEARTBEAT_S = 10.0
DIAL_S = 120.0  # for the peer to dial the neighbour (at its next version's announcement)
PROOF_GRACE_S = 2.0  # what a dialler sends in this long before the proof, it sent first
FRAME_S = 30.0  # for the next link frame the script waits on


@dataclass
class Dial:
    """One link the peer under test opened to the neighbour; `done` ends its handler."""

    ws: web.WebSocketResponse
    done: asyncio.Event
    protocol: int  # the version the link agreed in its upgrade (wire §1a)


class Neighbour:
    """The kit's second peer; `peer_id` once welcomed, `expect` the id whose dials it takes."""

    def __init__(self, http: aiohttp.ClientSession, hub_url: str):
        self.http, self.hub_url = http, hub_url
        self._key = signing.new_private_key()
        self.tickets = Tickets()
        self.peer_id: str | None = None
        self.creds: Credentials | None = None
        self.expect: str | None = None
        self.dials: asyncio.Queue[Dial] = asyncio.Queue()

    async def _gossip(self, request: web.Request) -> web.StreamResponse:
        who = self.tickets.holder(request.headers.get(TICKET_HEADER, ""))
        if who is None or who[0] != self.expect or request.query.get("id") != self.expect:
            return web.Response(status=409, text="no room for this link")
        if isinstance(agreed := agreement(request), web.Response):
            return agreed
        ws = web.WebSocketResponse(max_msg_size=64 << 20, compress=False)
        ws.headers.update(answer_headers(agreed))
        await ws.prepare(request)
        dial = Dial(ws, asyncio.Event(), agreed.protocol)
        await self.dials.put(dial)
        await dial.done.wait()
        return ws

    async def _seed(self, plan: m.RelayPlan) -> None:
        """Fetch the chunks the hub dealt us, so its seed watch never finds us silent."""
        gossip = plan.gossip
        if gossip is None or self.creds is None:
            return
        base = self.hub_url.replace("ws://", "http://").rsplit("/ws", 1)[0]
        for index in m.unpack_ids(gossip.seed):
            path = chunk_path(gossip.version, gossip.base_version, index)
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.get(base + path + "?wait=10", headers=self.creds.header("hub"),
                                         timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    await resp.read()

    async def join(self, ws: Any, url: str) -> pp.PeerProtocol:
        """Hello (a relay serving at `url`) and the checked welcome, on `ws`."""
        nonce, key = os.urandom(32), signing.public_key(self._key)
        proto = pp.PeerProtocol(loop_now(), hub_url=self.hub_url, peer_key=key, nonce=nonce)
        await ws.send_bytes(proto.hello(m.Hello("kit-neighbour", "relay", "cpu",
                                                listen_addr=url, nonce=nonce, peer_key=key)))
        welcome = proto.receive_welcome(await ws.receive_bytes(timeout=30), loop_now())
        self.peer_id = welcome.peer_id
        self.creds = Credentials(welcome.run_id, welcome.peer_id, self._key, welcome.ticket)
        self.tickets.admit(welcome.hub_key, welcome.run_id, welcome.peer_id)
        return proto

    async def serve(self, ws: Any, proto: pp.PeerProtocol) -> None:
        """Read the hub's frames (fetching the seeds of each version) and heartbeat, until
        the connection ends or the task is cancelled."""
        async with asyncio.TaskGroup() as tg:
            beat = tg.create_task(self._beat(ws, proto))
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    break
                event = proto.receive(msg.data, loop_now())
                if isinstance(event, pp.VersionAnnounced):
                    tg.create_task(self._seed(event.plan))
            beat.cancel()

    async def _beat(self, ws: Any, proto: pp.PeerProtocol) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await ws.send_bytes(proto.send(m.Heartbeat()))


@contextlib.asynccontextmanager
async def neighbour(http: aiohttp.ClientSession, hub_url: str) -> AsyncIterator[Neighbour]:
    """The neighbour, serving on 127.0.0.1 port 0 and welcomed by the hub at `hub_url`."""
    nb = Neighbour(http, hub_url)
    app = web.Application()
    app.router.add_get(PROBE_PATH, probe_handler(authorize=nb.tickets.hub_only))
    app.router.add_get(LINK_PATH, nb._gossip)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with http.ws_connect(hub_url, max_msg_size=16 << 20) as ws:
            serving = asyncio.create_task(nb.serve(ws, await nb.join(ws, url)))
            try:
                yield nb
            finally:
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await serving
    finally:
        await runner.cleanup()


async def dialler_phase(hub: Any, peer_id: str, nb: Neighbour, report: v.Report) -> None:
    """DIAL_SILENT and DIAL_PROOF on the peer's first dial to the neighbour, REPORT on its
    second: the neighbour claims the whole manifest being downloaded and answers a want with
    zeros of the chunk's size."""
    nb.expect = peer_id
    rules = (v.DIAL_SILENT, v.DIAL_PROOF, v.REPORT)
    try:
        dial = await asyncio.wait_for(nb.dials.get(), DIAL_S)
    except TimeoutError:
        for rule in rules:
            report.skip(rule, f"the peer did not dial the kit's neighbour in {DIAL_S:.0f} s")
        return
    try:
        early = await dial.ws.receive(timeout=PROOF_GRACE_S)
        report.add(v.DIAL_SILENT, False, f"it sent a {early.type.name} frame first")
    except TimeoutError:
        report.add(v.DIAL_SILENT, True)
    stranger = Credentials.issued(signing.new_private_key(), hub.core.run_id, nb.peer_id)
    await dial.ws.send_bytes(encode_frame(Proof.TYPE, Proof(stranger.header(peer_id)[
        TICKET_HEADER].encode()), dial.protocol))
    try:  # a close (or the link's end) is the answer; a frame means it took the proof
        msg = await dial.ws.receive(timeout=FRAME_S)
        report.add(v.DIAL_PROOF, msg.type is not aiohttp.WSMsgType.BINARY,
                   f"after the proof it sent {_kind(msg.data, dial.protocol)}")
    except TimeoutError:
        report.add(v.DIAL_PROOF, False, f"the link was still open {FRAME_S:.0f} s after it")
    dial.done.set()
    if any(f.rule in (v.DIAL_SILENT, v.DIAL_PROOF) for f in report.failed):
        report.skip(v.REPORT, "the link's handshake failed first")
        return
    try:
        async with asyncio.timeout(DIAL_S):
            dial = await nb.dials.get()
            await _corrupt_piece(hub, dial, nb)
    except (TimeoutError, ConnectionError):
        report.skip(v.REPORT, f"no second dial, or no want of a chunk, in {DIAL_S:.0f} s")
        return
    finally:
        dial.done.set()

    def heard() -> list[str]:
        s = hub.statistics()
        return [r for (who, r) in s.relay_reports_by if who == nb.peer_id] or (
            ["(none: the hub closed the peer for a protocol error)"] if s.closed_for_protocol
            else [])

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(FRAME_S):  # the hub's counters report no event
            while not heard():
                await asyncio.sleep(0.1)
    report.add(v.REPORT, heard() == ["corrupt"], f"reported: {heard() or 'nothing'}")


async def _corrupt_piece(hub: Any, dial: Dial, nb: Neighbour) -> None:
    """Prove who we are, claim every chunk of a manifest the peer is fetching, and answer its
    first want of it with zeros (the right size, the wrong bytes)."""
    ws, version = dial.ws, dial.protocol
    await ws.send_bytes(encode_frame(Proof.TYPE, Proof(nb.creds.header(nb.expect)[
        TICKET_HEADER].encode()), version))
    key = snap = None
    while True:
        rec = _frame(await ws.receive(timeout=FRAME_S), version)
        if key is None and isinstance(rec, Have):
            snap = hub.core.tracker.snapshot(rec.version, rec.base)
            if snap is not None and sum(bin(b).count("1") for b in rec.bits) < len(snap.chunks):
                key, n = (rec.version, rec.base), len(snap.chunks)
                bits = bytes([255] * (n // 8) + ([(1 << n % 8) - 1] if n % 8 else []))
                await ws.send_bytes(encode_frame(Have.TYPE, Have(*key, bits, snap.manifest.digest),
                                                 version))
        elif isinstance(rec, Want) and (rec.version, rec.base) == key:
            zeros = bytes(len(snap.chunks[rec.index]))
            await ws.send_bytes(encode_frame(Piece.TYPE, Piece(*key, rec.index, zeros), version))
            return


def _frame(msg: aiohttp.WSMessage, version: int) -> Any:
    if msg.type is not aiohttp.WSMsgType.BINARY:
        raise ConnectionError("the link ended")
    try:
        return decode_frame(msg.data, LINK_LIMITS, FRAMES, (version,))[0]
    except RemoteProtocolError:
        return None


def _kind(data: Any, version: int) -> str:
    rec = _frame(aiohttp.WSMessage(aiohttp.WSMsgType.BINARY, data, None), version)
    return f"a {type(rec).__name__} frame" if rec is not None else "a frame that does not decode"
