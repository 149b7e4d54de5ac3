"""Fair queueing of scoring over its owners (peers): who is scored next, and who is over budget.

A `FairQueue` keeps one queue of items per owner and each owner's scoring seconds and items
scored, decayed exponentially with a time constant of `WINDOW_S` (so the figures are about
those of the last minute). The next batch goes to the owner that used least: a peer whose
samples burn the deadline falls behind every peer that scores cheaply, and waits for them. An
owner new to it starts level with the least-used owner waiting (as a new flow in weighted fair
queueing starts at the system's virtual time): no owner starves, and a fresh connection gets
no head start. While several owners wait, a batch is one item, so an honest peer's
group waits for at most one of another's items; alone, an owner gets as many as its items' mean
time says fit in `BATCH_S` (one pipe round trip for many cheap ones, as math-verify's; one at a
time for an owner not yet measured or whose items are slow, as a program's run).
An owner is over its budget while its items took more than `per_item_s` each on average and it
used more than `per_item_s` lately, and another owner is waiting or scored lately whose items
are `OUTLIER` times cheaper (when all are slow, it is the policy, not a peer): the hub then
refuses its submissions (`echo2p2p.hub.serving.admission`) and the scorer fails what it has queued,
until what it used has decayed (about a minute and a half for a group of 4 that ran 1 s each).
Pure bookkeeping: the caller measures the seconds and passes `now`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

WINDOW_S = 60.0  # the usage's time constant: seconds used long ago count less
BATCH_S = 0.05  # what one batch should take, at its owner's mean: what another waits for at most
OUTLIER = 3.0  # over budget only past this many times the cheapest other owner's mean item time
MIN_ITEMS = 0.5  # items scored (decayed) before an owner's mean is a yardstick for others


class FairQueue:
    """Items queued per owner, served least-used owner first."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, collections.deque[Any]] = {}
        self._usage: dict[Hashable, tuple[float, float, float]] = {}  # (seconds, items, as of)
        self._start: dict[Hashable, tuple[float, float]] = {}  # a newcomer's (seconds, as of)

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

    def pop(self, now: float, max_items: int) -> tuple[Hashable, list[Any]]:
        """The next batch: the least-used waiting owner's first item, or, if it is the only
        one waiting, as many as fit in `BATCH_S` at its mean (1 to `max_items`). Call only
        when not empty."""
        owner = min(self._queues, key=lambda o: self._rank(o, now))
        queue = self._queues[owner]
        used, scored = self._decayed(owner, now)
        take = 1
        if len(self._queues) == 1 and scored > 0:
            take = max(1, min(max_items, int(BATCH_S * scored / max(used, 1e-9))))
        batch = [queue.popleft() for _ in range(min(take, len(queue)))]
        if not queue:
            del self._queues[owner]
        return owner, batch

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
        used, scored = self._decayed(owner, now)
        others = ({*self._queues, *self._usage} - {owner})
        if not (used > per_item_s and used > per_item_s * scored and others):
            return False
        means = [u / n for u, n in (self._decayed(o, now) for o in others) if n > MIN_ITEMS]
        return used > OUTLIER * min(means, default=0.0) * scored

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
        nothing (about 5 minutes after one item): bounded memory."""
        for owner in [o for o in {*self._usage, *self._start} if o not in self._queues
                      and self._decayed(o, now)[1] < below_items
                      and self._rank(o, now) < below_items]:
            self._usage.pop(owner, None)
            self._start.pop(owner, None)
