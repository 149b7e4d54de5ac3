"""The peer's own chunk server: serves the versions it holds to the other peers.

Started once, for as long as the peer runs (across connections), at `cfg.listen` (nothing when
it is ''): GET /chunk/{version}/{base}/{index} from the client's chunk store, admitted by the
tickets the hub issues (`echo2p2p.overlay.tickets`), metered and optionally rate-limited
(`echo2p2p.overlay.serving`), under the idle and request-head deadlines of
`echo2p2p.runtime.http_deadlines`; and GET /gossip, the gossip links others open to us
(`echo2p2p.overlay.links`, which share the rate limit). It also bounds the links' life: they
close, dialled ones too, when it stops. It never fetches anything and never speaks to the hub; it
only says, once bound, the URL other peers reach it at.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from echo2p2p.overlay.links import LINK_PATH, Links, link_handler
from echo2p2p.overlay.serving import (PROBE_PATH, TokenBucket, UploadMeter, chunk_handler,
                                      probe_handler)
from echo2p2p.overlay.store import ChunkStore
from echo2p2p.overlay.tickets import Tickets
from echo2p2p.runtime import http_deadlines
from echo2p2p.runtime.tcp import listening_socket

from .config import PeerConfig

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def chunk_server(cfg: PeerConfig, store: Callable[[], ChunkStore], meter: UploadMeter,
                       tickets: Tickets, *, hub_url: str, links: Links | None = None
                       ) -> AsyncIterator[str | None]:
    """Serve chunks from `store()` (read at each request: a welcome may replace the store);
    yields the URL other peers should use, or None when `cfg.listen` is ''."""
    async with _serve(cfg, store, meter, tickets, hub_url=hub_url, links=links) as url:
        if links is None:
            yield url
            return
        links.url = url
        try:
            yield url
        finally:
            await links.close()  # before the server's cleanup, which waits for open links


@contextlib.asynccontextmanager
async def _serve(cfg: PeerConfig, store: Callable[[], ChunkStore], meter: UploadMeter,
                 tickets: Tickets, *, hub_url: str, links: Links | None
                 ) -> AsyncIterator[str | None]:
    if not cfg.listen:
        yield None
        return
    if links is not None:
        limiter = links.limiter  # one cap for both routes
    else:
        limiter = TokenBucket(cfg.upload_limit_mbps * 1e6) if cfg.upload_limit_mbps else None
    app = web.Application()
    app.router.add_get("/chunk/{version}/{base}/{index}",
                       chunk_handler(lambda *a: store().chunk(*a), meter, limiter,
                                     authorize=tickets))
    app.router.add_get(PROBE_PATH, probe_handler(limiter, authorize=tickets.hub_only))
    if links is not None:
        app.router.add_get(LINK_PATH, link_handler(links, tickets))
    runner = http_deadlines.runner(app)  # idle and request-head deadlines
    await runner.setup()
    host, port = cfg.listen_host_port
    site = web.SockSite(runner, listening_socket(host, port, cfg.tcp_congestion))
    await site.start()
    bound_port = runner.addresses[0][1]
    served_url = cfg.advertise or f"http://{reachable_host(host, hub_url)}:{bound_port}"
    log.info("serving chunks on %s:%d as %s", host, bound_port, served_url)
    try:
        yield served_url
    finally:
        await runner.cleanup()


def reachable_host(listen_host: str, hub_url: str) -> str:
    """The address other peers should use: the listen host, or for a wildcard, the address of
    the interface that routes to the hub (a connected UDP socket sends nothing)."""
    if listen_host not in ("", "0.0.0.0", "::"):
        return listen_host
    hub_host = hub_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((hub_host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
