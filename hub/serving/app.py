"""The hub's aiohttp application: the peers' websocket, the hub's chunks, TLS, extra routes.

`serve(hub, host, port)` mounts the hub's routes (`Hub.routes()`: the peers' websocket on /ws
and the hub's share of the overlay's chunks on /chunk/...) and any extra ones, behind the HTTP
idle and request-head deadlines, with the hub's TLS, and sends the peers away on exit. It knows nothing of
leases, versions or rollouts: those are `echo2p2p.hub.serving.server.Hub`'s.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from echo2p2p.errors import ConfigError
from echo2p2p.runtime import http_deadlines
from echo2p2p.runtime.tcp import listening_socket

if TYPE_CHECKING:
    from .server import Hub


@contextlib.asynccontextmanager
async def serve(hub: Hub, host: str, port: int, routes: dict[str, Any] | None = None
                ) -> AsyncIterator[int]:
    """Serve the hub's routes and any extra GET `routes` on host:port; yields the bound port.
    Peers are sent away on exit."""
    app = web.Application()
    for path, handler in {**hub.routes(), **(routes or {})}.items():
        app.router.add_get(path, handler)
    tls = tls_context(hub.cfg.network.tls_cert, hub.cfg.network.tls_key)
    runner = http_deadlines.runner(app)  # idle and request-head deadlines
    await runner.setup()
    try:
        sock = listening_socket(host, port, hub.cfg.overlay.tcp_congestion)
        await web.SockSite(runner, sock, ssl_context=tls).start()
        yield runner.addresses[0][1]
    finally:
        await hub.close_all()
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
