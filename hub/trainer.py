"""The hub's run: the learner loop, its step record, checkpoint and resume, and `start_hub`.

`start_hub(cfg)` is an async context manager: on entry the server listens and version 0 is
published; the learner loop (`HubRun.train`) then takes a batch of fresh groups, steps (in a
worker thread, so the event loop keeps serving peers), tells the hub the step is done (the
hub's `step` is the run's one step counter), publishes every kappa steps
(`echo2p2p.hub.publisher`), evaluates every `eval_every` steps and logs one record per step.
It stops after `max_steps` (0: never). Never touches a socket (`echo2p2p.hub.server`) or the
weights' wire format (`echo2p2p.hub.publisher`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any


from echo2p2p.config import as_dict
from echo2p2p.errors import ConfigError
from echo2p2p.completions import CompletionDecoder
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.staleness import is_publish_version, lag_versions
from echo2p2p.tasks import AdditionTask, MathTask
from echo2p2p.overlay.tickets import Tickets

from .config import SECRETS, HubConfig
from .counters import HubStatistics
from .dashboard import dashboard, status_route
from .durable import Checkpoints
from .estimates import Estimates
from .model_files import ModelFiles, model_routes, token_facts
from .publisher import Publisher, load_or_make_key
from .ranks import Leader, Ranks, follow
from .runlog import RunLog, propagation_line
from .server import Hub, TokenizedProblem, serve
from .step_record import step_record
from .task_setup import TaskSetup, open_setup
from .trackers import Trackers, open_trackers
from .versions import VersionFiles

log = logging.getLogger(__name__)


def open_task(cfg: HubConfig) -> Any:
    """The task `cfg` names: a dataset (`echo2p2p.hub.dataset_task`), the built-in addition,
    or a JSONL math task from a path."""
    if cfg.dataset:
        from .dataset_task import open_dataset_task

        return open_dataset_task(cfg)
    spec = cfg.task  # the split is the task's own, never cfg.seed: the held-out set stays put
    if spec == "addition":
        return AdditionTask()
    path = Path(spec)
    if not path.is_file():
        raise ConfigError("task", f"{spec!r} is not 'addition' and not a JSONL file: give the "
                                  f"path of one, or a dataset with --dataset")
    with path.open(encoding="utf-8") as lines:
        try:
            return MathTask.from_lines(lines)
        except ValueError as e:  # a bad row, named by its line
            raise ConfigError("task", f"{spec}: {e}") from None


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
        self.publisher = publisher or Publisher(cfg, signing_key)
        self.hub = hub
        self.learner = learner
        self.tokenizer = tokenizer
        self.runlog = runlog
        self.port = 0
        self.dashboard_port: int | None = None  # None: no dashboard (cfg.dashboard_port -1)
        self.records: list[dict[str, Any]] = []
        self.finished = asyncio.Event()
        self.estimates = estimates or Estimates(cfg)
        self._start = time.perf_counter()  # the learner loop's start (train() sets it)
        self._busy_s = 0.0  # seconds the learner stepped since
        self._window: deque[tuple[float, int]] = deque(maxlen=6)  # (time, admitted samples)

    @property
    def url(self) -> str:
        return f"{'wss' if self.cfg.tls_cert else 'ws'}://{self.cfg.host}:{self.port}/ws"

    async def publish(self) -> None:
        """Checkpoint if due (before peers can hold the version), build, sign and announce."""
        if self.checkpoints is not None and self.publisher.published % self.cfg.checkpoint_every == 0:
            await self.checkpoint()
        import torch

        dtype = getattr(torch, self.cfg.weights_dtype)
        version = self.hub.step
        built = await asyncio.to_thread(
            lambda: self.publisher.build(version, self.learner.iter_weights(dtype)))
        self.hub.publish(built)
        log.debug("published v%d: %d wire bytes in full, %s as a delta", built.version,
                  built.full.wire_bytes, built.delta.wire_bytes if built.delta else "none")

    async def checkpoint(self) -> None:
        """Take the hub's state and start a new journal in one go (nothing changes in between),
        then write the checkpoint in a worker thread while peers are served. The learner is
        idle meanwhile: the loop calls this between steps. The step is the hub's state's."""
        number = self.checkpoints.next_number()
        state = self.hub.checkpoint(self.checkpoints.journal(number))
        start = time.perf_counter()
        await asyncio.to_thread(self.checkpoints.write, number, self.learner.save, state)
        log.debug("checkpoint %d at v%d in %.3f s", number, state["step"],
                  time.perf_counter() - start)

    def resume(self, saved: tuple[Path, dict[str, Any], list[list]]) -> None:
        """Continue from a checkpoint and its journal (see hub.durable)."""
        learner, state, journal = saved
        self.learner.load(learner)
        self.hub.restore(state, journal)
        self.resumed = True
        hub = self.hub.statistics()
        record = {"event": "resume", "version": hub.step, "journal_records": len(journal),
                  "queued_groups": hub.queued_groups, "open_leases": hub.open_leases}
        self.runlog.event(record, f"resumed at v{hub.step}: {record['queued_groups']} admitted "
                                  f"groups queued, {record['open_leases']} leases open, "
                                  f"{len(journal)} journal records replayed")

    async def evaluate(self) -> float:
        problems = self.hub.task.problems("eval")[: self.cfg.eval_problems]
        if self.hub.setup.env:  # greedy episodes of the held-out seeds
            from .episode_eval import evaluate_episodes

            return await asyncio.to_thread(
                evaluate_episodes, self.learner, self.tokenizer, problems, self.hub.task.factory,
                max_new_tokens=self.cfg.max_new_tokens, prompts=self.cfg.prompts)

        def score(items: list[tuple[Any, str]]) -> list[float]:  # (problem, completion text)
            return self.eval_scorer.score_blocking(items).rewards

        return await asyncio.to_thread(self.learner.evaluate, self.tokenizer, problems, score,
                                       max_new_tokens=self.cfg.max_new_tokens,
                                       prompts=self.cfg.prompts)

    async def train(self) -> None:
        """The learner loop; returns after max_steps steps (never if 0)."""
        cfg, hub = self.cfg, self.hub
        if cfg.eval_every and not self.resumed:
            acc = await self.evaluate()
            record = {"event": "eval", "version": 0, "eval/accuracy": acc}
            self.records.append(record)
            self.runlog.event(record, f"base policy v0: held-out reward {acc:.3f}")
        self._start = time.perf_counter()
        self._busy_s = 0.0
        self._window.append((self._start, 0))  # rates over the last 5 steps
        while not cfg.max_steps or hub.step < cfg.max_steps:
            batch = await hub.wait_batch()
            step = hub.step
            lags = Counter(lag_versions(step, g.version) for g in batch)
            self.runlog.staleness.update(lags)
            stats = await asyncio.to_thread(self.learner.step, batch)
            self._busy_s += stats.step_s
            hub.finish_step()
            hub.dispatch()
            if is_publish_version(hub.step, cfg.kappa):
                await self.publish()
            self.estimates.observe_train_step(stats.step_s)
            hub.replan(self.estimates.required_rollouts_per_s())
            record = self._record(step, batch, lags, stats)
            if cfg.eval_every and hub.step % cfg.eval_every == 0:
                record["eval/accuracy"] = await self.evaluate()
            self.records.append(record)
            self.runlog.step(record)
            if hub.step % 10 == 0:
                self.runlog.event({"event": "cost", "step": hub.step, "peers": {
                    pid: dict(view.account) for pid, view in hub.peer_views().items()}})
        self.finished.set()

    def _record(self, step: int, batch: list[Any], lags: Counter[int], stats: Any) -> dict[str, Any]:
        """The run log record of learner step `step` (which produced version `hub.step`)."""
        now, window, hub = time.perf_counter(), self._window, self.hub.statistics()
        record = step_record(
            step, hub, stats.metrics(), [g.lease_id for g in batch], lags,
            time_s=now - self._start,
            rollouts_per_s=(hub.admitted_samples - window[0][1]) / max(now - window[0][0], 1e-9),
            busy_frac=self._busy_s / max(now - self._start, 1e-9),
            tokens_per_s=stats.tokens / max(now - window[-1][0], 1e-9),
            capacity=self.capacity_metrics(hub))
        window.append((now, hub.admitted_samples))
        return record

    def capacity_metrics(self, hub: HubStatistics | None = None) -> dict[str, Any]:
        """The capacity estimates, and the busy fraction they predict for the active peers."""
        hub = hub or self.hub.statistics()
        return self.estimates.metrics(hub.active_rollouts_per_s, hub.required_rollouts_per_s)


@contextlib.asynccontextmanager
async def start_hub(cfg: HubConfig, *, stream: Any = None, resume: bool = False,
                    ranks: Ranks | None = None, setup: TaskSetup | None = None
                    ) -> AsyncIterator[HubRun]:
    """Load, bind, publish version 0 (or, `resume`, the checkpointed one of cfg.run_dir) and
    train in the background; stop on exit. `ranks`: this is rank 0 of a sharded learner (the
    others run `follow_rank`). `setup`: the task and reward (None: as `cfg` names them)."""
    # The policy's config and tokenizer files for peers (docs/PROTOCOL.md section 9), read
    # first: a directory without them is refused (ConfigError on "model") before any loading.
    files = await asyncio.to_thread(ModelFiles.for_model, cfg.model)
    run, eval_scorer, trackers = await _open_run(cfg, stream, resume, ranks, setup)
    hub, runlog = run.hub, run.runlog

    files = files.with_tokens(token_facts(run.tokenizer, run.learner.vocab_size))
    hub.model_index = files.signed(run.signing_key)  # the welcome's model_digest, signature
    routes = {"/status": status_route(run),
              **model_routes(files, authorize=Tickets(hub.hub_key, hub.run_id, "hub"))}
    try:
        if hub.scorer is not None:  # a reward function that cannot load in a worker fails here
            await hub.scorer.start()
        async with serve(hub, cfg.host, cfg.port, routes) as port, dashboard(run) as board:
            run.port, run.dashboard_port = port, board
            log.info("hub %s listening on %s (model %s, task %s, S=%d, kappa=%d, learner on %d "
                     "rank(s)); run dir %s; hub key %s", hub.run_id, run.url, cfg.model,
                     hub.setup.kind, cfg.max_lag, cfg.kappa, ranks.world if ranks else 1,
                     runlog.run_dir, hub.hub_key.hex())
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(hub.expire_leases()), tg.create_task(run.train())]
                try:
                    yield run
                finally:
                    for task_ in tasks:
                        task_.cancel()
    finally:
        if isinstance(run.learner, Leader):
            run.learner.close()
        eval_scorer.close()
        if hub.scorer is not None:
            hub.scorer.close()  # serve() closed it already, unless it never started serving
        hub.checkpoint(None)  # closes the journal
        runlog.close()
        trackers.close()  # wandb finishes its run


def make_learner(cfg: HubConfig, model: Any, tokenizer: Any, ranks: Ranks | None) -> Any:
    """The run's learner on `model` (sharded over `ranks`; every rank makes the same one)."""
    from .learner import Learner

    return Learner(model, lr=cfg.lr, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                   temperature=cfg.temperature, pad_id=tokenizer.pad_token_id,
                   micro_tokens=cfg.learner_micro_tokens, ranks=ranks,
                   precision=cfg.learner_precision, checkpointing=cfg.learner_checkpointing)


def _load_policy(cfg: HubConfig, weights: bool = True) -> tuple[Any, Any]:
    """The policy (fp32; `weights` False: on the meta device) and tokenizer."""
    import torch

    from echo2p2p.policy.model import load_policy

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(cfg.model, device=cfg.device, weights=weights)
    return model.float(), tokenizer


def follow_rank(cfg: HubConfig, ranks: Ranks) -> None:
    """A learner rank other than 0: the policy's architecture, the learner sharded over it with
    rank 0's weights (`Ranks.shard`), then rank 0's calls."""
    model, tokenizer = _load_policy(cfg, weights=False)
    follow(make_learner(cfg, model, tokenizer, ranks), ranks, tokenizer)


async def _open_run(cfg: HubConfig, stream: Any, resume: bool, ranks: Ranks | None = None,
                    setup: TaskSetup | None = None) -> tuple[HubRun, Scorer, Trackers]:
    """Everything `start_hub` serves: the policy, the task, the hub, the learner and the run
    log, resumed from cfg.run_dir's checkpoint if `resume`, version 0 (or the resumed one)
    published; and the evaluation scorer and the trackers, which the caller closes."""
    from .learner import encode_prompt
    from .spotcheck import SpotChecker

    saved = None
    if resume:
        if not cfg.run_dir:
            raise ConfigError("run_dir", "--resume needs the run directory")
        saved = await asyncio.to_thread(Checkpoints(Path(cfg.run_dir)).load)
    run_id = saved[1]["run_id"] if saved else uuid.uuid4().hex[:12]
    run_dir = Path(cfg.run_dir or f"runs/{run_id}")
    # the run's config.json, without the secrets (a resumed run is given them again)
    config = {"run_id": run_id, **{k: v for k, v in as_dict(cfg).items() if k not in SECRETS}}
    runlog = RunLog(run_dir, config, stream)
    # before the policy loads: a tracker's missing package is a ConfigError on report_to
    trackers = await asyncio.to_thread(open_trackers, cfg, run_dir, run_id, config)
    runlog.listeners += trackers.listeners
    setup = setup or await asyncio.to_thread(open_setup, cfg)
    await asyncio.to_thread(setup.check_runnable)
    if setup.env and ranks is not None and cfg.eval_every:
        raise ConfigError("eval_every", "held-out episodes are evaluated on one learner rank "
                                        "only: set --eval-every 0 with --nproc-per-node")
    task = setup.task
    model, tokenizer = await asyncio.to_thread(_load_policy, cfg)
    prompts = cfg.prompts.check(tokenizer, repr(cfg.model))  # before any prompt is leased
    # the spot-checker's copy first: the learner may shard the model in place
    spot = SpotChecker(model, cfg) if cfg.spot_check_fraction > 0 else None
    learner = make_learner(cfg, model, tokenizer, ranks)
    learner = Leader(learner, ranks) if ranks is not None else learner
    problems = [TokenizedProblem(p, encode_prompt(tokenizer, p.prompt, prompts))
                for p in task.problems("train")]
    key = load_or_make_key(run_dir / "hub_key")
    estimates = Estimates(cfg)

    def on_event(record: dict[str, Any]) -> None:
        line = None
        if record["event"] == "propagation":
            if record["complete"]:  # T_bcast counts the reload (the paper's), when all did
                estimates.observe_broadcast(record["t_bcast_s"] or record["done_s"])
            line = propagation_line(record) if record["version"] % 10 == 5 else None
        runlog.event(record, line)

    hub = Hub(cfg, run_id, task, problems, key, on_event=on_event, spot=spot,
              decode=CompletionDecoder(tokenizer), setup=setup)
    checkpoints = Checkpoints(run_dir) if cfg.checkpoint_every else None
    eval_scorer = Scorer(setup.reward, timeout_s=cfg.score_timeout_s, name="eval-scorer")
    # Published versions on disk, memory-mapped (hub.versions): S + 1 streams for the spot-checker
    # (else one: the next delta's base), catch_up_versions + 1 as laggards' bases (hub.catchup).
    on_disk = VersionFiles(run_dir / "versions", keep_chunks=cfg.keep_versions,
                           keep_streams=max(cfg.max_lag + 1 if spot else 1, cfg.catch_up_versions + 1))
    run = HubRun(cfg, hub, learner, tokenizer, runlog, key, checkpoints, eval_scorer,
                 Publisher(cfg, key, spot, on_disk), estimates)
    if saved is not None:
        run.resume(saved)
    await run.publish()
    return run, eval_scorer, trackers
