"""The hub's aiohttp application: the peers' websocket, the hub's chunks, TLS, extra routes.

`bind` opens a listener first, so that a busy port fails the start before anything loads;
`serve(hub, host, port)` mounts the hub's routes (`Hub.routes()`: the peers' websocket on /ws
and the hub's share of the overlay's chunks on /chunk/...) and any extra ones, behind the HTTP
idle and request-head deadlines and a request budget per address (`hub.serving.http_limits`:
chunks and model files at the peers' rates, the rest as pages, /ws exempt: the join limits
hold it), with the hub's TLS, and sends the peers away on exit. It knows nothing of leases,
versions or rollouts: those are `echo2p2p.hub.serving.server.Hub`'s.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import ssl
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from echo2p2p.errors import ConfigError
from echo2p2p.request_budget import CHUNKS, FILES, RequestBudget
from echo2p2p.runtime import http_deadlines
from echo2p2p.runtime.tcp import listening_socket

from .http_limits import budget_middleware, request_budget

if TYPE_CHECKING:
    from .server import Hub

ROUTE_CLASSES = {"/ws": None, "/chunk/{version}/{base}/{index}": CHUNKS, "/model/": FILES,
                 "/model/{name}": FILES}  # every other route (/status) and path: pages


def bind(host: str, port: int, field: str, congestion: str = "") -> socket.socket:
    """A listener on host:port (`listening_socket`), bound before the run loads anything;
    ConfigError on `field` (the flag that sets the port), naming the fix, when it cannot be."""
    flag = "--" + field.replace("_", "-")
    where = f"{port} on {host or 'every address'}"
    try:
        return listening_socket(host, port, congestion)
    except socket.gaierror as exc:
        raise ConfigError(field, f"cannot listen on {host!r}: {exc.strerror}") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            problem = (f"port {where} is in use (another hub?): stop it or pass {flag} N "
                       f"(0 picks a free one)")
        elif exc.errno == errno.EACCES:
            problem = f"port {where} needs privileges: pass {flag} N with N >= 1024"
        else:
            problem = f"cannot listen on port {where}: {exc.strerror or exc}"
        raise ConfigError(field, problem) from None


@contextlib.asynccontextmanager
async def serve(hub: Hub, host: str, port: int, routes: dict[str, Any] | None = None, *,
                sock: socket.socket | None = None, budget: RequestBudget | None = None
                ) -> AsyncIterator[int]:
    """Serve the hub's routes and any extra GET `routes` on host:port (or on `sock`, a listener
    bound already: `bind`), under `budget` (None: one of this server's own, as the hub's
    limits say); yields the bound port. Peers are sent away on exit."""
    budget = budget or request_budget(hub.core.cfg.limits)
    app = web.Application(middlewares=[budget_middleware(budget, ROUTE_CLASSES)])
    for path, handler in {**hub.routes(), **(routes or {})}.items():
        app.router.add_get(path, handler)
    tls = tls_context(hub.core.cfg.network.tls_cert, hub.core.cfg.network.tls_key)
    runner = http_deadlines.runner(app)  # idle and request-head deadlines
    await runner.setup()
    try:
        sock = sock or bind(host, port, "port", hub.core.cfg.overlay.tcp_congestion)
        await web.SockSite(runner, sock, ssl_context=tls).start()
        async with hub:  # its timer runs while it serves; the peers are sent away on the exit
            yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def tls_context(cert: str, key: str) -> ssl.SSLContext | None:
    """The hub's TLS, for its peers' port and its dashboard's: None without a certificate."""
    if not cert:
        return None
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        tls.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("tls_cert", f"cannot load {cert} with key {key}: {exc}") from None
    return tls
