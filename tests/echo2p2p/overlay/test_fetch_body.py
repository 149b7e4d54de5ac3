"""`fetch_chunk` reads a body with the socket's receive low-water mark raised (one wake-up per
RCVLOWAT_BYTES, not per packet): every body size comes whole, a body cut short ends as
"unreachable" instead of hanging, and the mark is back at 1 when the connection returns to the
pool, so the next request on it (whose headers are far below the mark) is answered."""

from __future__ import annotations

import asyncio
import os
import socket

import aiohttp
from aiohttp import web

from echo2p2p.overlay.fetch import RCVLOWAT_BYTES, fetch_chunk

BODIES = {"small": os.urandom(100), "odd": os.urandom(RCVLOWAT_BYTES * 3 + 7),
          "exact": os.urandom(RCVLOWAT_BYTES)}


async def _body(request: web.Request) -> web.StreamResponse:
    """The body named in the path, written in 1 KiB pieces, each drained; /short/ announces
    its length but closes the connection half-way."""
    name = request.match_info["name"]
    data = BODIES[name.removeprefix("short-")]
    response = web.StreamResponse()
    response.content_length = len(data)
    await response.prepare(request)
    end = len(data) // 2 if name.startswith("short-") else len(data)
    for pos in range(0, end, 1024):
        await response.write(data[pos:min(pos + 1024, end)])
    if end < len(data):
        request.transport.close()
        return response
    await response.write_eof()
    return response


async def _server(**routes) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/b/{name}", _body)
    for path, handler in routes.items():
        app.router.add_get(f"/{path}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def test_every_body_comes_whole_and_the_pooled_connection_is_reset():
    runner, base = await _server()
    connector = aiohttp.TCPConnector(limit=1)  # one connection: each request reuses it
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            for _ in range(2):
                for name, data in BODIES.items():
                    answer = await fetch_chunk(http, f"{base}/b/{name}", len(data), wait_s=0,
                                               deadline_s=10, headers={})
                    assert answer.fault is None and answer.data == data, name
            (conn,) = [c for conns in connector._conns.values() for c, _ in conns]
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        await runner.cleanup()


async def test_a_body_cut_short_is_unreachable_not_a_hang():
    runner, base = await _server()
    try:
        async with aiohttp.ClientSession() as http:
            data = BODIES["odd"]
            answer = await asyncio.wait_for(fetch_chunk(
                http, f"{base}/b/short-odd", len(data), wait_s=0, deadline_s=30, headers={}), 10)
            assert answer.fault == "unreachable"
    finally:
        await runner.cleanup()


async def test_the_mark_is_raised_while_the_body_comes():
    """The body's first KiB, then the server waits until the client's socket has a mark above
    1 (it would wait in vain if the body were read a packet at a time)."""
    data, proceed = BODIES["odd"], asyncio.Event()

    async def paused(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = len(data)
        await response.prepare(request)
        await response.write(data[:1024])
        await proceed.wait()
        await response.write(data[1024:])
        await response.write_eof()
        return response

    runner, base = await _server(paused=paused)
    connector = aiohttp.TCPConnector()
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            fetch = asyncio.create_task(fetch_chunk(http, f"{base}/paused", len(data), wait_s=0,
                                                    deadline_s=10, headers={}))
            marks = []
            for _ in range(500):  # up to 5 s
                marks = [p.transport.get_extra_info("socket").getsockopt(
                    socket.SOL_SOCKET, socket.SO_RCVLOWAT)
                    for p in connector._acquired if p.transport is not None]
                if any(mark > 1 for mark in marks):
                    break
                await asyncio.sleep(0.01)
            proceed.set()
            answer = await fetch
            assert max(marks, default=0) == RCVLOWAT_BYTES
            assert answer.fault is None and answer.data == data
    finally:
        await runner.cleanup()
