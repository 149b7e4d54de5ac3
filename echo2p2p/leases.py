"""Prompt leases: who is generating which prompt group, until when.

Pure: `now` comes in as an argument. A lease is one prompt x G samples granted to one peer with
a deadline. A lease that expires or whose peer leaves goes back to the front of the queue and is
granted again, so no prompt group is lost to churn. A lease id is used once: a second submission
for a completed lease is answered as a duplicate (idempotent), never admitted twice.

Invariant: every problem handed out is, at any time, in exactly one of: pending (re-issue
queue), an open lease, or done.

Durability (the hub's journal and checkpoints, `echo2p2p.hub.durable`): `state()` is the whole book as
plain data, and every change after it is reported to `on_change` as a small tuple that `replay`
applies to a restored book, so a hub killed at any moment comes back with the same leases. Open
leases of a restored book are orphans: their peers reconnect under new ids, so any peer may
complete one (once; the lease id still makes a second submission a duplicate).
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

P = TypeVar("P")  # a problem: anything the hub wants to hand out; the book never looks inside

_DONE_MEMORY = 100_000  # completed lease ids remembered for duplicate detection
ORPHAN = ""  # the peer id of a restored open lease: any peer may complete it


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
    index: int = 0  # of `problem` in the book's problem list


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

    def __init__(self, problems: Sequence[P], lease_timeout_s: float, seed_order: Iterator[int],
                 on_change: Callable[[tuple], None] | None = None):
        """`seed_order` yields indices into `problems` (e.g. shuffled epochs) forever;
        `on_change` hears every change, for a journal (see `replay`)."""
        if not problems:
            raise ValueError("no problems to lease")
        self._problems = problems
        self._order = seed_order
        self._timeout_s = lease_timeout_s
        self._pending: deque[int] = deque()  # problem indices to re-issue, first out first
        self._open: dict[str, Lease[P]] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._done: OrderedDict[str, None] = OrderedDict()
        self._next_id = self._drawn = 0
        self._granted = self._completed = self._expired_n = self._requeued = 0
        self.on_change = on_change or (lambda change: None)

    @property
    def open_count(self) -> int:
        return len(self._open)

    def open_for(self, peer_id: str) -> int:
        """How many open leases `peer_id` holds."""
        return sum(lease.peer_id == peer_id for lease in self._open.values())

    def grant(self, peer_id: str, now: float, min_version: int) -> Lease[P]:
        if self._pending:
            index, queued = self._pending.popleft(), True
        else:
            index, queued = next(self._order), False
            self._drawn += 1
        lease = self._open_lease(f"L{self._next_id}", peer_id, index, now, min_version)
        self._next_id += 1
        self._granted += 1
        self.on_change(("grant", lease.lease_id, index, min_version, queued))
        return lease

    def complete(self, lease_id: str, peer_id: str) -> tuple[Completion, Lease[P] | None]:
        """Close an open lease for a submission; the lease is returned only when NEW."""
        lease = self._open.get(lease_id)
        if lease is not None and lease.peer_id in (peer_id, ORPHAN):
            # Not reported: the caller records what became of the rollout (admitted: "done";
            # unusable: `requeue`), so a journal cut in between leaves the lease open.
            self._close(lease_id)
            return Completion.NEW, lease
        if lease_id in self._done:
            return Completion.DUPLICATE, None
        if lease_id in self._expired:
            return Completion.EXPIRED, None
        return Completion.UNKNOWN, None

    def requeue(self, lease: Lease[P]) -> None:
        """Put a completed lease's problem back (its rollout could not be used)."""
        self._pending.appendleft(lease.index)
        self._requeued += 1
        self.on_change(("requeue", lease.lease_id, lease.index))

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

    # --- durability ------------------------------------------------------------------------

    def state(self) -> dict:
        """The book as plain data (msgpack-able), for a checkpoint."""
        return {"pending": list(self._pending), "drawn": self._drawn, "next_id": self._next_id,
                "open": [[lease.lease_id, lease.index, lease.min_version]
                         for lease in self._open.values()],
                "done": list(self._done), "expired": list(self._expired)}

    def restore(self, state: dict, now: float) -> None:
        """Load `state()` into this fresh book (same problems, same order); open leases become
        orphans with a fresh deadline."""
        for _ in range(state["drawn"]):
            next(self._order)
        self._drawn, self._next_id = state["drawn"], state["next_id"]
        self._pending = deque(state["pending"])
        for lease_id, index, min_version in state["open"]:
            self._open_lease(lease_id, ORPHAN, index, now, min_version)
        self._done = OrderedDict.fromkeys(state["done"])
        self._expired = OrderedDict.fromkeys(state["expired"])

    def replay(self, change: tuple, now: float) -> None:
        """Apply one `on_change` record to a restored book."""
        kind, *args = change
        if kind == "grant":
            lease_id, index, min_version, queued = args
            if queued:
                self._pending.remove(index)
            else:
                next(self._order)
                self._drawn += 1
            self._open_lease(lease_id, ORPHAN, index, now, min_version)
            self._next_id = max(self._next_id, int(lease_id[1:]) + 1)
        elif kind == "done":
            if args[0] in self._open:
                self._close(args[0])
        elif kind == "drop":
            if args[0] in self._open:
                self._drop(self._open[args[0]])
        elif kind == "requeue":
            if args[0] in self._open:
                self._close(args[0])
            self._pending.appendleft(args[1])
        else:
            raise ValueError(f"unknown lease change {kind!r}")

    # --- internals -------------------------------------------------------------------------

    def _open_lease(self, lease_id: str, peer_id: str, index: int, now: float,
                    min_version: int) -> Lease[P]:
        lease = Lease(lease_id, peer_id, self._problems[index], now + self._timeout_s,
                      min_version, now, index)
        self._open[lease_id] = lease
        return lease

    def _close(self, lease_id: str) -> None:
        del self._open[lease_id]
        self._remember(self._done, lease_id)
        self._completed += 1

    def _drop(self, lease: Lease[P]) -> None:
        del self._open[lease.lease_id]
        self._remember(self._expired, lease.lease_id)
        self._pending.appendleft(lease.index)
        self._requeued += 1
        self.on_change(("drop", lease.lease_id))

    @staticmethod
    def _remember(memory: OrderedDict[str, None], lease_id: str) -> None:
        memory[lease_id] = None
        if len(memory) > _DONE_MEMORY:
            memory.popitem(last=False)
