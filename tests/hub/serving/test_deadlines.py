"""Every network wait has a deadline: a connection that never says hello, a chunk receiver
that stops reading, and a hub that stops reading our frames are all cut off, not waited on."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p.overlay.serving import UploadMeter, chunk_handler

from tests.conftest import serving, tracker


async def test_hub_closes_a_connection_that_never_says_hello():
    async with tracker(peer_timeout_s=0.5) as (hub, _, url, _), aiohttp.ClientSession() as http:
        async with http.ws_connect(url) as ws:
            frame = await ws.receive(timeout=30)
            while frame.type is aiohttp.WSMsgType.BINARY:  # the Goodbye that says why
                assert m.decode(frame.data).code == m.CLOSE_TIMEOUT
                frame = await ws.receive(timeout=30)
            assert ws.close_code == m.CLOSE_TIMEOUT
        assert not hub.peer_views()


async def test_chunk_server_cuts_off_a_receiver_that_stops_reading():
    """With one upload slot, a receiver that takes nothing would block every other one; it is
    cut off after the write deadline and the next receiver gets the whole chunk."""
    data = bytes(range(256)) * (128 << 10)  # 32 MiB: more than loopback's socket buffers hold

    async def lookup(version, base, index, wait_s):
        return data

    app = web.Application()
    app.router.add_get("/chunk/{version}/{base}/{index}",
                       chunk_handler(lookup, UploadMeter(), slots=1, write_deadline_s=0.5))
    async with serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /chunk/1/full/0 HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/chunk/1/full/0",
                                timeout=aiohttp.ClientTimeout(total=60)) as resp:
                assert await resp.read() == data
        received = 0
        try:
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 30):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < len(data)  # cut off: it never got the whole chunk
        writer.close()
