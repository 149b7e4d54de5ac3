"""The hub's learner loop: `HubRun`, its step record, publication, evaluation, checkpoint, resume.

`HubRun.train` takes a batch of fresh groups, steps (in a worker thread, so the event loop keeps
serving peers), tells the hub the step is done (the hub's `step` is the run's one step counter),
publishes every kappa steps (`echo2p2p.hub.overlay.publisher`), evaluates every `eval_every` steps and
logs one record per step. It stops after `max_steps` (0: never), or when `stop()` asks (a signal):
after the step in progress, with a checkpoint of it. The run's clock (`elapsed_s`, the records'
`time_s`) and its totals go into every checkpoint and continue in a resumed run. The run is
opened, built and served by `echo2p2p.hub.run.start.start_hub`; the loop never touches a
socket (`echo2p2p.hub.serving.server`) or the weights' wire format (`echo2p2p.hub.overlay.publisher`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from echo2p2p.rates import WindowSum
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.staleness import is_publish_version, lag_versions

from ..config import HubConfig
from ..serving.counters import HubStatistics
from ..learning.checkpoint import checkpoint_due
from ..learning.durable import Checkpoints
from ..learning.estimates import Estimates
from ..learning.held_out import EvalProgress, evaluate_in_pieces
from ..overlay.publisher import Publisher
from ..view.runlog import RunLog
from ..serving.server import Hub
from .step_record import step_record
from ..core.events import Replanned, StepFinished, VersionPublished

log = logging.getLogger(__name__)


class HubRun:
    """A running hub: the server, the learner, the publisher and the run log."""

    def __init__(self, cfg: HubConfig, hub: Hub, learner: Any, tokenizer: Any, runlog: RunLog,
                 signing_key: bytes, checkpoints: Checkpoints | None = None,
                 eval_scorer: Scorer | None = None, publisher: Publisher | None = None,
                 estimates: Estimates | None = None):
        """`eval_scorer`: runs the task's reward on held-out completions (its own workers, so
        that an evaluation's batch never queues ahead of admission); None: the hub's.
        `publisher`: builds the versions (None: one signing with `signing_key`, no spot-checks).
        `estimates`: the capacity model's inputs (None: fresh ones; the hub's propagation
        records feed T_bcast into the caller's)."""
        self.cfg = cfg
        self.eval_scorer = eval_scorer or hub.scorer
        self.checkpoints = checkpoints
        self.resumed = False
        self.signing_key = signing_key
        self.publisher = publisher or Publisher(cfg.overlay, signing_key)
        self.hub = hub
        self.learner = learner
        self.tokenizer = tokenizer
        self.runlog = runlog
        self.port = 0
        self.dashboard_port: int | None = None  # None: no dashboard (cfg.view.dashboard_port -1)
        self.records: list[dict[str, Any]] = []
        self.evaluating: EvalProgress | None = None  # the evaluation under way, if one is
        self.finished = asyncio.Event()  # set when the loop reached max_steps
        self.estimates = estimates or Estimates(cfg)
        self._stopping = asyncio.Event()  # stop() asked: the loop ends after its step
        self._ended = asyncio.Event()  # train() returned, or raised
        # The run's clock: the learner loop's seconds over every process of the run. A resumed
        # run starts from its checkpoint's (the hours the hub was down are not counted, nor the
        # steps after the checkpoint that a kill lost: they are trained, and timed, again).
        self._clock_s = 0.0  # the run's seconds before this process's loop started
        self._start: float | None = None  # this process's loop start (train() sets it)
        # Seconds the loop waited for a batch, over the window of every rate: the learner is
        # busy (the capacity model's sense: not starved of rollouts) the rest of the time.
        self._waited = WindowSum(time.perf_counter())
        self._last_record_t = time.perf_counter()  # for the step's tokens/s
        self._filtered_seen = 0  # the hub's filtered groups at the last record (train() sets it)
        self._checkpointed_s: float | None = None  # the run's clock at the last checkpoint

    @property
    def url(self) -> str:
        return f"{'wss' if self.cfg.network.tls_cert else 'ws'}://{self.cfg.network.host}:{self.port}/ws"

    async def publish(self) -> None:
        """Checkpoint if due (before peers can hold the version), build, sign and announce."""
        if self.checkpoints is not None and checkpoint_due(
                self.publisher.published, self.elapsed_s(), self._checkpointed_s,
                every=self.cfg.run.checkpoint_every, every_s=self.cfg.memory.checkpoint_every_s):
            await self.checkpoint()
        import torch

        dtype = getattr(torch, self.cfg.overlay.weights_dtype)
        version = self.hub.core.step
        built = await asyncio.to_thread(
            lambda: self.publisher.build(version, self.learner.iter_weights(dtype)))
        self.hub.feed(VersionPublished(built))
        log.debug("published v%d: %d wire bytes in full, %s as a delta", built.version,
                  built.full.wire_bytes, built.delta.wire_bytes if built.delta else "none")

    async def checkpoint(self) -> None:
        """Take the hub's state and start a new journal in one go (nothing changes in between),
        then write the checkpoint in a worker thread while peers are served. The learner is
        idle meanwhile: the loop calls this between steps. The step is the hub's state's."""
        number = self.checkpoints.next_number()
        state = self.hub.checkpoint(self.checkpoints.journal(number))
        state["loop"] = {"time_s": self.elapsed_s(), "trained_lags": dict(self.runlog.staleness)}
        start, self._checkpointed_s = time.perf_counter(), state["loop"]["time_s"]
        await asyncio.to_thread(self.checkpoints.write, number, self.learner.save, state)
        log.debug("checkpoint %d at v%d in %.3f s", number, state["step"],
                  time.perf_counter() - start)

    def resume(self, saved: tuple[Path, dict[str, Any], list[list]]) -> None:
        """Continue from a checkpoint and its journal (see hub.learning.durable)."""
        learner, state, journal = saved
        self.learner.load(learner)
        self.hub.restore(state, journal)
        self.resumed = True
        loop = state.get("loop", {})  # absent from checkpoints before the run's clock was kept
        self._clock_s = self._checkpointed_s = loop.get("time_s", 0.0)
        self.runlog.staleness.update({int(k): n for k, n in loop.get("trained_lags", {}).items()})
        hub = self.hub.statistics()
        record = {"event": "resume", "version": hub.step, "journal_records": len(journal),
                  "queued_groups": hub.queued_groups, "open_leases": hub.open_leases,
                  "drawn_problems": hub.drawn_problems,  # the data cursor
                  **({"time_s": round(self._clock_s, 3)} if "time_s" in loop else {})}
        self.runlog.event(record, f"resumed at v{hub.step}: {record['queued_groups']} admitted "
                                  f"groups queued, {record['open_leases']} leases open, "
                                  f"{len(journal)} journal records replayed")

    async def evaluate(self) -> float:
        """Held-out accuracy of the policy now, in a worker thread, a piece at a time: how far
        it has got is `evaluating` meanwhile (/status shows it), None when none runs."""
        problems = self.hub.setup.task.problems("eval")[: self.cfg.tasks.eval_problems]
        progress = EvalProgress(self.hub.core.step, len(problems))
        log.info("evaluating v%d on %d held-out problems", progress.version, progress.total)
        self.evaluating = progress
        try:
            return await asyncio.to_thread(evaluate_in_pieces, self._evaluate_piece, problems,
                                           progress)
        finally:
            self.evaluating = None

    def _evaluate_piece(self, problems: list[Any]) -> float:
        """The greedy policy's mean reward on `problems` (blocking: in the worker thread)."""
        if self.hub.setup.env:  # greedy episodes of the held-out seeds
            from ..learning.episode_eval import evaluate_episodes

            return evaluate_episodes(
                self.learner, self.tokenizer, problems, self.hub.setup.task.factory,
                max_new_tokens=self.cfg.grpo.max_new_tokens, prompts=self.cfg.tasks.prompts,
                turn=self.hub.setup.reward.turn)

        def score(items: list[tuple[Any, str]]) -> list[float]:  # (problem, completion text)
            return self.eval_scorer.score_blocking(items).rewards

        return self.learner.evaluate(self.tokenizer, problems, score,
                                     max_new_tokens=self.cfg.grpo.max_new_tokens,
                                     prompts=self.cfg.tasks.prompts)

    def elapsed_s(self) -> float:
        """The run's clock: seconds of learner loop, over every process of a resumed run."""
        started = self._start is not None
        return self._clock_s + (time.perf_counter() - self._start if started else 0.0)

    async def stop(self) -> bool:
        """End the learner loop after its step in progress (no step starts after this call;
        an evaluation in progress is waited for), then checkpoint: the step, the run's clock and
        its totals as they are now, so that a resumed run goes on from here without a gap. False:
        this run keeps no checkpoints (checkpoint_every 0)."""
        self._stopping.set()
        await self._ended.wait()
        if self.checkpoints is None:
            return False
        await self.checkpoint()
        return True

    async def train(self) -> None:
        """The learner loop; returns after max_steps steps (never if 0), or once `stop()` asks."""
        try:
            await self._train()
        finally:
            self._ended.set()

    async def _train(self) -> None:
        cfg, hub = self.cfg, self.hub
        if cfg.tasks.eval_every and not self.resumed:
            acc = await self.evaluate()
            record = {"event": "eval", "version": 0, "eval/accuracy": acc}
            self.records.append(record)
            self.runlog.event(record, f"base policy v0: held-out reward {acc:.3f}")
        self._start = time.perf_counter()
        self._waited = WindowSum(self._start)
        self._last_record_t = self._start
        self._filtered_seen = hub.statistics().filtered_groups  # a resumed run's count goes on
        got = evaluated_s = None  # when the last batch came; what its step spent evaluating
        while not cfg.run.max_steps or hub.core.step < cfg.run.max_steps:
            waiting = time.perf_counter()
            if got is not None:  # T_train: the last step's whole time in the loop (compute,
                # publication, checkpoint, its record), its evaluation aside; on the tiny model
                # the compute (train/step_s) is the smaller part
                self.estimates.observe_train_step(waiting - got - evaluated_s)
            batch = await self._unless_stopping(hub.wait_batch())
            if batch is None:
                return
            got = time.perf_counter()
            self._waited.add(got, got - waiting)
            step = hub.core.step
            lags = Counter(lag_versions(step, g.version) for g in batch)
            self.runlog.staleness.update(lags)
            stats = await asyncio.to_thread(self.learner.step, batch)
            stopping = self._stopping.is_set()  # stop() checkpoints: no version, no evaluation
            hub.feed(StepFinished(stopping))  # and, unless stopping, a lease pass
            hub.feed(Replanned(self._required_rollouts_per_s()))
            # before the publication's checkpoint: a run resumed from it never logs a clock or
            # a total below this record's
            record = self._record(step, batch, lags, stats)
            if is_publish_version(hub.core.step, cfg.staleness.kappa) and not stopping:
                await self.publish()
            evaluated_s = 0.0
            if cfg.tasks.eval_every and hub.core.step % cfg.tasks.eval_every == 0 and not stopping:
                evaluating = time.perf_counter()
                record["eval/accuracy"] = await self.evaluate()
                evaluated_s = time.perf_counter() - evaluating
            self.records.append(record)
            self.runlog.step(record)
            if hub.core.step % 10 == 0:
                self.runlog.event({"event": "cost", "step": hub.core.step, "peers": {
                    pid: dict(view.account) for pid, view in hub.peer_views().items()}})
            if self._stopping.is_set():
                return
        self.finished.set()

    def _required_rollouts_per_s(self) -> float | None:
        """What the active peers must deliver: the capacity model's, for a batch of informative
        groups where dynamic sampling filters the rest (1 / their share as many rollouts)."""
        required = self.estimates.required_rollouts_per_s()
        return None if required is None else required / self.hub.core.buffer.informative_frac()

    async def _unless_stopping(self, wait: Any) -> Any:
        """What the coroutine `wait` returns, or None (it cancelled) once `stop()` asks."""
        waiting = asyncio.ensure_future(wait)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([waiting, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if waiting.done():
            return waiting.result()
        waiting.cancel()
        return None

    def _record(self, step: int, batch: list[Any], lags: Counter[int], stats: Any) -> dict[str, Any]:
        """The run log record of learner step `step` (which produced version `HubCore.step`)."""
        now, hub = time.perf_counter(), self.hub.statistics()
        tally = getattr(stats, "off_policy", None)  # None: a learner without diagnostics
        diagnostics = tally.summary(lambda version: lag_versions(step, version)) if tally else None
        record = step_record(
            step, hub, stats.metrics(), [g.lease_id for g in batch], lags,
            time_s=self.elapsed_s(),
            rollouts_per_s=hub.admitted_per_s, busy_frac=max(1.0 - self._waited.per_s(now), 0.0),
            tokens_per_s=stats.tokens / max(now - self._last_record_t, 1e-9),
            capacity=self.capacity_metrics(hub),
            off_policy={**(diagnostics or {}), **self.spot_mismatch()},  # every lag's mismatch
            filtered=hub.filtered_groups - self._filtered_seen)
        self._last_record_t, self._filtered_seen = now, hub.filtered_groups
        return record

    def spot_mismatch(self) -> dict[str, Any]:
        """The engine-vs-learner mismatch the spot-checks measured since the last record, by lag
        (`SpotChecker.mismatch`: `spot/mismatch_kl`, ...); {} without a checker or checks."""
        spot = self.publisher.spot
        return spot.mismatch() if spot is not None else {}

    def capacity_metrics(self, hub: HubStatistics | None = None) -> dict[str, Any]:
        """The capacity estimates, and the busy fraction they predict for the active peers."""
        hub = hub or self.hub.statistics()
        return self.estimates.metrics(hub.active_gen_rollouts_per_s, hub.required_rollouts_per_s)

