"""What the hub's and the peers' Prometheus /metrics share (prometheus_client): the GET handler
of a registry's text exposition, a one-sample gauge, and label values made from the other
side's text: at most LABEL_CHARS characters of [A-Za-z0-9._-], any other character '_', so a
name can neither break the exposition format nor grow a series' label without bound."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

LABEL_CHARS = 32  # the longest label value made from text the other side sent
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def label_text(text: str, limit: int = LABEL_CHARS) -> str:
    """`text` cut to `limit` characters of [A-Za-z0-9._-] ('_' for any other)."""
    return _UNSAFE.sub("_", text[:limit])


def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    """A gauge of one sample, or of none while `value` is unknown (the family is still listed,
    so a dashboard's query names something that exists)."""
    if value is None:
        return GaugeMetricFamily(name, doc, labels=[])
    return GaugeMetricFamily(name, doc, value=float(value))


def exposition(registry: CollectorRegistry) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /metrics: `registry`'s text exposition, collected at each request."""

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle
