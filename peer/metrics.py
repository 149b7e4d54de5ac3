"""A peer's own Prometheus /metrics: what it generated, fetched, relayed and has not yet had
answered, read from the running `PeerClient` at each scrape (prometheus_client).

Each peer has a registry of its own (several peers may share a process, as in the tests; the
global default registry is never used) holding one collector that reads the client's parts
(`statistics()`, the fetcher, the worker, the outbox, the chunk server's upload meter); nothing
is counted for Prometheus on the peer's paths. Every name starts `echo2_peer_` (the hub's view
of a peer is its own `echo2_hub_peer_` series). `metrics_server` serves /metrics at
`cfg.metrics_host:cfg.metrics_port` for as long as the peer runs. Text the hub sent (its reject
reasons, our id in its run) is cut to a safe label and its distinct values bounded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric

from echo2p2p.runtime import http_deadlines
from echo2p2p.runtime.prometheus import exposition, gauge, label_text

if TYPE_CHECKING:
    from echo2p2p import messages as m
    from echo2p2p.overlay.serving import UploadMeter

    from .config import PeerConfig
    from .fetcher import Fetcher
    from .outbox import Outbox
    from .worker import RolloutWorker

log = logging.getLogger(__name__)

MAX_REASONS = 16  # reject reasons with a series of their own; the rest count as "other"


class Observed(Protocol):
    """What the collector reads of a peer (a `PeerClient`, which imports this module: the
    client is described here, not imported)."""

    cfg: PeerConfig
    welcome: m.Welcome | None
    fetcher: Fetcher
    worker: RolloutWorker
    meter: UploadMeter
    outbox: Outbox

    def statistics(self) -> Any: ...  # Any: a `PeerStats`, the client's (which imports us)


class PeerCollector:
    """Reads one peer each scrape."""

    def __init__(self, peer: Observed) -> None:
        self.peer = peer

    def collect(self) -> Iterator[Metric]:
        peer = self.peer
        stats, fetcher, welcome = peer.statistics(), peer.fetcher, peer.welcome
        info = {"engine": peer.cfg.engine, "name": label_text(peer.cfg.display_name)}
        if welcome is not None:
            info |= {"peer": label_text(welcome.peer_id), "run_id": label_text(welcome.run_id)}
        yield InfoMetricFamily("echo2_peer", "This peer: its engine and name, and the id and "
                               "run the hub gave it.", value=info)
        yield gauge("echo2_peer_held_version", "The version the engine generates with (a relay: "
                     "the newest complete one).", stats.version)
        for name, doc, value in (
            ("echo2_peer_connections", "Connections the hub welcomed.", stats.connections),
            ("echo2_peer_versions_fetched", "Versions downloaded and verified.",
             fetcher.versions_fetched),
            ("echo2_peer_versions_loaded", "Versions swapped into the engine.", stats.versions_loaded),
            ("echo2_peer_generated_tokens", "Model tokens sampled.", peer.worker.tokens_generated),
            ("echo2_peer_relayed_bytes", "Chunk bytes this peer's chunk server sent to others.",
             peer.meter.served_bytes),
            ("echo2_peer_submitted_groups", "Rollout groups submitted to the hub.", stats.submitted),
            ("echo2_peer_acked_groups", "Submitted groups the hub admitted.", stats.acked),
            ("echo2_peer_outbox_spilled_groups", "Unanswered groups spilled to the spool "
                                                 "directory.", peer.outbox.spilled_total),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        fetched = CounterMetricFamily("echo2_peer_fetched_bytes", "Chunk bytes of versions "
                                      "fetched, by source.", labels=["source"])
        fetched.add_metric(["hub"], fetcher.bytes_from_hub)
        fetched.add_metric(["peers"], fetcher.bytes_from_peers)
        yield fetched
        yield rejected_by_reason(stats.rejected)
        yield gauge("echo2_peer_outbox_groups", "Submitted groups the hub has not answered yet "
                     "(sent again on reconnect).", len(peer.outbox))
        yield gauge("echo2_peer_leases_held", "Leases generating or queued.", peer.worker.held())


def rejected_by_reason(reasons: dict[str, int]) -> CounterMetricFamily:
    """Rejected groups by the hub's reason: MAX_REASONS reasons (the most frequent) by name,
    the rest as "other"."""
    family = CounterMetricFamily("echo2_peer_rejected_groups", "Submitted groups the hub "
                                 "rejected, by its reason.", labels=["reason"])
    counts: dict[str, int] = {}
    ranked = sorted(reasons.items(), key=lambda kv: -kv[1])
    for i, (reason, n) in enumerate(ranked):
        key = label_text(reason) if i < MAX_REASONS else "other"
        counts[key] = counts.get(key, 0) + n
    for reason, n in counts.items():
        family.add_metric([reason], n)
    return family



def peer_registry(peer: Observed) -> CollectorRegistry:
    """A registry of `peer`'s metrics alone."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PeerCollector(peer))
    return registry


@contextlib.asynccontextmanager
async def metrics_server(peer: Observed) -> AsyncIterator[str | None]:
    """Serve GET /metrics of `peer` at cfg.metrics_host:metrics_port while the block runs;
    yields its URL (None when metrics_port is -1)."""
    cfg = peer.cfg
    if cfg.metrics_port < 0:
        yield None
        return
    app = web.Application()
    app.router.add_get("/metrics", exposition(peer_registry(peer)))
    runner = http_deadlines.runner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.metrics_host, cfg.metrics_port).start()
        host, port = runner.addresses[0][:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
        log.info("metrics on %s", url)
        yield url
    finally:
        await runner.cleanup()
