"""HTTP servers close connections that sit idle or never finish their request head, on real
sockets on 127.0.0.1: a small app behind `http_deadlines.runner`, the hub's own server and a
peer's chunk server."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
import pytest
from aiohttp import web

from echo2p2p.runtime import http_deadlines

from tests.conftest import running_peers, serving, tracker

DEADLINE_S = 0.3  # short, so that the tests below see the server's close quickly
GUARD_S = 60.0  # a test that hangs fails here instead; it is not what the tests assert


async def hello(request: web.Request) -> web.Response:
    return web.Response(text="hi")


@contextlib.asynccontextmanager
async def small_server(idle_s: float):
    app = web.Application()
    app.router.add_get("/hello", hello)
    async with serving(app, http_deadlines.runner(app, idle_s)) as port:
        yield port


async def closed_by_server(port: int, send: bytes) -> bool:
    """Open a connection, send `send` (maybe nothing), and wait for the server to close it:
    True once recv returns b"" (the close itself, not a timer of ours)."""
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setblocking(False)
        if send:
            await loop.sock_sendall(sock, send)
        async with asyncio.timeout(GUARD_S):
            while True:
                try:
                    data = await loop.sock_recv(sock, 4096)
                except ConnectionResetError:
                    return True
                if data == b"":
                    return True


HALF_REQUEST = b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@pytest.mark.parametrize("send", [b"", b"GE", HALF_REQUEST], ids=["idle", "half-line", "half-head"])
async def test_idle_or_half_sent_request_is_closed(send):
    """A connection that sends nothing, or part of a request head, is closed by the server."""
    async with small_server(DEADLINE_S) as port:
        assert await closed_by_server(port, send)


async def test_a_trickled_request_head_is_closed_too():
    """Bytes trickling in do not keep a request head alive: the deadline counts from the start."""
    loop = asyncio.get_running_loop()
    async with small_server(DEADLINE_S) as port:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setblocking(False)
            await loop.sock_sendall(sock, b"GET /hello HTTP/1.1\r\n")
            closed = asyncio.ensure_future(loop.sock_recv(sock, 4096))
            async with asyncio.timeout(GUARD_S):
                while not closed.done():  # one header byte each time the loop comes round
                    try:
                        await loop.sock_sendall(sock, b"X")
                    except (BrokenPipeError, ConnectionResetError):
                        break
                    await asyncio.sleep(0.01)  # pacing the trickle, not waiting for an outcome
                try:
                    assert await closed == b""
                except ConnectionResetError:
                    pass  # closed with our trickled bytes unread: a reset, a close all the same


async def test_honest_requests_still_work_and_keep_alive():
    """Complete requests are answered, two on one kept-alive connection, then idle closes it."""
    async with small_server(DEADLINE_S) as port, aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.get(f"http://127.0.0.1:{port}/hello") as resp:
                assert resp.status == 200 and await resp.text() == "hi"
    async with small_server(DEADLINE_S) as port:
        raw = b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        loop = asyncio.get_running_loop()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setblocking(False)
            await loop.sock_sendall(sock, raw)
            got = b""
            async with asyncio.timeout(GUARD_S):
                while (data := await loop.sock_recv(sock, 4096)) != b"":
                    got += data  # the answer, then the idle close
            assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"hi")


async def test_hub_and_peer_servers_use_the_deadlines(monkeypatch):
    """The hub's server and a peer's chunk server both close a half-sent request."""
    monkeypatch.setattr(http_deadlines, "IDLE_S", DEADLINE_S)
    async with tracker() as (hub, _, url, _records):
        hub_port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert await closed_by_server(hub_port, HALF_REQUEST)
        async with running_peers(url, 1, engine="relay", listen="127.0.0.1:0") as (peer,):
            await asyncio.wait_for(peer.wait_connected(), 60)  # its server starts first
            peer_port = int(peer.served_url.rsplit(":", 1)[1])
            assert await closed_by_server(peer_port, HALF_REQUEST)
