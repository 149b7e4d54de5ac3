"""The hub's aiohttp application: the peers' websocket, the hub's chunks, TLS, extra routes.

`serve(hub, host, port)` mounts `Hub.handle_ws` on /ws and the hub's share of the overlay's
chunks on /chunk/... (ticket-checked, rate-limited when `upload_limit_mbps` is set), behind the
HTTP idle and request-head deadlines, and sends the peers away on exit. It knows nothing of
leases, versions or rollouts: those are `echo2p2p.hub.server.Hub`'s.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from echo2p2p.errors import ConfigError
from echo2p2p.overlay.serving import TokenBucket, UploadMeter, chunk_handler
from echo2p2p.overlay.tickets import Tickets
from echo2p2p.runtime import http_deadlines
from echo2p2p.runtime.tcp import listening_socket

if TYPE_CHECKING:
    from .server import Hub


@contextlib.asynccontextmanager
async def serve(hub: Hub, host: str, port: int, routes: dict[str, Any] | None = None
                ) -> AsyncIterator[int]:
    """Serve the peers' websocket (/ws), the hub's chunks (/chunk/...) and any extra GET
    `routes` on host:port; yields the bound port. Peers are sent away on exit."""
    app = web.Application()
    app.router.add_get("/ws", hub.handle_ws)
    cap_mbps = hub.cfg.overlay.upload_limit_mbps
    limiter = TokenBucket(cap_mbps * 1e6) if cap_mbps else None
    app.router.add_get("/chunk/{version}/{base}/{index}", chunk_handler(
        hub.chunk_lookup, UploadMeter(), limiter, on_served=hub.chunk_served,
        authorize=Tickets(hub.hub_key, hub.run_id, "hub")))
    for path, handler in (routes or {}).items():
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
