"""Deadlines for every HTTP server we run: the hub's (websocket, chunks, status) and each peer's
chunk server both build their aiohttp runner with `runner(app)`.

aiohttp arms one timer per connection, `keepalive_timeout`, when the connection opens and again
when each response is done; if it fires while the server is still waiting for a request (none
started, or its request line and headers not all in), the connection is closed. Bytes that
trickle in do not re-arm it. So that one number bounds both what a security review asks for:
how long a connection may sit idle, and how long a client may take to deliver a request head,
counted from the connection's start or the end of the previous response. aiohttp's default is
3630 s: a half-sent request held a file descriptor for an hour. A request being handled is not
cut (a chunk request may wait for its chunk; its writes have deadlines of their own).

IDLE_S is above aiohttp's client keep-alive (15 s), so a pooled client connection is closed by
its client before the server times it out, and a GET racing the server's close is retried by
aiohttp's client. An honest client sends its request head in one write.
"""

from __future__ import annotations

from aiohttp import web

IDLE_S = 20.0


def runner(app: web.Application, idle_s: float | None = None) -> web.AppRunner:
    """An AppRunner for `app` whose connections close after `idle_s` (default IDLE_S) idle or
    waiting for a request head; no signal handlers, no access log."""
    return web.AppRunner(app, handle_signals=False, access_log=None,
                         keepalive_timeout=IDLE_S if idle_s is None else idle_s)
