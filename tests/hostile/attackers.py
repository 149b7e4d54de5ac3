"""The hostile suite's attackers: a peer written against the wire format alone, the servers an
attacker runs beside it (a relay that never answers, a relay that records what it is sent) and
a hub that is not the hub.

`RawPeer` builds every frame as a plain msgpack map (`{"p": 2, "t": type, ...}`, as
docs/protocol/ describes it), so values the honest `Session` would refuse to send (a NaN price,
a 590,000-key map) still go out, and it records every frame and the close it gets. It never
generates and never downloads: it says what it says and watches the hub's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

from echo2p2p import signing
from echo2p2p import messages as m
from echo2p2p.messages import to_wire
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import Credentials

from tests.conftest import Pulse, serving
from .peer_attacks import owned

Frame = dict[str, Any]


class RawPeer:
    """One websocket to the hub, spoken by hand. `frames` holds everything the hub sent, in
    order; `closed` is set once the hub closed (code and reason in `close_code`/`close_reason`,
    the Goodbye's if one came first)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.frames: list[Frame] = []
        self.welcome: Frame | None = None
        self.close_code: int | None = None
        self.close_reason = ""
        self.closed = asyncio.Event()
        self.key = signing.new_private_key()  # a real key pair, as a current peer would send
        self._pulse = asyncio.Event()  # set and replaced whenever a frame arrives

    @property
    def peer_id(self) -> str:
        assert self.welcome is not None, "not welcomed"
        return self.welcome["peer_id"]

    def reaction(self) -> str:
        """What the hub did to this connection, for the suite table."""
        if not self.closed.is_set():
            return "kept open"
        return f"closed {self.close_code} {self.close_reason!r}"

    async def send(self, t: str, **fields: Any) -> None:
        await self.send_bytes(msgpack.packb({"p": m.BASE_PROTOCOL, "t": t, **fields}, use_bin_type=True))

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(data)

    async def hello(self, **fields: Any) -> Frame | None:
        """Send a hello (a leaf relay with a fresh nonce and key unless `fields` say otherwise);
        the welcome, or None if the hub refused (see `close_code`)."""
        hello = {"name": "raw", "engine": "relay", "device": "cpu", "price_per_hour": 0.0,
                 "listen_addr": None, "token": "", "nonce": signing.new_private_key(),
                 "peer_key": signing.public_key(self.key), **fields}
        await self.send("hello", **hello)
        first = await self.wait_frame(lambda f: f["t"] in ("welcome", "goodbye"), allow_close=True)
        if first is not None and first["t"] == "welcome":
            self.welcome = first
            return first
        await self.wait_closed()
        return None

    async def wait_frame(self, pred: Callable[[Frame], bool], timeout_s: float = 60.0, *,
                         since: int = 0, allow_close: bool = False) -> Frame | None:
        """The first frame from index `since` on that satisfies `pred`, waiting for it; None if
        the hub closed first and `allow_close`, else an assertion error."""
        deadline = time.monotonic() + timeout_s
        seen = since
        while True:
            pulse = self._pulse
            for frame in self.frames[seen:]:
                if pred(frame):
                    return frame
            seen = len(self.frames)
            if self.closed.is_set():
                assert allow_close, f"the hub closed first: {self.reaction()}"
                return None
            remaining = deadline - time.monotonic()
            assert remaining > 0, "no such frame from the hub in time"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pulse.wait(), remaining)

    async def until(self, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Return once `condition()` holds, looked at again at each frame from the hub (and
        its close); an assertion error after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while not condition():
                    await self._pulse.wait()
        except TimeoutError:
            raise AssertionError(f"not within {timeout_s:g} s: {self.reaction()}") from None

    async def wait_closed(self, timeout_s: float = 60.0) -> None:
        await asyncio.wait_for(self.closed.wait(), timeout_s)

    async def keep_alive(self, every_s: float = 5.0) -> None:
        """Heartbeat forever (a silent peer is dropped after the hub's peer_timeout_s)."""
        while not self.closed.is_set():
            await asyncio.sleep(every_s)  # a timer, not a sync
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.send("heartbeat")

    async def _read(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg.type is aiohttp.WSMsgType.BINARY:
                frame = msgpack.unpackb(msg.data, raw=False)
                if frame.get("t") == "goodbye" and self.close_code is None:
                    self.close_code, self.close_reason = frame.get("code"), frame.get("reason", "")
                self.frames.append(frame)
            elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                              aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                if self.close_code is None:
                    self.close_code = self.ws.close_code
                    self.close_reason = msg.extra if isinstance(msg.extra, str) else ""
                self.closed.set()
            self._pulse.set()
            self._pulse = asyncio.Event()
            if self.closed.is_set():
                return


@contextlib.asynccontextmanager
async def raw_peer(url: str, keep_alive: bool = False) -> AsyncIterator[RawPeer]:
    """A `RawPeer` connected to `url`, its reader running; hung up on exit."""
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(url, max_msg_size=0, compress=0)
        peer = RawPeer(ws)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(peer._read())]
            if keep_alive:
                tasks.append(tg.create_task(peer.keep_alive()))
            try:
                yield peer
            finally:
                for task in tasks:
                    task.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.close(), 5)


async def fetch_share(peer: RawPeer, hub_url: str) -> None:
    """Forever: fetch from the hub's chunk route, with `peer`'s ticket, every chunk the hub
    deals `peer`, as an honest relay does before it serves them. A relay that serves what it
    never fetched is silent to the hub's seed watch (`echo2p2p.seed_watch`) and soon dealt
    nothing; the relays of attacks about something else must not be caught by that first."""
    welcome = peer.welcome
    assert welcome is not None, "not welcomed"
    credentials = Credentials(welcome["run_id"], peer.peer_id, peer.key, welcome["ticket"])
    base = hub_url.replace("ws", "http", 1).removesuffix("/ws")
    done: set[tuple[int, int | None, int]] = set()
    seen = 0
    async with aiohttp.ClientSession() as http:
        while (frame := await peer.wait_frame(lambda f: owned(peer.peer_id, f) is not None,
                                              3600.0, since=seen, allow_close=True)) is not None:
            seen = peer.frames.index(frame, seen) + 1
            (version, base_version), chunks = owned(peer.peer_id, frame)
            for i in chunks:
                if (version, base_version, i) not in done:
                    done.add((version, base_version, i))
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(base + chunk_path(version, base_version, i),
                                            headers=credentials.header("hub")) as resp:
                            await resp.read()


@contextlib.asynccontextmanager
async def sharing(peer: RawPeer, hub_url: str) -> AsyncIterator[None]:
    """`fetch_share(peer, hub_url)` running until the block ends."""
    task = asyncio.create_task(fetch_share(peer, hub_url))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(frozen=True)
class Request:
    path: str
    query: str
    headers: dict[str, str]


@dataclass
class DeadRelay:
    """A relay that accepts every connection, reads the request head and never answers a byte.
    `requests` holds the heads it read (whose ticket says who asked)."""

    url: str = ""
    requests: list[Request] = field(default_factory=list)


@contextlib.asynccontextmanager
async def dead_relay() -> AsyncIterator[DeadRelay]:
    relay, stop = DeadRelay(), asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                                 ConnectionError):
            relay.requests.append(_head(await reader.readuntil(b"\r\n\r\n")))
        await stop.wait()
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    relay.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield relay
    finally:
        stop.set()
        server.close()
        await server.wait_closed()


def _head(raw: bytes) -> Request:
    line, *lines = raw.decode("latin-1").split("\r\n")
    target = line.split(" ")[1] if line.count(" ") >= 2 else ""
    path, _, query = target.partition("?")
    headers = dict(h.split(": ", 1) for h in lines if ": " in h)
    return Request(path, query, headers)


CHUNK_IN_URL = re.compile(r"/chunk/(\d+)/(full|\d+)/(\d+)")


@dataclass
class RecordingRelay:
    """What a relay run by an attacker was sent. It serves chunks for real (the hub's own
    bytes, as a relay that fetched them honestly would hold them), so it passes any probe and
    is dealt chunks like an honest relay; it answers 200 to anything else."""

    url: str = ""
    requests: list[Request] = field(default_factory=list)


@contextlib.asynccontextmanager
async def recording_relay(lookup: Callable[..., Any]) -> AsyncIterator[RecordingRelay]:
    """A recording relay whose chunks come from `lookup(version, base, index, wait_s)`."""
    relay = RecordingRelay()

    async def handle(request: web.Request) -> web.StreamResponse:
        relay.requests.append(Request(request.path, request.query_string, dict(request.headers)))
        # Wherever the requester put the chunk's coordinates (path or, if it appended our
        # path, the query), find them: an attacker serves whatever keeps it dealt chunks.
        found = CHUNK_IN_URL.search(request.path_qs)
        if found is None:
            return web.Response(text="ok")
        version, base, index = found.groups()
        data = await lookup(int(version), None if base == "full" else int(base), int(index), 1.0)
        if not data:
            return web.Response(status=404 if data is not None else 503)
        return web.Response(body=data, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    async with serving(app) as port:
        relay.url = f"http://127.0.0.1:{port}"
        yield relay


@dataclass
class Impostor:
    """What a hub that is not the hub was told: every frame from each connection, by type."""

    url: str = ""
    hellos: int = 0
    received: list[str] = field(default_factory=list)  # message types after the hellos
    hung_up: int = 0  # connections the peer closed
    heard: Pulse = field(default_factory=Pulse)  # fired at each frame told (`until`)


@contextlib.asynccontextmanager
async def impostor_hub(run: Any) -> AsyncIterator[Impostor]:
    """A fake hub for a peer to meet. It has what anyone can have of the real hub `run` (its
    public key, its signed versions and their chunks, which it relays), not its private key:
    it echoes the key in its welcome with a proof it cannot make, announces the real newest
    version, and grants a lease to anyone who asks."""
    impostor = Impostor()
    real = run.hub.core  # its key, config and versions
    newest = real.tracker.snapshot()
    problem = run.hub.setup.task.problems("train")[0]

    def frame(t: str, **fields: Any) -> bytes:
        return msgpack.packb({"p": m.BASE_PROTOCOL, "t": t, **fields}, use_bin_type=True)

    async def ws_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.BINARY:
                break
            got = msgpack.unpackb(msg.data, raw=False)
            if got.get("t") != "hello":
                impostor.received.append(got.get("t"))
                impostor.heard.fire()
                if got.get("t") == "lease_request":
                    await ws.send_bytes(frame(
                        "lease", lease_id="L1", problem_id=problem.id, prompt=problem.prompt,
                        prompt_ids=run.tokenizer.encode(problem.prompt, add_special_tokens=False),
                        answer=problem.answer, group_size=real.cfg.grpo.group_size, deadline_s=60.0,
                        min_version=newest.manifest.version))
                continue
            impostor.hellos += 1
            impostor.heard.fire()
            cfg = real.cfg
            await ws.send_bytes(frame(
                "welcome", peer_id="p1", run_id=real.run_id, model=cfg.run.model, task=real.facts.kind,
                version=newest.manifest.version, max_lag=cfg.staleness.max_lag, group_size=cfg.grpo.group_size,
                temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p, max_new_tokens=cfg.grpo.max_new_tokens,
                seed=1, hub_key=real.hub_key, ticket=b"", proof=bytes(64)))
            await ws.send_bytes(frame("version", manifest=to_wire(newest.manifest), plan=dict(
                version=newest.manifest.version, base_version=None, revision=1, sources=[],
                owners=b"\xff\xff\xff\xff" * len(newest.chunks)), signature=newest.signature))
        impostor.hung_up += 1
        return ws

    async def chunk(request: web.Request) -> web.Response:
        index = int(request.match_info["index"])
        if not 0 <= index < len(newest.chunks):
            return web.Response(status=404)
        return web.Response(body=newest.chunks[index], content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/ws", ws_handler)
    app.router.add_get(f"/chunk/{newest.manifest.version}/full/{{index}}", chunk)
    async with serving(app) as port:
        impostor.url = f"ws://127.0.0.1:{port}/ws"
        yield impostor
