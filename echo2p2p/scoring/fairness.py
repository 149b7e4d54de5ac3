"""Fair queueing of scoring over its owners (peers): who is scored next, and who is over budget.

A `FairQueue` keeps one queue of items per owner and each owner's scoring seconds and items
scored, decayed exponentially with a time constant of `WINDOW_S` (so the figures are about
those of the last minute). Items go out least-used owner first: a peer whose samples burn the
deadline falls behind every peer that scores cheaply, and waits for them. An owner new to it
starts level with the least-used owner waiting (as a new flow in weighted fair queueing starts
at the system's virtual time): no owner starves, and a fresh connection gets no head start.
A batch (one pipe round trip) holds many owners' items, taken in that order as if each item
were charged its owner's mean time on the way (start-time fair queueing over the batch), until
the batch would take `BATCH_S` at those means: with 64 cheap peers waiting, one round trip
scores a few hundred samples instead of one. An owner whose next item would not fit ends the
batch where its turn comes (it opens the next one: alone, if its items are known to be slow);
an owner not yet measured has one item in a batch at its turn, its first measure. What no
mean foretells (an unmeasured owner's item, or a slow one behind a cheap history) the worker
bounds: it stops a batch once it has run `CUT_S` and hands the rest back, queued again in
order and ranked anew now that the slow item is charged. So no batch runs longer than `CUT_S`
and one item, whoever's items are in it. Each item is charged what it took, so a batch of
many owners leaves every owner's figures exact.
An owner is over its budget while its items took more than `per_item_s` each on average and it
used more than `per_item_s` lately, and another owner is waiting or scored lately whose items
are `OUTLIER` times cheaper (when all are slow, it is the policy, not a peer): the hub then
refuses its submissions (`echo2p2p.hub.core.admission`) and the scorer fails what it has queued,
and it stays over until what it used has decayed to `RELEASE` x `per_item_s` (about a minute and
a half after one sample that ran 1 s; without that hold, one such sample decayed under the
budget within a second, and a peer whose samples burn exactly the budget was granted, queued
and refused some 50 leases a second, each scoring one of its samples now and then).
Pure bookkeeping: the caller measures the seconds and passes `now`.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

WINDOW_S = 60.0  # the usage's time constant: seconds used long ago count less
BATCH_S = 0.05  # what one batch should take at its owners' means
CUT_S = 2 * BATCH_S  # a worker this far into a batch starts no more of it (others wait <= + 1 item)
OUTLIER = 3.0  # over budget only past this many times the cheapest other owner's mean item time
MIN_ITEMS = 0.5  # items scored (decayed) before an owner's mean is a yardstick for others
RELEASE = 0.25  # an owner found over budget stays so until its usage decays to this x per_item_s
FORGET_EVERY_S = 1.0  # how often `forget` walks the owners at most


class FairQueue:
    """Items queued per owner, served least-used owner first."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, collections.deque[Any]] = {}
        self._usage: dict[Hashable, tuple[float, float, float]] = {}  # (seconds, items, as of)
        self._start: dict[Hashable, tuple[float, float]] = {}  # a newcomer's (seconds, as of)
        self._held: set[Hashable] = set()  # found over budget, and not yet decayed to RELEASE
        self._forget_at = -math.inf  # when `forget` next walks the owners

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __iter__(self) -> Iterator[Any]:
        """Every queued item, owner by owner."""
        for queue in self._queues.values():
            yield from queue

    def push(self, owner: Hashable, items: Iterable[Any], now: float, front: bool = False) -> None:
        """Queue `items` for `owner` (`front`: ahead of its others, in their order)."""
        items = list(items)
        if not items:
            return
        if owner not in self._usage and owner not in self._start:  # level with the least-used
            self._start[owner] = (min((self._rank(o, now) for o in self._queues), default=0.0),
                                  now)
        queue = self._queues.setdefault(owner, collections.deque())
        if front:
            queue.extendleft(reversed(items))
        else:
            queue.extend(items)

    def pop(self, now: float, max_items: int) -> list[tuple[Hashable, Any]]:
        """The next batch, as `(owner, item)` pairs in fair order: 1 to `max_items` items,
        as many as take `BATCH_S` at their owners' means, and one item of each unmeasured
        owner whose turn comes. Call only when not empty."""
        heap = [(self._rank(o, now), n, o, self._mean_s(o)) for n, o in enumerate(self._queues)]
        heapq.heapify(heap)
        batch: list[tuple[Hashable, Any]] = []
        planned_s = 0.0
        while heap and len(batch) < max_items:
            rank, n, owner, mean_s = heap[0]
            if rank == math.inf or batch and planned_s + (mean_s or 0.0) > BATCH_S:
                break  # its turn, but not in this batch: it opens the next one
            queue = self._queues[owner]
            batch.append((owner, queue.popleft()))
            planned_s += mean_s or 0.0
            if queue:  # its next item ranks as if this one were charged; unmeasured: no next
                rank = math.inf if mean_s is None else rank + mean_s
                heapq.heapreplace(heap, (rank, n, owner, mean_s))
            else:
                heapq.heappop(heap)
                del self._queues[owner]
        return batch

    def drop(self, unwanted: Callable[[Any], bool]) -> list[Any]:
        """Take every queued item `unwanted` says, and return them."""
        dropped = []
        for owner in list(self._queues):
            queue = self._queues[owner]
            dropped += [item for item in queue if unwanted(item)]
            kept = collections.deque(item for item in queue if not unwanted(item))
            if kept:
                self._queues[owner] = kept
            else:
                del self._queues[owner]
        return dropped

    def clear(self) -> None:
        self._queues.clear()

    def charge(self, owner: Hashable, seconds: float, items: int, now: float) -> None:
        """`items` of `owner`'s took `seconds` of a worker, as of `now`."""
        used, scored = self._decayed(owner, now)
        self._usage[owner] = (used + max(0.0, seconds), scored + items, now)

    def usage_s(self, owner: Hashable, now: float) -> float:
        """`owner`'s scoring seconds, decayed to `now` (about: used in the last minute)."""
        return self._decayed(owner, now)[0]

    def over_budget(self, owner: Hashable, per_item_s: float, now: float) -> bool:
        """Whether `owner`'s items took more than `per_item_s` each lately, and more than
        `per_item_s` in all, while another owner is waiting or scored lately (one that scores
        alone is never held back), and more than `OUTLIER` x the cheapest other owner's mean:
        when every peer's items are slow (a policy that still writes endless loops, as early in
        code RL) nobody is singled out, and sybils cannot raise the cheapest honest mean."""
        # First the mean, which decay leaves as it is (both sums shrink alike), from the stored
        # sums without an exp: the hub asks this of every waiting peer at each lease dispatch,
        # and an honest peer's answer ends here.
        if owner in self._held:  # held until its usage decays: a hysteresis, not a new verdict
            if self._decayed(owner, now)[0] > RELEASE * per_item_s:
                return True
            self._held.discard(owner)
        kept_s, kept_items, _ = self._usage.get(owner, (0.0, 0.0, now))
        if not kept_s > per_item_s * kept_items:
            return False
        used, scored = self._decayed(owner, now)
        if not used > per_item_s:
            return False
        others = {*self._queues, *self._usage} - {owner}
        if not others:
            return False
        means = [u / n for u, n in (self._decayed(o, now) for o in others) if n > MIN_ITEMS]
        if used > OUTLIER * min(means, default=0.0) * scored:
            self._held.add(owner)
            return True
        return False

    def _mean_s(self, owner: Hashable) -> float | None:
        """What one of `owner`'s items is expected to take: its mean (None: not measured), of
        the stored sums, as decay leaves it."""
        kept_s, kept_items, _ = self._usage.get(owner, (0.0, 0.0, 0.0))
        return kept_s / kept_items if kept_items > 0 else None

    def _rank(self, owner: Hashable, now: float) -> float:
        """What orders the owners: the seconds used, plus a newcomer's start, decayed."""
        start, at = self._start.get(owner, (0.0, now))
        return self.usage_s(owner, now) + start * math.exp(-max(0.0, now - at) / WINDOW_S)

    def _decayed(self, owner: Hashable, now: float) -> tuple[float, float]:
        used, scored, at = self._usage.get(owner, (0.0, 0.0, now))
        kept = math.exp(-max(0.0, now - at) / WINDOW_S)
        return used * kept, scored * kept

    def forget(self, now: float, below_items: float = 0.01) -> None:
        """Drop the usage of owners idle long enough that their items scored have decayed to
        nothing (about 5 minutes after one item): bounded memory. At most once a second (the
        scorer asks at every batch, and the walk over every owner cost it more than the batch)."""
        if now < self._forget_at:
            return
        self._forget_at = now + FORGET_EVERY_S
        for owner in [o for o in {*self._usage, *self._start} if o not in self._queues
                      and self._decayed(o, now)[1] < below_items
                      and self._rank(o, now) < below_items]:
            self._usage.pop(owner, None)
            self._start.pop(owner, None)
            self._held.discard(owner)
