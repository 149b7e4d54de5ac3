"""Request budgets: how often one address may make the hub's HTTP servers work, and how many of
its requests may be open there at once.

Theory of operation (nginx's `limit_req` with a burst that is delayed, not rejected, and Tor's
token buckets, which stop reading a connection that is over its rate). Each route class
(`PAGES`: /status, /metrics and the dashboard; `STREAMS`: the dashboard's event stream;
`FILES`: the model files; `CHUNKS`: the hub's chunks) has, per address, a token bucket
(`join_limits.Buckets`: a burst at once, then a steady rate) and a bound on requests open at
once. A request that

- finds a token is served at once;
- finds none waits its turn: the bucket goes into debt and the request is served when its
  token comes, provided that is within the class's `max_wait_s`, so a client over its rate is
  slowed, never failed, and the server reads nothing more from that connection meanwhile;
- would wait longer is refused (429 with Retry-After), spends no token, and is answered only
  REFUSED_AFTER_S later: a client that asks again at once is held to one request a second per
  connection, so a flood costs the hub a few answers a second, not the answers as fast as the
  attacker can ask;
- finds its address with `max_open` requests of the class open already (waiting, held or
  being answered, as a long poll or an event stream is), or the server with MAX_OPEN in all,
  is dropped: answered 429 at once and its connection closed. That bounds the memory a flood
  from many connections holds.

Pure: `now` comes in (seconds, any monotonic clock); the buckets kept are bounded per class
(the least recently used go first); the open counts keep only addresses with a request open.
What an address is (an IPv6 /64 as one) is the caller's; so are the routes of each class.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from .join_limits import MAX_KEYS, Buckets, Rate

PAGES, STREAMS, FILES, CHUNKS = "pages", "streams", "files", "chunks"
SERVE, REFUSE, DROP = "serve", "refuse", "drop"
OUTCOMES = ("delayed", "refused", "dropped")  # what statistics() counts, besides served
REFUSED_AFTER_S = 1.0  # a refusal is answered no sooner: a client asking again at once waits
MAX_OPEN = 4096  # requests open at once on one server, every address together


@dataclass(frozen=True)
class RouteLimit:
    """One route class's limits per address: its bucket (`rate.per_min` 0: no rate limit), the
    longest a request may wait for its turn, and the requests it may have open at once."""

    rate: Rate
    max_wait_s: float
    max_open: int


@dataclass(frozen=True)
class Verdict:
    """What to do with one request: SERVE it after `delay_s` (0: at once); REFUSE it (429,
    Retry-After `retry_after_s`) after `delay_s`; or DROP it (429 at once, connection closed).
    A SERVE or REFUSE verdict opens a request: tell `RequestBudget.done` when it is answered."""

    action: str
    delay_s: float = 0.0
    retry_after_s: int = 0


@dataclass(frozen=True)
class BudgetStatistics:
    """A request budget's counts since it was made: requests served, by route class, and those
    delayed (served late), refused and dropped, by (class, outcome); requests open now."""

    served: Mapping[str, int]
    limited: Mapping[tuple[str, str], int]
    open: int


def hub_limits(pages_per_min: float, pages_burst: int) -> dict[str, RouteLimit]:
    """The hub's route classes. PAGES (and an event stream's opening) at the configured rate:
    a page load is 6 requests, a Prometheus scrape one each 15 s, `echo2-hub status` one each
    few seconds. FILES and CHUNKS are asked for by peers, with their tickets: a peer's join
    fetches about 8 model files, a version is up to thousands of chunks (long polls of up to
    30 s), and a lab's peers may share one NAT address, so their budgets are sized for many
    peers at once and only stop a flood of requests the ticket check would refuse."""
    pages = Rate(pages_per_min, pages_burst)
    return {PAGES: RouteLimit(pages, max_wait_s=2.0, max_open=64),
            STREAMS: RouteLimit(pages, max_wait_s=2.0, max_open=64),
            FILES: RouteLimit(Rate(600, 256), max_wait_s=2.0, max_open=64),
            CHUNKS: RouteLimit(Rate(12_000, 2048), max_wait_s=2.0, max_open=1024)}


class RequestBudget:
    """The request budgets of one or more HTTP servers, by route class and address."""

    def __init__(self, limits: Mapping[str, RouteLimit], max_open: int = MAX_OPEN,
                 max_keys: int = MAX_KEYS):
        self.limits = dict(limits)
        self.max_open = max_open
        self._buckets = {route: Buckets(limit.rate, max_keys) for route, limit in limits.items()}
        self._open: Counter[tuple[str, Hashable]] = Counter()
        self._open_total = 0
        self._served: Counter[str] = Counter()
        self._limited: Counter[tuple[str, str]] = Counter()

    def admit(self, route: str, address: Hashable, now: float) -> Verdict:
        """The verdict on a request of class `route` from `address` arriving at `now` (a token
        spent when it is served, none when it is refused or dropped)."""
        limit = self.limits[route]
        if (self._open[route, address] >= limit.max_open
                or self._open_total >= self.max_open):
            self._limited[route, "dropped"] += 1
            return Verdict(DROP, retry_after_s=math.ceil(REFUSED_AFTER_S))
        bucket, per_s = self._buckets[route], limit.rate.per_min / 60
        wait_s = 0.0
        if per_s > 0:
            level = bucket.level(address, now)
            wait_s = max(0.0, (1 - level) / per_s)  # until its token has come
            if wait_s > limit.max_wait_s:
                self._limited[route, "refused"] += 1
                self._opened(route, address)
                return Verdict(REFUSE, REFUSED_AFTER_S, max(1, math.ceil(wait_s)))
            bucket.take(address, now)  # into debt when it waits: the next one waits longer
        self._served[route] += 1
        if wait_s > 0:
            self._limited[route, "delayed"] += 1
        self._opened(route, address)
        return Verdict(SERVE, wait_s)

    def done(self, route: str, address: Hashable) -> None:
        """A request that `admit` served or refused has been answered (or given up)."""
        key = (route, address)
        if self._open[key] <= 1:
            self._open.pop(key, None)
        else:
            self._open[key] -= 1
        self._open_total = max(0, self._open_total - 1)

    def open_requests(self, route: str, address: Hashable) -> int:
        """Requests of class `route` from `address` open now."""
        return self._open.get((route, address), 0)

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(dict(self._served), dict(self._limited), self._open_total)

    def _opened(self, route: str, address: Hashable) -> None:
        self._open[route, address] += 1
        self._open_total += 1
