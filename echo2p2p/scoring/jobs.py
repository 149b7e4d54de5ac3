"""What a scoring submission becomes: the job that collects its items' results, and its tally.

The `Scorer` (`echo2p2p.scoring.scorer`) queues each submission's items as one `Job`; worker
answers (`echo2p2p.scoring.worker`: `(reward, note, detail)` per item) come back in any order
and the job's future gets the `Scored` tally once every item is in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass

from . import worker as w


@dataclass(frozen=True)
class Scored:
    """The rewards of one submitted batch, in order, and what went wrong with any of them."""

    rewards: list[float]
    timed_out: int = 0  # completions that ran past the deadline (scored 0)
    failed: int = 0  # the reward function raised, returned a non-number, or its worker died (0)
    mismatched: int = 0  # ids given: the claimed text was not the decoding of the ids
    malformed: int = 0  # ids given: no completion (out of vocabulary, ids after EOS) (0)
    faults: tuple[str, ...] = ()  # episodes its environment's replay refutes: why (0 each)
    forged: int = 0  # programs that tried to forge their tests' verdict (0 each)


@dataclass(frozen=True)
class ScorerStats:
    calls: int  # batches submitted
    completions: int  # items scored (or given up on)
    timeouts: int  # completions killed at the deadline
    failures: int  # completions whose reward raised, was not finite, or whose worker died
    restarts: int  # workers started to replace one killed or dead
    round_trips: int  # batches sent to a worker (fewer than calls when jobs queue up)
    worker_pids: tuple[int, ...]  # the live worker processes


class Job:
    """Items to score, their results as they come, and the future that waits for all."""

    def __init__(self, items: list[tuple], future: asyncio.Future, owner: Hashable = None):
        self.items, self.future, self.owner = items, future, owner
        self.results: list[tuple[float, int, str] | None] = [None] * len(items)
        self.missing = len(items)

    def put(self, index: int, result: tuple[float, int, str]) -> None:
        self.results[index] = result
        self.missing -= 1
        if not self.missing and not self.future.done():
            self.future.set_result(tally(self.results))


def tally(results: list[tuple[float, int, str]]) -> Scored:
    notes = [note for _, note, _ in results]
    return Scored([r for r, _, _ in results], timed_out=notes.count(w.TIMEOUT),
                  failed=notes.count(w.FAILED), mismatched=notes.count(w.MISMATCH),
                  malformed=notes.count(w.MALFORMED), forged=notes.count(w.FORGED),
                  faults=tuple(why for _, note, why in results if note == w.REPLAYED))
