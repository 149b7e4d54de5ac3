"""What stands between the peer under test and the kit's hub: a tap that carries its TCP
connections to the hub and can drop them all at once (the reconnect check), and an impostor
hub that answers a hello with the real hub's public key but a proof it cannot make (the
handshake check).

Neither parses the hub's protocol beyond what it needs: the tap carries bytes, the impostor
reads the type of each frame and sends one welcome. The impostor's welcome carries the real
hub's values (its key, run id, model digest and signature) with a proof it cannot make, so
only the proof can give it away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p.frames import PROTOCOL_VERSION, to_wire

ABSENT_PROTOCOL = 2  # what a hello without "protocol" speaks (wire §3)


class Tap:
    """A TCP relay from 127.0.0.1:`port` to the hub's port; `drop()` cuts every connection
    through it (as a network fault would: no close frame reaches either end)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self.dropped = 0  # connections cut by drop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Tap:
        self._server = await asyncio.start_server(self._carry, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.drop()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def drop(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self.dropped += len(self._writers) // 2

    async def _carry(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            down_w.transport.abort()
            return
        self._writers |= {down_w, up_w}
        try:
            await asyncio.gather(_pipe(down_r, up_w), _pipe(up_r, down_w))
        finally:
            self._writers -= {down_w, up_w}


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()


@dataclass
class Impostor:
    """What the peer under test did with the impostor: its first frame's type and fields, the
    types of the frames after the welcome, HTTP requests (it must make none) and whether it
    hung up."""

    url: str = ""
    hello: dict[str, Any] | None = None
    first_type: str | None = None
    after_welcome: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.asynccontextmanager
async def impostor_hub(welcome: m.Welcome) -> AsyncIterator[Impostor]:
    """A fake hub on 127.0.0.1 port 0 that answers the first hello with `welcome` (the real
    hub's values: its key, model digest and signature) whose proof is 64 bytes of zeros."""
    seen = Impostor()

    async def ws_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False)
        await ws.prepare(request)
        welcomed = False
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.BINARY:
                break
            frame = msgpack.unpackb(msg.data, raw=False)
            kind = frame.get("t") if isinstance(frame, dict) else None
            if seen.first_type is None:
                seen.first_type = str(kind)
            if welcomed:
                seen.after_welcome.append(str(kind))
            elif kind == "hello":
                seen.hello = frame
                await ws.send_bytes(_welcome_frame(welcome, frame))
                welcomed = True
        if welcomed:
            seen.hung_up.set()  # (a peer that comes back and hangs up again is seen once)
        return ws

    async def anything(request: web.Request) -> web.Response:
        seen.requests.append(f"{request.method} {request.path}")
        return web.Response(status=404, text="not here")

    app = web.Application()
    app.router.add_get("/ws", ws_handler)
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        seen.url = f"ws://127.0.0.1:{runner.addresses[0][1]}/ws"
        yield seen
    finally:
        await runner.cleanup()


def _welcome_frame(welcome: m.Welcome, hello: dict[str, Any]) -> bytes:
    """`welcome` framed as the real hub frames it for this hello: with the version the two
    sides negotiate (the lower of their highest; the frames module's design), so that only
    the proof differs from a real welcome."""
    theirs = hello.get("protocol", ABSENT_PROTOCOL)
    version = min(theirs if isinstance(theirs, int) else ABSENT_PROTOCOL, PROTOCOL_VERSION)
    fields = to_wire(dataclasses.replace(welcome, protocol=version))
    return msgpack.packb({"p": version, "t": m.Welcome.TYPE, **fields}, use_bin_type=True)
