"""Admitted rollout groups waiting for the learner, and batch formation.

Pure: the hub feeds admitted groups in and asks for a batch at learner step t. A group is
re-checked against the staleness rule when it is taken (it may have aged in the queue); groups
too old by then are dropped and counted. Batches hold only complete groups (G samples each).
Each group is put with its source (the identity of the peer that sent it), so the groups of a
source found lying can be withdrawn before the learner takes them.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from .rows import SampleRow
from .staleness import Verdict, judge, lag_versions


@dataclass(frozen=True)
class ScoredGroup:
    """One lease's G completions as the learner sees them."""

    lease_id: str
    problem_id: str
    prompt_ids: list[int]
    version: int  # behaviour policy version x that generated every sample
    samples: tuple[SampleRow, ...]  # parsed and validated at admission (echo2p2p.rows)
    rewards: list[float]  # the hub's own scores, one per sample


@dataclass(frozen=True)
class BufferStats:
    queued: int
    admitted_total: int
    dropped_stale_total: int  # aged out in the queue before a batch took them


class RolloutBuffer:
    """Admitted groups; hands out batches of fresh, complete groups, oldest versions first."""

    def __init__(self, max_lag: int):
        self._max_lag = max_lag
        self._queue: deque[ScoredGroup] = deque()
        self._sources: dict[str, str] = {}  # lease id -> source, for each queued group
        self._admitted = 0
        self._dropped = 0
        self.dropped_lags: Counter[int] = Counter()  # lag in versions -> groups aged out

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, group: ScoredGroup, source: str = "") -> None:
        self._queue.append(group)
        self._sources[group.lease_id] = source
        self._admitted += 1

    def groups(self) -> list[ScoredGroup]:
        """The queued groups, in arrival order (for a checkpoint)."""
        return list(self._queue)

    def sources(self) -> dict[str, str]:
        """Lease id -> source of every queued group (for a checkpoint)."""
        return dict(self._sources)

    def withdraw(self, source: str) -> list[ScoredGroup]:
        """Remove and return every queued group put by `source`."""
        return self.remove({lease for lease, s in self._sources.items() if s == source})

    def remove(self, lease_ids: set[str]) -> list[ScoredGroup]:
        """Remove and return the queued groups of `lease_ids` (absent ones are skipped)."""
        gone = [g for g in self._queue if g.lease_id in lease_ids]
        if gone:
            self._queue = deque(g for g in self._queue if g.lease_id not in lease_ids)
            for group in gone:
                self._sources.pop(group.lease_id, None)
        return gone

    def drop_stale(self, step: int) -> list[ScoredGroup]:
        """Remove and return every queued group too old for `step`."""
        fresh, stale = deque(), []
        for group in self._queue:
            (fresh if judge(step, group.version, self._max_lag) is Verdict.FRESH else stale).append(group)
        self._queue = fresh
        for group in stale:
            self._sources.pop(group.lease_id, None)
        self._dropped += len(stale)
        self.dropped_lags.update(lag_versions(step, group.version) for group in stale)
        return stale

    def take_batch(self, step: int, n_groups: int) -> list[ScoredGroup] | None:
        """`n_groups` fresh groups for `step`, or None (nothing taken) if short.

        The groups of the oldest versions go first (then in arrival order): they are the
        nearest to going stale. Peers finish out of order, so arrival order alone would train
        a fresh group early and leave an older one to age past S.
        """
        self.drop_stale(step)
        if len(self._queue) < n_groups:
            return None
        order = sorted(self._queue, key=lambda g: g.version)  # stable: arrival order within
        self._queue = deque(order[n_groups:])
        for group in order[:n_groups]:
            self._sources.pop(group.lease_id, None)
        return order[:n_groups]

    def statistics(self) -> BufferStats:
        return BufferStats(len(self._queue), self._admitted, self._dropped)

    def totals(self) -> dict:
        """The running totals, as plain data (for a checkpoint: a resumed hub's go on)."""
        return {"admitted": self._admitted, "dropped": self._dropped,
                "dropped_lags": dict(self.dropped_lags)}

    def restore_totals(self, totals: dict) -> None:
        """Take up the totals `totals()` gave (the groups restored meanwhile are in them)."""
        self._admitted, self._dropped = totals["admitted"], totals["dropped"]
        self.dropped_lags = Counter({int(k): n for k, n in totals["dropped_lags"].items()})
