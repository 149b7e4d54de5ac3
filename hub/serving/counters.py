"""What the hub reports of itself: `HubStatistics`, `PeerView` (the counts are the core's
`hub.core.counters.Counters`).

`HubStatistics` is the frozen picture `Hub.statistics()` returns (trio's `statistics()`) and
`PeerView` the frozen look at one connected peer (`Hub.peer_views()`): /status, /metrics, the
dashboard, the step record, tests and benches read the hub through these two, never its parts.
`Changes` wakes the hub's `wait_<condition>()` coroutines when something they may wait for
changed. No clock, no I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.counters import Counters

__all__ = ["Changes", "Counters", "HubStatistics", "PeerView", "peer_view", "statistics_of"]

if TYPE_CHECKING:
    from echo2p2p.buffer import RolloutBuffer, ScoredGroup
    from echo2p2p.leases import LeaseBook
    from echo2p2p.pool import Pool
    from echo2p2p.read_budget import BudgetStatistics
    from echo2p2p.scoring.scorer import Scorer, ScorerStats
    from echo2p2p.trust import TrustBook

    from ..core.peer import Peer
    from ..core.tracker import VersionTracker


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
    closed_for_flooding: int
    spot_checked: int
    spot_failed: int
    withdrawn_groups: int
    leases_expired: int
    relay_reports: int  # accusations heard, all peers and reasons
    joins_too_often: int
    catch_up_builds: int  # catch-up deltas encoded (hub.overlay.catchup)
    catch_up_shared: int  # catch-up deltas a peer got from the cache, another's encode
    forged_passes: int
    scoring_refused: int
    requeued_leases: int  # leases put back in the queue (expired, refused, released), all told
    drawn_problems: int  # problems the lease book has drawn from its epochs so far
    queue: tuple[ScoredGroup, ...]  # the admitted groups waiting for the learner, oldest first
    queue_sources: Mapping[str, str]  # lease id -> identity of the peer that made it, of those
    stale_in_queue: int  # admitted groups aged out of the queue untrained
    filtered_groups: int  # admitted, all G rewards equal, never trained (dynamic sampling)
    dropped_lags: Mapping[int, int]  # lag in versions -> groups dropped as stale (arrival, queue)
    rejected_by: Mapping[str, int]  # reason -> groups turned away for it (rejected and stale)
    frames_dropped: Mapping[str, int]  # message kind -> frames dropped past its rate
    relay_reports_by: Mapping[tuple[str, str], int]  # (accused peer, fault) -> reports heard
    relays_failed: frozenset[str]  # identities whose chunk server failed the hub's own check
    quarantined: frozenset[str]  # identities quarantined
    trust_events: Mapping[str, Mapping[str, int]]  # identity -> trust event -> count
    trust_scores: Mapping[str, float]  # identity -> score (an identity not here: 1.0)
    scoring: ScorerStats | None  # the hub's reward workers (None: a hub without a scorer)
    spot_checking: bool  # some rollouts have their logprobs recomputed (a spot-checker is set)
    published: tuple[int, ...]  # versions kept for peers, oldest first
    propagating: tuple[int, ...]  # versions whose spread is still being measured
    cost: Mapping[str, float | None]  # the cost meter (`echo2p2p.pool.Pool.meter`)
    lp_bound_usd_per_hour: float | None  # what the required throughput costs at the least
    admitted_per_s: float  # completions admitted per second over the window (`echo2p2p.rates`)
    active_gen_rollouts_per_s: float  # the active peers' generation rates while busy, summed
    required_rollouts_per_s: float | None  # what the last activation plan was made for


@dataclass(frozen=True)
class PeerView:
    """One connected peer as the hub sees it (`Hub.peer_views()`)."""

    peer_id: str
    name: str  # as it said in its hello
    engine: str
    identity: str  # whom trust is kept for (`hub.core.peer.Peer.identity`)
    held_version: int | None  # the version it generates with
    stream_version: int | None  # the newest version it holds in full
    server_url: str | None  # its chunk server
    relay: str  # unprobed, ok, failed, slow
    relays_for: str | None  # its URL in broadcasts (None: it only pulls)
    upload_bps: float
    trust: float  # its identity's score, 1.0 = clean
    state: str  # quarantined, active (leased work by the pool) or standby
    silent_s: float  # since the hub last heard from it
    read_budget: BudgetStatistics  # what reading it cost (`echo2p2p.read_budget`)
    scoring_used_s: float  # scorer time its samples used lately (`echo2p2p.scoring.fairness`)
    over_scoring_budget: bool  # its rollouts are refused unscored, and it gets no leases
    open_leases: tuple[str, ...]  # the lease ids it holds
    account: Mapping[str, Any]  # the pool's (`Pool.per_peer`): price, rates, admitted, usd


def statistics_of(step: int, training: bool, peers: Mapping[str, Peer], counters: Counters,
                  leases: LeaseBook, buffer: RolloutBuffer, pool: Pool, trust: TrustBook,
                  tracker: VersionTracker, judging: int, relays_failed: set[str],
                  scorer: Scorer | None, spot_checking: bool, now: float) -> HubStatistics:
    """`Hub.statistics()`: a copy of what the hub's parts hold, taken at `now`."""
    lease_stats, quarantined = leases.statistics(), frozenset(trust.quarantined)
    return HubStatistics(
        step=step, training=training, newest_version=tracker.newest_version, peers=len(peers),
        active_peers=sum(map(pool.is_active, peers)),
        quarantined_peers=sum(c.identity in quarantined for c in peers.values()),
        queued_groups=len(buffer), open_leases=lease_stats.open, judging=judging,
        relay_reports=sum(counters.relay_reports.values()),
        catch_up_builds=tracker.catchups.encodes, catch_up_shared=tracker.catchups.shared,
        **counters.totals(), requeued_leases=lease_stats.requeued_total,
        drawn_problems=lease_stats.drawn_total, queue=tuple(buffer.groups()),
        queue_sources=buffer.sources(), stale_in_queue=buffer.statistics().dropped_stale_total,
        filtered_groups=buffer.statistics().filtered_total,
        dropped_lags=dict(counters.stale_lags + buffer.dropped_lags),
        rejected_by=dict(counters.rejected_by), frames_dropped=dict(counters.frames_dropped),
        relay_reports_by=dict(counters.relay_reports), relays_failed=frozenset(relays_failed),
        quarantined=quarantined,
        trust_events={who: dict(events) for who, events in trust.events.items()},
        trust_scores=dict(trust.scores),
        scoring=None if scorer is None else scorer.statistics(), spot_checking=spot_checking,
        published=tuple(tracker.published), propagating=tuple(tracker.propagation),
        cost=pool.meter(now), lp_bound_usd_per_hour=pool.lp_bound(),
        admitted_per_s=pool.admitted_per_s(now),
        active_gen_rollouts_per_s=pool.active_gen_rollouts_per_s(),
        required_rollouts_per_s=pool.required)


def peer_view(conn: Peer, trust: TrustBook, active: bool, now: float, leases: tuple[str, ...],
              account: Mapping[str, Any], scoring_used_s: float, over_budget: bool) -> PeerView:
    """`conn` as `Hub.peer_views()` shows it (`active`: the pool leases it work)."""
    state = "quarantined" if conn.identity in trust.quarantined else \
        "active" if active else "standby"
    return PeerView(conn.peer_id, conn.hello.name, conn.hello.engine, conn.identity,
                    conn.held_version, conn.stream_version, conn.server_url, conn.relay,
                    conn.member().url, conn.upload_bps, trust.score(conn.identity), state,
                    conn.protocol.silent_for(now), conn.session.budget.statistics(),
                    scoring_used_s, over_budget, leases, account)


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
