"""What the hub counts and what it reports of itself: `Counters` and `HubStatistics`.

`Counters` are running totals the hub's parts bump as things happen (admitted groups, refusals,
peers closed for protocol faults, relay reports...); the learner loop logs them every step.
`HubStatistics` is the frozen picture `Hub.statistics()` returns (trio's `statistics()`), so
tests and benches read the hub without reaching into its structures; `Changes` wakes the hub's
`wait_<condition>()` coroutines when something they may wait for changed. No clock, no I/O.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Counters:
    admitted_groups: int = 0
    admitted_samples: int = 0
    stale_on_arrival: int = 0
    rejected: int = 0
    duplicates: int = 0
    closed_for_protocol: int = 0
    refused: int = 0  # joins without a valid token
    joins_too_often: int = 0  # hellos refused by the join limits (echo2p2p.join_limits)
    cut_off: int = 0  # peers that stopped reading
    spot_checked: int = 0  # submissions whose logprobs or version tag were checked
    spot_failed: int = 0  # of those, forged (see hub.spotcheck)
    withdrawn_groups: int = 0  # admitted, then taken from the queue: their peer was quarantined
    leases_expired: int = 0  # leases whose connected holder let them run out (hub.server)
    forged_passes: int = 0  # completions whose program tried to forge its tests' verdict
    scoring_refused: int = 0  # rollouts refused unscored: their peer was over its scoring budget
    relay_reports: Counter[tuple[str, str]] = field(default_factory=Counter)  # (peer, reason)
    stale_lags: Counter[int] = field(default_factory=Counter)  # lag in versions -> stale on arrival

    def totals(self) -> dict[str, int]:
        """The running totals (the histograms left out), as `HubStatistics` takes them."""
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}


@dataclass(frozen=True)
class HubStatistics:
    """One look at a hub (`Hub.statistics()`)."""

    step: int  # the learner's version
    training: bool  # a batch was taken and step `step` is running on it
    newest_version: int | None  # the newest published, None before the first
    peers: int  # connected (welcomed)
    active_peers: int  # of those, leased work by the activation pool
    quarantined_peers: int  # of those, whose identity is quarantined
    queued_groups: int  # admitted, waiting for the learner
    open_leases: int  # granted, not yet answered
    judging: int  # submissions being scored or spot-checked
    admitted_groups: int
    admitted_samples: int
    stale_on_arrival: int
    rejected: int
    duplicates: int
    closed_for_protocol: int
    refused: int
    cut_off: int
    spot_checked: int
    spot_failed: int
    withdrawn_groups: int
    leases_expired: int
    relay_reports: int  # accusations heard, all peers and reasons
    joins_too_often: int
    catch_up_builds: int  # catch-up deltas encoded (hub.catchup)
    catch_up_shared: int  # catch-up deltas a peer got from the cache, another's encode
    forged_passes: int
    scoring_refused: int


class Changes:
    """Wakes every `wait_for` when `notify` says the hub changed: each looks at its condition
    again (a condition variable without a lock: the hub lives on one event loop)."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds, looking again at every `notify`."""
        while not condition():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def after(self, call: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        """`call`, then `notify`: for a callback whose call is itself a change."""
        def then_notify(record: dict[str, Any]) -> None:
            call(record)
            self.notify()
        return then_notify
