"""Prometheus /metrics of a running hub, read from the run at scrape time (prometheus_client).

(Placeholder being filled in: one gauge so far.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from .trainer import HubRun


class RunCollector:
    """Reads the run each scrape: nothing is counted twice, nothing on the hub's hot paths."""

    def __init__(self, run: HubRun) -> None:
        self.run = run

    def collect(self):
        yield GaugeMetricFamily("echo2_step", "The learner's step (the newest version trained).",
                                value=self.run.hub.step)


def metrics_handler(run: HubRun) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /metrics: the text exposition of `run`'s metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(run))

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle
