"""The hub's lifecycle: load policy and task, serve peers, run the learner loop, publish versions.

`start_hub(cfg)` is an async context manager: on entry the server listens and version 0 is
published; the learner loop then takes a batch of fresh groups, steps (in a worker thread, so
the event loop keeps serving peers), publishes every kappa steps, evaluates every
`eval_every` steps and logs one record per step. It stops after `max_steps` (0: never).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from echo2p2p import signing
from echo2p2p.capacity import Reading, Workload, predicted_busy_fraction, required_throughput
from echo2p2p import snapshot as snap
from echo2p2p.config import as_dict
from echo2p2p.errors import ConfigError
from echo2p2p.completions import CompletionDecoder
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.staleness import is_publish_version, lag_versions
from echo2p2p.tasks import AdditionTask, MathTask
from echo2p2p.overlay.tickets import Tickets

from .config import HubConfig
from .durable import Checkpoints
from .model_files import ModelFiles, model_routes, token_facts
from .runlog import RunLog
from .server import Hub, TokenizedProblem, serve
from .versions import Published, Snapshot

log = logging.getLogger(__name__)


def open_task(spec: str, seed: int) -> Any:
    """The built-in task by name, or a JSONL math task from a path."""
    if spec == "addition":
        return AdditionTask(seed=seed)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--task {spec!r}: not 'addition' and not a JSONL file")
    with path.open(encoding="utf-8") as lines:
        return MathTask.from_lines(lines, seed=seed)


class HubRun:
    """A running hub: the server, the learner and the run log."""

    def __init__(self, cfg: HubConfig, hub: Hub, learner: Any, tokenizer: Any, runlog: RunLog,
                 signing_key: bytes, checkpoints: Checkpoints | None = None,
                 eval_scorer: Scorer | None = None):
        """`eval_scorer`: runs the task's reward on held-out completions (its own workers, so
        that an evaluation's batch never queues ahead of admission); None: the hub's."""
        self.cfg = cfg
        self.eval_scorer = eval_scorer or hub.scorer
        self.checkpoints = checkpoints
        self.resumed = False
        self.signing_key = signing_key
        self.hub = hub
        self.learner = learner
        self.tokenizer = tokenizer
        self.runlog = runlog
        self.port = 0
        self.records: list[dict[str, Any]] = []
        self.finished = asyncio.Event()
        self._published = 0
        self._last_stream: tuple[int, bytes] | None = None  # the base of the next delta
        self.estimates = Estimates()

    @property
    def url(self) -> str:
        return f"{'wss' if self.cfg.tls_cert else 'ws'}://{self.cfg.host}:{self.port}/ws"

    async def publish(self) -> None:
        """Checkpoint if due (before peers can hold the version), build, sign and announce."""
        if self.checkpoints is not None and self._published % self.cfg.checkpoint_every == 0:
            await self.checkpoint()
        built = await asyncio.to_thread(self._build, self.learner.version)
        self.hub.publish(built)
        self._published += 1
        log.debug("published v%d: %d wire bytes in full, %s as a delta", built.version,
                  built.full.wire_bytes, built.delta.wire_bytes if built.delta else "none")

    async def checkpoint(self) -> None:
        """Take the hub's state and start a new journal in one go (nothing changes in between),
        then write the checkpoint in a worker thread while peers are served. The learner is
        idle meanwhile: the loop calls this between steps."""
        number = self.checkpoints.next_number()
        state = self.hub.state()
        if self.hub.journal is not None:
            self.hub.journal.close()
        self.hub.journal = self.checkpoints.journal(number)
        learner = {"model": self.learner.model.state_dict(), "version": self.learner.version,
                   "optimizer": self.learner.optimizer.state_dict()}
        start = time.perf_counter()
        await asyncio.to_thread(self.checkpoints.write, number, learner, state)
        log.debug("checkpoint %d at v%d in %.3f s", number, self.learner.version,
                  time.perf_counter() - start)

    def resume(self, saved: tuple[dict[str, Any], dict[str, Any], list[list]]) -> None:
        """Continue from a checkpoint and its journal (see hub.durable)."""
        learner, state, journal = saved
        self.learner.model.load_state_dict(learner["model"])
        self.learner.optimizer.load_state_dict(learner["optimizer"])
        self.learner.version = learner["version"]
        self.hub.restore(state, journal)
        self.resumed = True
        record = {"event": "resume", "version": self.hub.step, "journal_records": len(journal),
                  "queued_groups": len(self.hub.buffer), "open_leases": self.hub.leases.open_count}
        self.runlog.event(record, f"resumed at v{self.hub.step}: {record['queued_groups']} admitted "
                                  f"groups queued, {record['open_leases']} leases open, "
                                  f"{len(journal)} journal records replayed")

    def _build(self, version: int) -> Published:
        """The version in full, and as a delta against the last one unless it is an anchor."""
        import torch

        from echo2p2p.policy.weights import state_to_tensors

        dtype = getattr(torch, self.cfg.weights_dtype)
        weights = self.learner.export_weights(dtype)
        tensors = state_to_tensors(weights, dtype)
        if self.hub.spot is not None:
            self.hub.spot.keep(version, weights)  # exactly what peers load; not exported twice
        chunk_bytes = self.cfg.chunk_bytes or snap.auto_chunk_bytes(sum(len(t[3]) for t in tensors))
        full = self._sign(*snap.build_snapshot(version, tensors, chunk_bytes=chunk_bytes,
                                               zstd_level=self.cfg.zstd_level))
        delta = None
        if self._last_stream is not None and self._published % self.cfg.anchor_every:
            delta = self._sign(*snap.build_snapshot(
                version, tensors, chunk_bytes=chunk_bytes,
                zstd_level=self.cfg.zstd_level, base=self._last_stream))
        self._last_stream = (version, b"".join(raw for _, _, _, raw in tensors))
        return Published(full, delta)

    def _sign(self, manifest: Any, chunks: list[bytes]) -> Snapshot:
        return Snapshot(manifest, chunks, signing.sign_manifest(self.signing_key, manifest))

    async def evaluate(self) -> float:
        problems = self.hub.task.problems("eval")[: self.cfg.eval_problems]

        def score(items: list[tuple[str, str]]) -> list[float]:
            return self.eval_scorer.score_blocking(items).rewards

        return await asyncio.to_thread(self.learner.evaluate, self.tokenizer, problems, score,
                                       max_new_tokens=self.cfg.max_new_tokens)

    async def train(self) -> None:
        """The learner loop; returns after max_steps steps (never if 0)."""
        cfg, hub = self.cfg, self.hub
        if cfg.eval_every and not self.resumed:
            acc = await self.evaluate()
            record = {"event": "eval", "version": 0, "eval/accuracy": acc}
            self.records.append(record)
            self.runlog.event(record, f"base policy v0: held-out accuracy {acc:.3f}")
        start = time.perf_counter()
        busy_s = 0.0
        window = deque([(start, 0)], maxlen=6)  # (time, admitted samples): rates over 5 steps
        while not cfg.max_steps or hub.step < cfg.max_steps:
            batch = await self.hub.wait_batch()
            step = hub.step
            lags = Counter(lag_versions(step, g.version) for g in batch)
            self.runlog.staleness.update(lags)
            stats = await asyncio.to_thread(self.learner.step, batch)
            busy_s += stats.step_s
            hub.finish_step(self.learner.version)
            hub.dispatch()
            if is_publish_version(hub.step, cfg.kappa):
                await self.publish()
            now = time.perf_counter()
            self.estimates.train_step_s = _ewma(self.estimates.train_step_s, stats.step_s)
            hub.replan(self.required_rollouts_per_s())
            c = hub.counters
            record = {
                "step": step, "version": hub.step, "time_s": round(now - start, 3),
                **stats.metrics(),
                "rollout/staleness_hist": {str(k): v for k, v in sorted(lags.items())},
                "rollout/staleness_mean": sum(k * v for k, v in lags.items()) / len(batch),
                "rollout/leases": [g.lease_id for g in batch],
                "rollout/per_s": (c.admitted_samples - window[0][1]) / max(now - window[0][0], 1e-9),
                "rollout/admitted_groups_total": c.admitted_groups,
                "rollout/stale_on_arrival_total": c.stale_on_arrival,
                "rollout/stale_in_queue_total": hub.buffer.statistics().dropped_stale_total,
                "rollout/rejected_total": c.rejected,
                "rollout/spot_checked_total": c.spot_checked,
                "rollout/spot_failed_total": c.spot_failed,
                "hub/learner_busy_frac": busy_s / max(now - start, 1e-9),
                "hub/peers": len(hub.peers),
                "hub/closed_for_protocol_total": c.closed_for_protocol,
                "hub/score_timeouts_total": hub.scorer.statistics().timeouts,
                "train/tokens_per_s": stats.tokens / max(now - window[-1][0], 1e-9),
                **self.capacity_metrics(),
                **hub.pool.meter(hub.now()),
            }
            window.append((now, c.admitted_samples))
            if cfg.eval_every and hub.step % cfg.eval_every == 0:
                record["eval/accuracy"] = await self.evaluate()
            self.records.append(record)
            self.runlog.step(record)
            if hub.step % 10 == 0:
                self.runlog.event({"event": "cost", "step": hub.step,
                                   "peers": hub.pool.per_peer(hub.now())})
        self.finished.set()

    def workload(self) -> Workload:
        """The capacity model's inputs as measured so far."""
        est, cfg = self.estimates, self.cfg
        return Workload(cfg.prompts_per_step * cfg.group_size, est.train_step_s or 1e-9,
                        est.bcast_s or 0.0, cfg.max_lag, cfg.kappa)

    def required_rollouts_per_s(self) -> float | None:
        """What the active peers must deliver (overlapped reading, which is how the hub runs with
        S >= 1); None, meaning every peer works, before a step was timed, with S = 0 (any
        throughput shortens a synchronous step) or when the broadcast breaks the rule."""
        if not self.estimates.train_step_s or self.cfg.max_lag == 0:
            return None
        return required_throughput(self.workload(), Reading.OVERLAPPED).rollouts_per_s

    def capacity_metrics(self) -> dict[str, Any]:
        """The online estimates of the capacity model's inputs, and the busy fraction it predicts
        from them for the active peers (overlapped reading)."""
        est, pool = self.estimates, self.hub.pool
        mu = sum(a.rollouts_per_s for pid, a in pool.accounts.items() if pool.is_active(pid))
        return {
            "capacity/train_step_s": round(est.train_step_s, 4),
            "capacity/bcast_s": None if est.bcast_s is None else round(est.bcast_s, 4),
            "capacity/rollouts_per_s": round(mu, 2),
            "capacity/required_rollouts_per_s": self.hub.pool.required,
            "capacity/predicted_busy_frac": round(
                predicted_busy_fraction(self.workload(), mu, Reading.OVERLAPPED), 3),
        }


@dataclass
class Estimates:
    """EWMAs of the capacity model's inputs, measured while the run goes."""

    train_step_s: float = 0.0  # T_train: the learner's forward, backward and optimiser step
    bcast_s: float | None = None  # T_bcast: publication until every peer held the version


def _ewma(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if not old else (1 - weight) * old + weight * new


@contextlib.asynccontextmanager
async def start_hub(cfg: HubConfig, *, stream: Any = None, resume: bool = False
                    ) -> AsyncIterator[HubRun]:
    """Load, bind, publish version 0 (or, `resume`, the checkpointed one of cfg.run_dir) and
    train in the background; stop on exit."""
    import torch

    from echo2p2p.policy.model import load_policy

    from .learner import Learner, encode_prompt
    from .spotcheck import SpotChecker

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)
    saved = None
    if resume:
        if not cfg.run_dir:
            raise ConfigError("run_dir", "--resume needs the run directory")
        saved = await asyncio.to_thread(Checkpoints(Path(cfg.run_dir)).load)
    run_id = saved[1]["run_id"] if saved else uuid.uuid4().hex[:12]
    run_dir = Path(cfg.run_dir or f"runs/{run_id}")
    runlog = RunLog(run_dir, {"run_id": run_id, **as_dict(cfg)}, stream)
    task = open_task(cfg.task, cfg.seed)
    model, tokenizer = await asyncio.to_thread(load_policy, cfg.model, device=cfg.device)
    learner = Learner(model, lr=cfg.lr, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                      temperature=cfg.temperature, pad_id=tokenizer.pad_token_id)
    problems = [TokenizedProblem(p, encode_prompt(tokenizer, p.prompt)) for p in task.problems("train")]
    key = load_or_make_key(run_dir / "hub_key")
    def on_event(record: dict[str, Any]) -> None:
        line = None
        if record["event"] == "propagation":
            if record["complete"]:
                run.estimates.bcast_s = _ewma(run.estimates.bcast_s, record["done_s"])
            line = _propagation_line(record) if record["version"] % 10 == 5 else None
        runlog.event(record, line)

    spot = SpotChecker(learner.model, cfg) if cfg.spot_check_fraction > 0 else None
    hub = Hub(cfg, run_id, task, problems, key, on_event=on_event, spot=spot,
              decode=CompletionDecoder(tokenizer))
    checkpoints = Checkpoints(run_dir) if cfg.checkpoint_every else None
    eval_scorer = Scorer(task.reward, timeout_s=cfg.score_timeout_s, name="eval-scorer")
    run = HubRun(cfg, hub, learner, tokenizer, runlog, key, checkpoints, eval_scorer)
    if saved is not None:
        run.resume(saved)
    await run.publish()

    async def handle_status(request: web.Request) -> web.Response:
        return web.json_response(status(run))

    # The policy's config and tokenizer files for peers (docs/PROTOCOL.md section 9).
    files = await asyncio.to_thread(ModelFiles.for_model, cfg.model,
                                    token_facts(tokenizer, learner.vocab_size))
    routes = {"/status": handle_status,
              **model_routes(files, authorize=Tickets(hub.hub_key, hub.run_id, "hub"))}
    try:
        if hub.scorer is not None:  # a reward function that cannot load in a worker fails here
            await hub.scorer.start()
        async with serve(hub, cfg.host, cfg.port, routes) as port:
            run.port = port
            log.info("hub %s listening on %s (model %s, task %s, S=%d, kappa=%d); run dir %s; "
                     "hub key %s", run_id, run.url, cfg.model, task.kind, cfg.max_lag, cfg.kappa,
                     run_dir, hub.hub_key.hex())
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(hub.expire_leases()), tg.create_task(run.train())]
                try:
                    yield run
                finally:
                    for task_ in tasks:
                        task_.cancel()
    finally:
        eval_scorer.close()
        if hub.scorer is not None:
            hub.scorer.close()  # serve() closed it already, unless it never started serving
        if hub.journal is not None:
            hub.journal.close()
        runlog.close()


def load_or_make_key(path: Path) -> bytes:
    """The hub's Ed25519 signing key: read from `path`, or made at first start and kept there."""
    if path.exists():
        key = path.read_bytes()
        if len(key) != signing.KEY_BYTES:
            raise ValueError(f"{path}: not a raw 32-byte Ed25519 key")
        return key
    key = signing.new_private_key()
    path.touch(mode=0o600)
    path.write_bytes(key)
    return key


def _propagation_line(r: dict[str, Any]) -> str:
    """`v20 reached 4 peers: 50% 0.21 s, 90% 0.30 s, 100% 0.31 s; the hub uploaded 1.02 ...`."""
    times = ", ".join(f"{p}% {'-' if r[f't{p}_s'] is None else format(r[f't{p}_s'], '.2f') + ' s'}"
                      for p in (50, 90, 100))
    return (f"v{r['version']} reached {r['peers']} peers: {times}; the hub uploaded "
            f"{r['hub_upload_copies']} full copies' worth, {r['peers_on_delta']} peers took a delta")


def status(run: HubRun) -> dict[str, Any]:
    """What /status answers: a quick look at a live hub."""
    hub = run.hub
    accounts = hub.pool.per_peer(hub.now())  # price, active, rollouts/s, admitted, $
    return {
        "run_id": hub.run_id, "step": hub.step, "hub_key": hub.hub_key.hex(),
        "published_version": hub.newest.version if hub.newest else None,
        "peers": {p.peer_id: {"name": p.hello.name, "engine": p.hello.engine,
                              "held_version": p.held_version, "relay_url": p.server_url,
                              "relay": p.relay, "upload_mbps": round(p.upload_bps / 1e6, 2),
                              "trust": round(hub.trust.score(p.identity), 3),
                              "quarantined": p.identity in hub.trust.quarantined,
                              **accounts.get(p.peer_id, {})}
                  for p in hub.peers.values()},
        "capacity": run.capacity_metrics(),
        "cost": hub.pool.meter(hub.now()),
        "queued_groups": len(hub.buffer), "open_leases": hub.leases.open_count,
        "last": run.records[-1] if run.records else None,
    }
