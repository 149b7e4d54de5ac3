"""Prompt leases: who is generating which prompt group, until when.

Pure: `now` comes in as an argument. A lease is one prompt x G samples granted to one peer with
a deadline. A lease that expires or whose peer leaves goes back to the front of the queue and is
granted again, so no prompt group is lost to churn. A lease id is used once: a second submission
for a completed lease is answered as a duplicate (idempotent), never admitted twice.

Invariant: every problem handed out is, at any time, in exactly one of: pending (re-issue
queue), an open lease, or done.
"""

from __future__ import annotations

import enum
import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

P = TypeVar("P")  # a problem: anything the hub wants to hand out; the book never looks inside

_DONE_MEMORY = 100_000  # completed lease ids remembered for duplicate detection


class Completion(enum.Enum):
    """What a submission for a lease id means."""

    NEW = "new"  # an open lease: take the rollout
    DUPLICATE = "duplicate"  # already completed: acknowledge again, admit nothing
    UNKNOWN = "unknown_lease"  # never granted, or granted to another peer
    EXPIRED = "expired"  # its deadline passed and the prompt was re-queued


def shuffled_epochs(n: int, seed: int) -> Iterator[int]:
    """Indices 0..n-1 in a fresh seeded shuffle per epoch, forever."""
    rng = random.Random(seed)
    while True:
        order = list(range(n))
        rng.shuffle(order)
        yield from order


@dataclass(frozen=True)
class Lease(Generic[P]):
    lease_id: str
    peer_id: str
    problem: P
    deadline: float  # absolute, in the caller's clock
    min_version: int
    granted: float = 0.0  # when, in the same clock


@dataclass(frozen=True)
class LeaseStats:
    open: int
    pending: int
    granted_total: int
    completed_total: int
    expired_total: int
    requeued_total: int


class LeaseBook(Generic[P]):
    """Grants, completes, expires and re-issues leases over an endless problem stream."""

    def __init__(self, problems: Sequence[P], lease_timeout_s: float, seed_order: Iterator[int]):
        """`seed_order` yields indices into `problems` (e.g. shuffled epochs) forever."""
        if not problems:
            raise ValueError("no problems to lease")
        self._problems = problems
        self._order = seed_order
        self._timeout_s = lease_timeout_s
        self._pending: deque[P] = deque()
        self._open: dict[str, Lease[P]] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._done: OrderedDict[str, None] = OrderedDict()
        self._ids = itertools.count()
        self._granted = self._completed = self._expired_n = self._requeued = 0

    @property
    def open_count(self) -> int:
        return len(self._open)

    def open_for(self, peer_id: str) -> int:
        """How many open leases `peer_id` holds."""
        return sum(lease.peer_id == peer_id for lease in self._open.values())

    def grant(self, peer_id: str, now: float, min_version: int) -> Lease[P]:
        problem = self._pending.popleft() if self._pending else self._problems[next(self._order)]
        lease = Lease(f"L{next(self._ids)}", peer_id, problem, now + self._timeout_s, min_version,
                      now)
        self._open[lease.lease_id] = lease
        self._granted += 1
        return lease

    def complete(self, lease_id: str, peer_id: str) -> tuple[Completion, Lease[P] | None]:
        """Close an open lease for a submission; the lease is returned only when NEW."""
        lease = self._open.get(lease_id)
        if lease is not None and lease.peer_id == peer_id:
            del self._open[lease_id]
            self._remember(self._done, lease_id)
            self._completed += 1
            return Completion.NEW, lease
        if lease_id in self._done:
            return Completion.DUPLICATE, None
        if lease_id in self._expired:
            return Completion.EXPIRED, None
        return Completion.UNKNOWN, None

    def requeue(self, lease: Lease[P]) -> None:
        """Put a completed lease's problem back (its rollout could not be used)."""
        self._pending.appendleft(lease.problem)
        self._requeued += 1

    def expire(self, now: float) -> list[Lease[P]]:
        """Expire every lease past its deadline; their problems go back to the queue."""
        late = [lease for lease in self._open.values() if lease.deadline <= now]
        for lease in late:
            self._drop(lease)
        self._expired_n += len(late)
        return late

    def release_peer(self, peer_id: str) -> list[Lease[P]]:
        """A peer left: its open leases go back to the queue at once."""
        gone = [lease for lease in self._open.values() if lease.peer_id == peer_id]
        for lease in gone:
            self._drop(lease)
        return gone

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._open.values()), default=None)

    def statistics(self) -> LeaseStats:
        return LeaseStats(len(self._open), len(self._pending), self._granted, self._completed,
                          self._expired_n, self._requeued)

    def _drop(self, lease: Lease[P]) -> None:
        del self._open[lease.lease_id]
        self._remember(self._expired, lease.lease_id)
        self._pending.appendleft(lease.problem)
        self._requeued += 1

    @staticmethod
    def _remember(memory: OrderedDict[str, None], lease_id: str) -> None:
        memory[lease_id] = None
        if len(memory) > _DONE_MEMORY:
            memory.popitem(last=False)
