"""Prompt leases: who is generating which prompt group, until when.

Pure: `now` comes in as an argument. A lease is one prompt x G samples granted to one peer with
a deadline. A lease that expires or whose peer leaves goes back to the front of the queue and is
granted again, so no prompt group is lost to churn. A lease id is used once, and the book keeps
what became of it for its own peer: a resubmission hears the first one's fate (admitted: a
duplicate, never admitted twice; rejected: the same reason; still being judged: that), while a
lease that is not the asking peer's is unknown whether or not it exists, so nobody learns of
other peers' leases. The hub's lease ids are random (`lease_ids`): none can be guessed.

Invariant: every problem handed out is, at any time, in exactly one of: pending (re-issue
queue), an open lease, being judged (completed, no verdict yet), or done.

Durability (the hub's journal and checkpoints, `echo2p2p.hub.learning.durable`): `state()` is the whole book as
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
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

P = TypeVar("P")  # a problem: anything the hub wants to hand out; the book never looks inside

_DONE_MEMORY = 100_000  # completed lease ids remembered for duplicate detection
ORPHAN = ""  # the peer id of a restored open lease: any peer may complete it


class Completion(enum.Enum):
    """What a submission for a lease id means."""

    NEW = "new"  # an open lease: take the rollout
    DUPLICATE = "duplicate"  # its rollout was admitted: acknowledge again, admit nothing
    REJECTED = "rejected"  # its rollout was rejected: the same reason again (`LeaseBook.verdict`)
    JUDGING = "judging"  # its first rollout is still being judged: the verdict will answer
    UNKNOWN = "unknown_lease"  # never granted, granted to another peer, or forgotten
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
    item: P  # what is leased: the hub's item (a `TokenizedProblem`, whose .problem is the task's)
    deadline: float  # absolute, in the caller's clock
    min_version: int
    granted: float = 0.0  # when, in the same clock
    index: int = 0  # of `item` in the book's problem list
    latest: float = float("inf")  # `renew` never moves the deadline past this


@dataclass(frozen=True)
class LeaseStats:
    open: int
    pending: int
    granted_total: int
    completed_total: int
    expired_total: int
    requeued_total: int
    drawn_total: int  # problems drawn from the epochs so far (the data cursor)


class LeaseBook(Generic[P]):
    """Grants, completes, expires and re-issues leases over an endless problem stream."""

    def __init__(self, problems: Sequence[P], lease_timeout_s: float, seed_order: Iterator[int],
                 on_change: Callable[[tuple], None] | None = None,
                 lease_ids: Callable[[], str] | None = None):
        """`seed_order` yields indices into `problems` (e.g. shuffled epochs) forever;
        `on_change` hears every change, for a journal (see `replay`); `lease_ids` makes a new
        lease id (default "L0", "L1", ...; the hub's are random)."""
        if not problems:
            raise ValueError("no problems to lease")
        self._problems = problems
        self._order = seed_order
        self._timeout_s = lease_timeout_s
        self._pending: deque[int] = deque()  # problem indices to re-issue, first out first
        self._open: dict[str, Lease[P]] = {}
        self._judging: dict[str, Lease[P]] = {}  # completed, no verdict yet
        # Closed leases: id -> (its peer, "" admitted or the reason it was rejected for).
        self._done: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._expired: OrderedDict[str, tuple[str, str]] = OrderedDict()  # (its peer, "expired")
        self._next_id = self._drawn = 0
        self._lease_ids = lease_ids
        self._granted = self._completed = self._expired_n = self._requeued = 0
        self.on_change = on_change or (lambda change: None)

    @property
    def open_count(self) -> int:
        return len(self._open)

    def open_for(self, peer_id: str) -> int:
        """How many open leases `peer_id` holds."""
        return sum(lease.peer_id == peer_id for lease in self._open.values())

    def open_by_peer(self) -> dict[str, tuple[str, ...]]:
        """The open leases' ids by holder, in the order granted."""
        held: dict[str, list[str]] = {}
        for lease in self._open.values():
            held.setdefault(lease.peer_id, []).append(lease.lease_id)
        return {peer_id: tuple(ids) for peer_id, ids in held.items()}

    def open_leases(self) -> Iterator[Lease[P]]:
        return iter(self._open.values())

    def judged_leases(self) -> Iterator[Lease[P]]:
        """Leases completed and still being judged (no verdict yet)."""
        return iter(self._judging.values())

    def grant(self, peer_id: str, now: float, min_version: int, *, wait_s: float = 0.0,
              latest_s: float | None = None) -> Lease[P]:
        """A lease of the next problem for `peer_id`, due `wait_s` + the timeout from `now`
        (`wait_s`: how long it may wait behind its peer's other leases,
        `lease_quota.queue_wait_s`), and never renewed past `latest_s` from `now` (None: its
        first deadline)."""
        if self._pending:
            index, queued = self._pending.popleft(), True
        else:
            index, queued = next(self._order), False
            self._drawn += 1
        lease_id = self._lease_ids() if self._lease_ids else f"L{self._next_id}"
        lease = self._open_lease(lease_id, peer_id, index, now, min_version=min_version,
                                 wait_s=wait_s)
        if latest_s is not None:
            lease = self._open[lease_id] = replace(lease, latest=max(now + latest_s, lease.deadline))
        self._next_id += 1
        self._granted += 1
        self.on_change(("grant", lease.lease_id, index, min_version, queued))
        return lease

    def complete(self, lease_id: str, peer_id: str) -> tuple[Completion, Lease[P] | None]:
        """Close an open lease for a submission (it is judged until `admitted` or `requeue`);
        the lease is returned only when NEW. A lease that is not `peer_id`'s (nor an orphan)
        is UNKNOWN, whatever became of it."""
        lease = self._open.get(lease_id)
        if lease is not None and lease.peer_id in (peer_id, ORPHAN):
            # Not reported: the caller records what became of the rollout (admitted: "done";
            # unusable: `requeue`), so a journal cut in between leaves the lease open.
            del self._open[lease_id]
            self._judging[lease_id] = replace(lease, peer_id=peer_id)  # an orphan's is its now
            self._completed += 1
            return Completion.NEW, lease
        if (judged := self._judging.get(lease_id)) is not None:
            record: tuple[str, str | None] | None = (judged.peer_id, None)
        else:
            record = self._done.get(lease_id) or self._expired.get(lease_id)
        if record is None or record[0] not in (peer_id, ORPHAN):
            return Completion.UNKNOWN, None  # never granted, or another peer's: the same word
        verdict = record[1]
        if verdict is None:
            return Completion.JUDGING, None
        if lease_id in self._expired:
            return Completion.EXPIRED, None
        return (Completion.DUPLICATE if verdict == "" else Completion.REJECTED), None

    def verdict(self, lease_id: str) -> str | None:
        """What became of a completed lease's rollout: "" admitted, the reason it was rejected
        for, or None (being judged, or no such lease)."""
        return self._done[lease_id][1] if lease_id in self._done else None

    def admitted(self, lease_id: str) -> None:
        """A completed lease's rollout was admitted (the hub journals it with its group)."""
        if (lease := self._judging.pop(lease_id, None)) is not None:
            self._settle(lease, "")

    def requeue(self, lease: Lease[P], reason: str = "expired") -> None:
        """Put a completed lease's problem back: its rollout was rejected for `reason` (by
        default "expired": taken back unjudged, e.g. at shutdown)."""
        judged = self._judging.pop(lease.lease_id, lease)
        self._settle(judged, reason)
        self._pending.appendleft(lease.index)
        self._requeued += 1
        self.on_change(("requeue", lease.lease_id, lease.index, reason))

    def expire(self, now: float) -> list[Lease[P]]:
        """Expire every lease past its deadline; their problems go back to the queue."""
        late = [lease for lease in self._open.values() if lease.deadline <= now]
        for lease in late:
            self._drop(lease)
        self._expired_n += len(late)
        return late

    def renew(self, peer_id: str, now: float) -> None:
        """`peer_id` delivered a group at `now`: it is working through its queue, so each of
        its open leases is due no sooner than a timeout from now (never past its `latest`)."""
        for lease_id, lease in self._open.items():
            if lease.peer_id == peer_id and lease.deadline < now + self._timeout_s:
                self._open[lease_id] = replace(
                    lease, deadline=max(lease.deadline, min(now + self._timeout_s, lease.latest)))

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
                          self._expired_n, self._requeued, self._drawn)

    # --- durability ------------------------------------------------------------------------

    def state(self) -> dict:
        """The book as plain data (msgpack-able), for a checkpoint. A lease being judged is
        kept as open: a hub resumed from it never heard the verdict."""
        unjudged = list(self._open.values()) + list(self._judging.values())
        return {"pending": list(self._pending), "drawn": self._drawn, "next_id": self._next_id,
                "open": [[lease.lease_id, lease.index, lease.min_version] for lease in unjudged],
                "done": [[lease_id, verdict] for lease_id, (_, verdict) in self._done.items()],
                "expired": list(self._expired)}

    def restore(self, state: dict, now: float) -> None:
        """Load `state()` into this fresh book (same problems, same order); open leases become
        orphans with a fresh deadline, and what became of closed ones is anyone's to hear."""
        for _ in range(state["drawn"]):
            next(self._order)
        self._drawn, self._next_id = state["drawn"], state["next_id"]
        self._pending = deque(state["pending"])
        for lease_id, index, min_version in state["open"]:
            self._open_lease(lease_id, ORPHAN, index, now, min_version=min_version)
        # (A checkpoint of an older hub lists bare ids: those rollouts were admitted.)
        self._done = OrderedDict((done, (ORPHAN, "")) if isinstance(done, str)
                                 else (done[0], (ORPHAN, done[1])) for done in state["done"])
        self._expired = OrderedDict.fromkeys(state["expired"], (ORPHAN, "expired"))

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
            self._open_lease(lease_id, ORPHAN, index, now, min_version=min_version)
            if lease_id[:1] == "L" and lease_id[1:].isdigit():  # the default, numbered ids
                self._next_id = max(self._next_id, int(lease_id[1:]) + 1)
        elif kind == "done":
            if (lease := self._open.pop(args[0], None)) is not None:
                self._completed += 1
                self._settle(lease, "")
        elif kind == "drop":
            if args[0] in self._open:
                self._drop(self._open[args[0]])
        elif kind == "requeue":
            if (lease := self._open.pop(args[0], None)) is not None:
                self._completed += 1
                self._settle(lease, args[2] if len(args) > 2 else "expired")
            self._pending.appendleft(args[1])
        else:
            raise ValueError(f"unknown lease change {kind!r}")

    # --- internals -------------------------------------------------------------------------

    def _open_lease(self, lease_id: str, peer_id: str, index: int, now: float,
                    *, min_version: int, wait_s: float = 0.0) -> Lease[P]:
        deadline = now + wait_s + self._timeout_s
        lease = Lease(lease_id, peer_id, self._problems[index], deadline, min_version, now, index,
                      deadline)
        self._open[lease_id] = lease
        return lease

    def _settle(self, lease: Lease[P], verdict: str) -> None:
        self._remember(self._done, lease.lease_id, (lease.peer_id, verdict))

    def _drop(self, lease: Lease[P]) -> None:
        del self._open[lease.lease_id]
        self._remember(self._expired, lease.lease_id, (lease.peer_id, "expired"))
        self._pending.appendleft(lease.index)
        self._requeued += 1
        self.on_change(("drop", lease.lease_id))

    @staticmethod
    def _remember(memory: OrderedDict[str, tuple[str, str]], lease_id: str,
                  record: tuple[str, str]) -> None:
        memory[lease_id] = record
        if len(memory) > _DONE_MEMORY:
            memory.popitem(last=False)
