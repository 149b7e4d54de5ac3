"""What the hub's HTTP servers (the peers' port and the dashboard's) do against floods: a request
budget per address (`budget_middleware`, the shell of `echo2p2p.request_budget`) and bodies
built at most once a moment (`Recent`).

Every request but the peers' websocket (/ws, which the join limits govern) spends from its
address's budget for its route's class (an IPv6 address counts as its /64, as for joins): over
its rate it waits its turn, past the longest wait it is answered 429 with Retry-After a second
later, and past the requests one address may have open it is answered 429 at once and its
connection closed. A /status, /metrics or dashboard answer is built from the run at most once
every FRESH_S (`Recent`), so a flood that the budget lets through still costs one build a
moment. Knows nothing of what the routes answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any, TypeVar

from aiohttp import web

from echo2p2p.request_budget import DROP, PAGES, REFUSE, RequestBudget, hub_limits
from echo2p2p.runtime.process import loop_now

from ..config_sections import LimitsConfig
from ..core.peer import address_group

log = logging.getLogger(__name__)

FRESH_S = 1.0  # how long a built /status, /metrics or dashboard body is answered again
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request_budget(limits: LimitsConfig) -> RequestBudget:
    """The budget of a hub's HTTP servers, as `limits` sets its pages' rate."""
    return RequestBudget(hub_limits(limits.http_requests_per_min, limits.http_burst))


def budget_middleware(budget: RequestBudget, classes: Mapping[str, str | None]) -> Any:
    """An aiohttp middleware holding every request to `budget`: its class is `classes`' value
    for its route (the route's path as registered, e.g. "/chunk/{version}/{base}/{index}"; None:
    exempt), PAGES for a route not listed and for a path that matches none."""

    @web.middleware
    async def limit(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = classes.get(resource.canonical, PAGES) if resource is not None else PAGES
        if route is None:
            return await handler(request)
        address = address_group(request.remote)
        verdict = budget.admit(route, address, loop_now())
        if verdict.action == DROP:
            log.info("closed a connection from %s: %d %s requests open already", address,
                     budget.open_requests(route, address), route)
            answer = too_many(verdict.retry_after_s)
            answer.force_close()
            return answer
        try:
            if verdict.delay_s:
                await asyncio.sleep(verdict.delay_s)  # its turn, or the refusal's hold: a pacing timer
                if request.transport is None:  # the client went meanwhile: build nothing for it
                    return too_many(verdict.retry_after_s)
            if verdict.action == REFUSE:
                log.info("refused a request for %r from %s: over its budget of %s requests",
                         request.path[:80], address, route)
                return too_many(verdict.retry_after_s)
            return await handler(request)
        finally:
            budget.done(route, address)

    return limit


def too_many(retry_after_s: int) -> web.Response:
    return web.Response(status=429, headers={"Retry-After": str(retry_after_s)},
                        text=f"too many requests from this address: retry after {retry_after_s} s\n")


class Recent:
    """Values built at most once every `fresh_s` each, by key: what a flood of a computed route
    costs is one build a moment, whatever the rate. The keys are the caller's few constants."""

    def __init__(self, fresh_s: float | None = None):
        self.fresh_s = FRESH_S if fresh_s is None else fresh_s
        self._kept: dict[Hashable, tuple[float, Any]] = {}

    def get(self, key: Hashable, build: Callable[[], T], now: float | None = None) -> T:
        """`key`'s value, built again by `build()` if it is older than `fresh_s` at `now` (the
        event loop's clock when not given)."""
        now = loop_now() if now is None else now
        kept = self._kept.get(key)
        if kept is None or not 0 <= now - kept[0] < self.fresh_s:
            kept = self._kept[key] = (now, build())
        return kept[1]
