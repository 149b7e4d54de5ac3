"""Fair queueing of scoring work over its owners (peers): who is scored next, and who is over budget.

A `FairQueue` keeps one queue of items per owner and each owner's scoring seconds, decayed
exponentially with a time constant of `WINDOW_S` (so the figure is about the seconds used in
the last minute). The next batch goes to the owner that used least: a peer whose samples burn
the deadline falls behind every peer that scores cheaply, and waits for them. While several
owners wait, a batch is one item, so an honest peer's group waits for at most one of another's
items; alone, an owner gets up to `max_items` at once (one pipe round trip for many). An owner
is over its budget while it used more than `budget_s` and more than any other owner waiting or
scored lately: the hub then refuses its submissions before they are queued
(`echo2p2p.hub.admission`).
Pure bookkeeping: the caller measures the seconds and passes `now`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

WINDOW_S = 60.0  # the usage's time constant: seconds used long ago count less


class FairQueue:
    """Items queued per owner, served least-used owner first."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, collections.deque[Any]] = {}
        self._usage: dict[Hashable, tuple[float, float]] = {}  # owner -> (seconds, as of)

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __iter__(self) -> Iterator[Any]:
        """Every queued item, owner by owner."""
        for queue in self._queues.values():
            yield from queue

    def push(self, owner: Hashable, items: Iterable[Any], front: bool = False) -> None:
        """Queue `items` for `owner` (`front`: ahead of its others, in their order)."""
        items = list(items)
        if not items:
            return
        queue = self._queues.setdefault(owner, collections.deque())
        if front:
            queue.extendleft(reversed(items))
        else:
            queue.extend(items)

    def pop(self, now: float, max_items: int) -> tuple[Hashable, list[Any]]:
        """The next batch: the least-used waiting owner's first item, or up to `max_items`
        of them if it is the only one waiting. Call only when not empty."""
        owner = min(self._queues, key=lambda o: self.usage_s(o, now))
        queue = self._queues[owner]
        take = max_items if len(self._queues) == 1 else 1
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

    def charge(self, owner: Hashable, seconds: float, now: float) -> None:
        """`owner`'s items took `seconds` of a worker, as of `now`."""
        self._usage[owner] = (self.usage_s(owner, now) + max(0.0, seconds), now)

    def usage_s(self, owner: Hashable, now: float) -> float:
        """`owner`'s scoring seconds, decayed to `now` (about: used in the last minute)."""
        used, at = self._usage.get(owner, (0.0, now))
        return used * math.exp(-max(0.0, now - at) / WINDOW_S)

    def over_budget(self, owner: Hashable, budget_s: float, now: float) -> bool:
        """Whether `owner` used more than `budget_s`, and more than every other owner that is
        waiting or scored lately (one that scores alone is never held back)."""
        used = self.usage_s(owner, now)
        others = [self.usage_s(o, now) for o in {*self._queues, *self._usage} - {owner}]
        return used > budget_s and bool(others) and used > max(others)

    def forget(self, now: float, below_s: float = 1e-3) -> None:
        """Drop the usage of owners whose seconds have decayed to nothing (bounded memory)."""
        for owner in [o for o in self._usage if o not in self._queues
                      and self.usage_s(o, now) < below_s]:
            del self._usage[owner]
