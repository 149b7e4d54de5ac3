"""Reward functions run in worker processes, off the event loop, each completion under a deadline.

Theory of operation. A `Scorer` owns `workers` child processes (`echo2p2p.scoring.worker`) and
drives them from one event loop: the loop of its first `await scorer.score(...)`, or a private
loop in a thread of its own when its first caller is a plain thread (`score_blocking`, as an
evaluation in `asyncio.to_thread` or the synchronous baseline calls it). Callers queue items (a
GRPO group, an evaluation batch), each for an owner (the hub's: a peer); a worker that is idle
gets a batch of many owners' items in fair order, the owner that used the least scoring time
lately first, as many as their owners' mean times say take ~50 ms, up to `MAX_BATCH_ITEMS` (one
pipe round trip for many cheap ones under load; one item of an owner not yet measured, a slow
owner's alone) (`echo2p2p.scoring.fairness`: a peer whose samples burn the deadline waits
behind the others, and past its budget what it has queued is failed with `OverBudget`). The
worker times each item and stops a batch run past `CUT_S`: each owner is charged its own
items' seconds, and what the worker left is queued again in front. The loop reads its answer
when the pipe is readable: no thread sits between the loop and a worker, so a submission
costs two process wake-ups and no GIL hand-off.

The worker (`echo2p2p.scoring.worker.WorkerProcess`) stamps the index and start time of the
completion it is on into shared memory. A timer on the loop fires at that completion's deadline,
`timeout_s` after it started; a worker that has not moved on is killed. That completion scores
0, is counted in `statistics().timeouts` and logged at WARNING; a fresh worker scores the
others, those before it again (reward functions are pure). A worker that dies on its own is
handled alike, counted in `failures`. A kill costs a worker start (~0.1-0.5 s).

Workers are spawned (never forked: the parent holds torch and threads, which fork copies
half-made; and under forkserver a worker's parent would be the fork server, which lives as
long as any of its children, so a worker deep in a verifier would outlive a killed hub), always
by one long-lived thread of the Scorer, and each asks the kernel to kill it when that thread
goes (Linux's parent-death signal): with the hub, or at `close()`. The reward function (and the
hub's `CompletionDecoder`) must be picklable: a module-level function, or a bound method of a
picklable task, pickled once here and loaded once per worker start.

Over 400 lines: one pool whose loop binding, deadlines, kill-and-replace and per-owner queues
share the same worker state; the queueing policy itself lives apart, pure, in
`echo2p2p.scoring.fairness`.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from echo2p2p.errors import ScoringError
from . import worker as w
from .fairness import CUT_S, FairQueue
from .jobs import Job as _Job
from .jobs import Scored, ScorerStats

if TYPE_CHECKING:
    from echo2p2p.completions import CompletionDecoder
    from .rewards import Key, Reward

log = logging.getLogger(__name__)
TOTALS = ("calls", "completions", "timeouts", "failures", "restarts")  # kept by checkpoints

MAX_BATCH_ITEMS = 256  # completions sent to a worker at once, when jobs queue up
DEFAULT_TIMEOUT_S = 5.0


class OverBudget(Exception):
    """A submission failed unscored: its owner's items took more than the scorer's per-item
    budget lately (`Scorer(sample_budget_s=...)`). An outcome for the caller to refuse, with
    the owner as its argument."""


class Scorer:
    """Worker processes running `reward(key, completion)`, `timeout_s` per completion."""

    def __init__(self, reward: Reward, *, decoder: CompletionDecoder | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 1, name: str = "scorer",
                 sample_budget_s: float = 0.0):
        """`decoder`: a `CompletionDecoder`, needed by `score_ids`. `sample_budget_s`: an
        owner whose items take more than this each (`FairQueue.over_budget`) has what it still
        has queued failed with `OverBudget` (0: never)."""
        if not timeout_s > 0 or workers < 1:
            raise ValueError(f"need timeout_s > 0 and workers >= 1, got {timeout_s}, {workers}")
        try:  # now, so that an unpicklable reward fails at start, not at the first rollout
            self._reward_blob = pickle.dumps(reward)
            self._decoder_blob = pickle.dumps(decoder) if decoder is not None else None
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise ValueError(f"the reward function must be picklable to run in a worker "
                             f"process (a module-level function or a task's method): "
                             f"{exc}") from None
        self.reward, self.has_decoder = reward, decoder is not None
        self.timeout_s, self.n_workers, self.name = timeout_s, workers, name
        self.sample_budget_s = sample_budget_s
        self._ctx = multiprocessing.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None  # the one loop that drives it all
        self._own_loop: threading.Thread | None = None  # that loop's thread, if it is ours
        self._own_loop_lock = threading.Lock()
        self._spawner: ThreadPoolExecutor | None = None
        self._queue = FairQueue()  # (job, item index), per owner (`echo2p2p.scoring.fairness`)
        self._idle: list[w.WorkerProcess] = []
        self._busy: set[w.WorkerProcess] = set()
        self._starting = 0  # workers being spawned
        self._ready: asyncio.Future | None = None  # None once every worker started, or the error
        self._closed = False
        self._calls = self._completions = self._timeouts = self._failures = self._restarts = 0
        self._round_trips = 0

    # --- scoring -------------------------------------------------------------------------

    async def score(self, items: Sequence[tuple[Key, str]], owner: Hashable = None) -> Scored:
        """`submit`, awaited: the event loop goes on meanwhile."""
        return await self.submit(items, owner)

    async def score_ids(self, key: Key, packed_ids: Sequence[bytes],
                        claimed: Sequence[str]) -> Scored:
        """`submit_ids`, awaited."""
        return await self.submit_ids(key, packed_ids, claimed)

    def submit(self, items: Sequence[tuple[Key, str]], owner: Hashable = None
               ) -> asyncio.Future[Scored]:
        """Queue `(key, completion text)` pairs (scored as `reward(key, text)`: the key is an
        answer, or the hub's `Problem`) now, from a coroutine or callback of the driving loop
        (the first one used); a future of their `Scored`. Cancelling it drops what is still
        queued of them. `owner` (a peer's identity): whose scoring time they use; owners are
        served least-used first (`echo2p2p.scoring.fairness`)."""
        return self._submit([(key, text) for key, text in items], owner)

    def submit_ids(self, key: Key, packed_ids: Sequence[bytes], claimed: Sequence[str],
                   turns: Sequence[bytes] | None = None, *, owner: Hashable = None
                   ) -> asyncio.Future[Scored]:
        """`submit` for completions given as packed token ids (as on the wire), each decoded by
        the completion rule; `claimed` are the texts a peer says they decode to. `turns`: the
        samples are episodes with these packed segment lengths, replayed by the reward's
        `replay` (`echo2p2p.scoring.rewards.EpisodeReplay`)."""
        if not self.has_decoder:
            raise ScoringError("this scorer has no decoder: it can only score texts")
        extra = [() for _ in packed_ids] if turns is None else [(t,) for t in turns]
        return self._submit([(key, ids, text, *more) for ids, text, more
                             in zip(packed_ids, claimed, extra, strict=True)], owner)

    def score_blocking(self, items: Sequence[tuple[str, str]]) -> Scored:
        """`score` from a plain thread (never the driving loop's own): waits for the result."""
        with self._own_loop_lock:
            loop = self._loop or self._start_own_loop()
        if _running_loop() is loop:
            raise RuntimeError("score_blocking called on the scorer's own event loop: "
                               "await score() there")
        return asyncio.run_coroutine_threadsafe(self.score(items), loop).result()

    async def start(self) -> None:
        """Start every worker now (else they start on first use) and wait until each has
        loaded the reward function; ScoringError if one cannot."""
        self._bind()
        self._spawn_missing()
        if (error := await asyncio.shield(self._ready)) is not None:
            raise error

    def usage_s(self, owner: Hashable) -> float:
        """`owner`'s scoring seconds of about the last minute (`FairQueue.usage_s`)."""
        return self._queue.usage_s(owner, time.monotonic())

    def over_budget(self, owner: Hashable, per_item_s: float) -> bool:
        """Whether `owner`'s items took more than `per_item_s` each lately, while others score
        too (`FairQueue.over_budget`)."""
        return self._queue.over_budget(owner, per_item_s, time.monotonic())

    def _submit(self, items: list[tuple], owner: Hashable) -> asyncio.Future[Scored]:
        self._bind()
        self._calls += 1
        job = _Job(items, self._loop.create_future(), owner)
        if not items:
            job.future.set_result(Scored([]))
            return job.future
        self._queue.push(owner, ((job, i) for i in range(len(items))), time.monotonic())
        job.future.add_done_callback(self._forget)
        self._spawn_missing()
        self._pump()
        return job.future

    def _forget(self, future: asyncio.Future) -> None:
        """A job was cancelled (its admission was): drop what is still queued of it."""
        if future.cancelled():
            self._queue.drop(lambda e: e[0].future is future)

    def statistics(self) -> ScorerStats:
        workers = [*self._idle, *self._busy]
        return ScorerStats(self._calls, self._completions, self._timeouts, self._failures,
                           self._restarts, self._round_trips, tuple(wk.pid for wk in workers))

    def totals(self) -> dict[str, int]:
        """The running counts, as plain data (for a checkpoint: a resumed hub's go on)."""
        return dict(zip(TOTALS, (self._calls, self._completions, self._timeouts, self._failures,
                                 self._restarts)))

    def restore_totals(self, totals: dict[str, int]) -> None:
        """Take up the counts `totals()` gave."""
        (self._calls, self._completions, self._timeouts, self._failures,
         self._restarts) = (totals.get(name, 0) for name in TOTALS)

    # --- closing -------------------------------------------------------------------------

    def close(self) -> None:
        """Kill the workers and cancel what waits; idempotent, from any thread."""
        loop = self._loop
        if loop is not None and loop.is_running() and _running_loop() is not loop:
            asyncio.run_coroutine_threadsafe(self._aclose(), loop).result()
        else:
            self._close_here()
        if self._own_loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._own_loop.join()
            loop.close()
            self._own_loop = None

    async def _aclose(self) -> None:
        self._close_here()

    def _close_here(self) -> None:
        """On the driving loop's thread (or with no loop running)."""
        if self._closed:
            return
        self._closed = True
        waiting = [*self._queue, *(e for wk in self._busy for e in wk.batch or ())]
        for worker in [*self._idle, *self._busy]:
            self._drop(worker)
        self._idle.clear()
        self._busy.clear()
        for job in {job for job, _ in waiting}:  # their callers are going too
            job.future.cancel()
        self._queue = FairQueue()
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(ScoringError("the scorer was closed"))
        if self._spawner is not None:
            # Its thread exits once a spawn under way is done; the kernel then kills any
            # worker that thread spawned (the parent-death signal), so none outlives us.
            self._spawner.shutdown(wait=False)

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- on the driving loop -------------------------------------------------------------

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise ScoringError("the scorer is closed")
        if self._loop is None:
            self._loop = loop
            self._spawner = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-spawner")
            self._ready = loop.create_future()
        elif self._loop is not loop:
            raise RuntimeError("a Scorer is driven by one event loop; use score_blocking "
                               "from other threads")

    def _start_own_loop(self) -> asyncio.AbstractEventLoop:
        """A private loop in a thread, for a Scorer whose callers are all plain threads."""
        loop = asyncio.new_event_loop()
        self._own_loop = threading.Thread(target=loop.run_forever, daemon=True,
                                          name=f"{self.name}-loop")
        self._own_loop.start()
        asyncio.run_coroutine_threadsafe(self._abind(), loop).result()
        return loop

    async def _abind(self) -> None:
        self._bind()

    def _spawn_missing(self) -> None:
        while (not self._closed
               and len(self._idle) + len(self._busy) + self._starting < self.n_workers):
            self._starting += 1
            future = self._loop.run_in_executor(
                self._spawner, w.WorkerProcess, self._ctx, self._reward_blob, self._decoder_blob,
                f"{self.name}-worker")
            future.add_done_callback(self._spawned)

    def _spawned(self, future: asyncio.Future) -> None:
        self._starting -= 1
        if future.cancelled():  # the loop is shutting down
            return
        error = future.exception()
        if self._closed:
            if error is None:
                future.result().kill()
            return
        if error is not None:  # every waiter learns it; the next submission tries again
            failure = error if isinstance(error, ScoringError) else ScoringError(repr(error))
            for job in {job for job, _ in self._queue}:
                if not job.future.done():
                    job.future.set_exception(failure)
            self._queue.clear()
            if not self._ready.done():
                self._ready.set_result(failure)
            return
        worker = future.result()
        self._idle.append(worker)
        if not self._ready.done() and len(self._idle) + len(self._busy) == self.n_workers:
            self._ready.set_result(None)
        self._pump()

    def _pump(self) -> None:
        """Give queued items to idle workers, in fair order (the least-used owner's first)."""
        while self._idle and self._queue:
            batch = [(job, i) for _, (job, i) in self._queue.pop(time.monotonic(), MAX_BATCH_ITEMS)
                     if not job.future.done()]
            if batch:
                self._send(self._idle.pop(), batch)

    def _send(self, worker: w.WorkerProcess, batch: list[tuple[_Job, int]]) -> None:
        worker.batch = batch
        self._busy.add(worker)
        self._round_trips += 1
        try:
            # An idle worker is blocked reading its pipe, so this write does not wait on it.
            worker.conn.send((CUT_S, [job.items[i] for job, i in batch]))
        except OSError:  # died while idle: none of the batch is to blame
            self._replace(worker, culprit=None)
            return
        worker.sent_at = time.monotonic()
        self._loop.add_reader(worker.conn.fileno(), self._on_answer, worker)
        worker.listening = True
        worker.timer = self._loop.call_later(self.timeout_s, self._check_deadline, worker)

    def _on_answer(self, worker: w.WorkerProcess) -> None:
        # Blocking again before reading (uvloop made the fd non-blocking for its poll), so a
        # whole answer is read; it is on its way: the worker writes it in one go.
        self._loop.remove_reader(worker.conn.fileno())
        os.set_blocking(worker.conn.fileno(), True)
        try:
            out, seconds = worker.conn.recv()
        except (EOFError, OSError):  # died (killed from outside, out of memory, ...)
            worker.listening = False
            self._replace(worker, culprit=self._current(worker)[0], timed_out=False)
            return
        worker.listening = False
        worker.timer.cancel()
        batch, worker.batch = worker.batch, None
        done, left = batch[:len(out)], batch[len(out):]
        worker.started += len(done)
        self._busy.discard(worker)
        self._idle.append(worker)
        self._requeue(left)  # the worker stopped past CUT_S: these go first again
        self._charge(done, seconds)
        self._completions += len(done)
        for (job, i), result in zip(done, out):
            if result[1] == w.FAILED:
                self._failures += 1
                self._log_failure(result[2])
            job.put(i, result)
        self._pump()

    def _log_failure(self, why: str) -> None:
        """A reward that raised or was no number: its reason at WARNING, the first ten times
        and then every hundredth (counted in `statistics().failures`)."""
        if self._failures <= 10 or self._failures % 100 == 0:
            log.warning("%s: a reward function failed (%s); that sample scores 0 (%d failures "
                        "so far)", self.name, why, self._failures)

    def _charge(self, entries: list[tuple[_Job, int]], seconds: Sequence[float]) -> None:
        """`entries` took `seconds` each: each owner is charged its own items' seconds, as its
        worker timed them. (Not the batch's round trip, which is the same for a batch of one
        item or of hundreds: in the means that size batches it would shrink them just when
        the machine is busy.) Past its budget, what an owner has queued is failed with
        `OverBudget` (its caller refuses them: the peer's queue no longer holds the others)."""
        used: dict[Hashable, list[float]] = {}
        for (job, _), item_s in zip(entries, seconds, strict=True):
            tally = used.setdefault(job.owner, [0.0, 0])
            tally[0] += item_s
            tally[1] += 1
        now = time.monotonic()
        for owner, (owner_s, items) in used.items():
            self._queue.charge(owner, owner_s, int(items), now)
        self._queue.forget(now)
        for owner in used:
            if self.sample_budget_s and owner is not None and self._queue.over_budget(
                    owner, self.sample_budget_s, now):
                for job in {job for job, _ in self._queue.drop(lambda e: e[0].owner == owner)}:
                    if not job.future.done():
                        job.future.set_exception(OverBudget(owner))

    def _requeue(self, entries: list[tuple[_Job, int]]) -> None:
        """Queue `entries` again, each in front of its owner's others, in their order."""
        by_owner: dict[Hashable, list[tuple[_Job, int]]] = {}
        for entry in entries:
            by_owner.setdefault(entry[0].owner, []).append(entry)
        for owner, owned in by_owner.items():
            self._queue.push(owner, owned, time.monotonic(), front=True)

    def _current(self, worker: w.WorkerProcess) -> tuple[int, float]:
        """(position in its batch, monotonic start) of the completion the worker is on."""
        index, began = int(worker.progress[0]), worker.progress[1]
        if index < worker.started:  # still reading the batch: its first item's clock runs
            return 0, worker.sent_at
        return index - worker.started, began

    def _check_deadline(self, worker: w.WorkerProcess) -> None:
        position, began = self._current(worker)
        left_s = began + self.timeout_s - time.monotonic()
        if left_s > 0:  # it moved on since: wait for this completion's own deadline
            worker.timer = self._loop.call_later(left_s, self._check_deadline, worker)
            return
        self._replace(worker, culprit=position, timed_out=True)

    def _replace(self, worker: w.WorkerProcess, culprit: int | None, timed_out: bool = False) -> None:
        """Kill `worker`, score its culprit 0, queue the rest of its batch again, start another."""
        batch, held_s = worker.batch or [], time.monotonic() - worker.sent_at
        self._busy.discard(worker)
        self._drop(worker)
        if culprit is None or culprit >= len(batch):
            self._requeue(batch)
        else:
            job, i = batch[culprit]
            self._requeue(batch[:culprit] + batch[culprit + 1:])
            # Its owner pays for all the time it held the worker, the deadline included: the
            # items scored before it are lost with the worker, and scored again.
            self._charge([batch[culprit]], [held_s])
            if timed_out:
                self._timeouts += 1
            else:
                self._failures += 1
            self._completions += 1
            item = job.items[i]
            log.warning("%s: a completion %s; it scores 0 and a fresh worker takes the rest "
                        "(%d timeouts so far). Completion: %.80r", self.name,
                        f"ran past the {self.timeout_s:g} s deadline, its worker was killed"
                        if timed_out else "killed its worker", self._timeouts,
                        item[1] if len(item) == 2 else "(decoded from ids)")
            job.put(i, (0.0, w.TIMEOUT if timed_out else w.FAILED, ""))
        self._restarts += 1
        self._spawn_missing()

    def _drop(self, worker: w.WorkerProcess) -> None:
        if worker.timer is not None:
            worker.timer.cancel()
        if not worker.conn.closed:
            if worker.listening and not self._loop.is_closed():
                self._loop.remove_reader(worker.conn.fileno())
            worker.kill()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
