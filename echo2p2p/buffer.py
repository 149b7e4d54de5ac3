"""Admitted rollout groups waiting for the learner, and batch formation.

Pure: the hub feeds admitted groups in and asks for a batch at learner step t. A group is
re-checked against the staleness rule when it is taken (it may have aged in the queue); groups
too old by then are dropped and counted. Batches hold only complete groups (G samples each).
Each group is put with its source (the identity of the peer that sent it), so the groups of a
source found lying can be withdrawn before the learner takes them.

Dynamic sampling (DAPO, arXiv 2503.14476, section 3.2): with `filter_uniform`, a group whose G
rewards are all equal (zero advantage: no policy gradient) is admitted, counted as filtered and
never queued, so every batch holds informative groups only. The share of informative groups
among the recent ones (`informative_frac`) tells the hub how many leases one step now takes.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
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
    filtered_total: int = 0  # admitted with all rewards equal, never queued (dynamic sampling)


# How many recent admissions `informative_frac` looks at, and the least it answers: the hub
# widens its lease budget by 1 / that share, so at most 4x (a task the model always or never
# solves must not have the hub lease its whole data set at once).
YIELD_WINDOW = 64
MIN_INFORMATIVE_FRAC = 0.25


def uniform_rewards(rewards: Sequence[float]) -> bool:
    """Whether every reward equals the first (exactly, as `grpo.group_advantages` tests it):
    the group's advantages are all zero. A NaN is not equal to itself: such a group is kept for
    the learner's own check to drop."""
    return all(r == rewards[0] for r in rewards)


class RolloutBuffer:
    """Admitted groups; hands out batches of fresh, complete groups, oldest versions first."""

    def __init__(self, max_lag: int, filter_uniform: bool = False):
        """`filter_uniform`: dynamic sampling, groups with all rewards equal are not queued."""
        self._max_lag, self._filter = max_lag, filter_uniform
        self._queue: deque[ScoredGroup] = deque()
        self._sources: dict[str, str] = {}  # lease id -> source, for each queued group
        self._admitted = 0
        self._dropped = 0
        self._filtered = 0
        self.filtered_since_batch = 0  # filtered since a batch was last taken
        self._recent: deque[bool] = deque(maxlen=YIELD_WINDOW)  # informative, per admission
        self._recent_informative = 0  # how many of `_recent` are True (read per lease pass)
        self.dropped_lags: Counter[int] = Counter()  # lag in versions -> groups aged out

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, group: ScoredGroup, source: str = "") -> bool:
        """Take an admitted group; whether it was queued (False: filtered, its rewards all
        equal). A resumed hub puts its journal's groups through here again: the same ones are
        filtered, and counted, as in the run that admitted them."""
        self._admitted += 1
        if self._filter:
            informative = not uniform_rewards(group.rewards)
            if len(self._recent) == YIELD_WINDOW:
                self._recent_informative -= self._recent[0]  # about to fall out
            self._recent.append(informative)
            self._recent_informative += informative
            if not informative:
                self._filtered += 1
                self.filtered_since_batch += 1
                return False
        self._queue.append(group)
        self._sources[group.lease_id] = source
        return True

    def informative_frac(self) -> float:
        """The share of recent admissions that were queued, at least `MIN_INFORMATIVE_FRAC`;
        1.0 without filtering or before any admission."""
        if not self._recent:
            return 1.0
        return max(self._recent_informative / len(self._recent), MIN_INFORMATIVE_FRAC)

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
        self.filtered_since_batch = 0
        for group in order[:n_groups]:
            self._sources.pop(group.lease_id, None)
        return order[:n_groups]

    def in_leases(self) -> int:
        """The queued groups as the leases they took: 1 / `informative_frac` each (dynamic
        sampling filters the rest of what those leases brought; without, one each)."""
        return math.ceil(len(self._queue) / self.informative_frac())

    def statistics(self) -> BufferStats:
        return BufferStats(len(self._queue), self._admitted, self._dropped, self._filtered)

    def totals(self) -> dict:
        """The running totals, as plain data (for a checkpoint: a resumed hub's go on)."""
        return {"admitted": self._admitted, "dropped": self._dropped,
                "dropped_lags": dict(self.dropped_lags), "filtered": self._filtered}

    def restore_totals(self, totals: dict) -> None:
        """Take up the totals `totals()` gave (the groups restored meanwhile are in them)."""
        self._admitted, self._dropped = totals["admitted"], totals["dropped"]
        self._filtered = totals.get("filtered", 0)  # absent from checkpoints before filtering
        self.dropped_lags = Counter({int(k): n for k, n in totals["dropped_lags"].items()})
