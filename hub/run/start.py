"""A hub run's set-up: the run directory, the task, the policy, the hub, the learner, serving.

`start_hub(cfg)` is an async context manager: on entry the run directory is opened (or, with
`resume`, its checkpoint and journal read back), the task and the policy loaded, the hub, the
learner and the publisher built, version 0 (or the resumed one) published, the server and the
dashboard listening and the learner loop (`echo2p2p.hub.run.loop.HubRun.train`) running in the
background; on exit everything it opened is closed. `follow_rank` sets up a learner rank other
than 0 of a sharded learner. It knows nothing of a step: that is the loop's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from echo2p2p.config import as_dict
from echo2p2p.errors import ConfigError
from echo2p2p.learner_size import ModelShape
from echo2p2p.completions import CompletionDecoder
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.overlay.tickets import Tickets

from ..serving.app import bind, serve, tls_context
from ..serving.http_limits import request_budget
from ..config import SECRETS, HubConfig
from ..config_presets import all_sources, sources_table, write_sources
from ..view.dashboard import dashboard, status_route
from ..learning.durable import Checkpoints
from ..learning.estimates import Estimates
from ..learning.fitting import (LocalPeers, fit, fit_to_model, kept_streams, log_line,  # noqa: F401
                                micro_tokens, predicted_footprint)
from ..overlay.model_files import ModelFiles, model_routes, token_facts
from ..overlay.publisher import Publisher, load_or_make_key
from ..learning.ranks import Leader, Ranks, follow
from ..view.runlog import RunLog, propagation_line
from ..serving.server import Hub
from ..tasks.task_setup import TaskSetup, TokenizedProblem, open_setup
from ..view.experiment_trackers import Trackers, open_trackers
from .loop import HubRun
from .marker import MARKER, unclean_notice
from ..overlay.versions import VersionFiles

log = logging.getLogger(__name__)

Setup = TaskSetup | Callable[[], TaskSetup] | None  # the task and reward, or what makes them


@contextlib.asynccontextmanager
async def start_hub(cfg: HubConfig, *, stream: Any = None, resume: bool = False,
                    ranks: Ranks | None = None, setup: Setup = None,
                    sources: Mapping[str, str] | None = None,
                    peers: LocalPeers = LocalPeers()) -> AsyncIterator[HubRun]:
    """Load, bind, publish version 0 (or, `resume`, the checkpointed one of cfg.run.run_dir) and
    train in the background; stop on exit. `ranks`: this is rank 0 of a sharded learner (the
    others run `follow_rank`). `setup`: the task and reward, or what makes it once the ports are
    bound (None: as `cfg` names them).
    `sources`: where each field of `cfg` came from, logged and saved (`hub.config_presets`).
    `peers`: the demo's local peers, which share the memory budget (`hub.learning.fitting`).
    A run dir whose last hub was killed without a word is said so first (`hub.run.marker`)."""
    sock, board_sock = listeners = _listeners(cfg)  # a busy port fails here, at once
    try:
        # The policy's config and tokenizer files for peers (docs/protocol/scoring.md, section
        # 9), read next: a directory without them is refused (ConfigError on "model") before
        # any loading.
        files = await asyncio.to_thread(ModelFiles.for_model, cfg.run.model)
        sources = all_sources(cfg, sources)
        log.info("%s", sources_table(cfg, sources))  # before anything loads
        _say_if_killed(cfg)
        run, eval_scorer, trackers, made = await _open_new_or_resumed(cfg, stream, resume,
                                                                      ranks, setup, peers)
    except BaseException:
        _close(listeners)
        raise
    write_sources(run.runlog.run_dir, sources)
    hub, runlog = run.hub, run.runlog

    files = files.with_tokens(token_facts(run.tokenizer, run.learner.vocab_size))
    hub.core.model_index = files.signed(run.signing_key)  # the welcome's model_digest, signature
    routes = {"/status": status_route(run),
              **model_routes(files, authorize=Tickets(hub.core.hub_key, hub.core.run_id, "hub"))}
    budget = request_budget(cfg.limits)  # one per address for both ports; the dashboard shows it
    try:
        if hub.scorer is not None:  # a reward function that cannot load in a worker fails here
            await hub.scorer.start()
        async with serve(hub, cfg.network.host, cfg.network.port, routes, sock=sock,
                         budget=budget) as port, dashboard(run, board_sock, budget) as board:
            run.port, run.dashboard_port = port, board
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(run.train())]
                try:
                    yield run
                finally:
                    for task_ in tasks:
                        task_.cancel()
    finally:
        _close(listeners)  # after the servers (closing twice is harmless)
        if not run.port:  # it never served: a new run's directory goes again
            _remove(made)
        if isinstance(run.learner, Leader):
            run.learner.close()
        eval_scorer.close()
        if hub.scorer is not None:
            hub.scorer.close()  # serve() closed it already, unless it never started serving
        hub.checkpoint(None)  # closes the journal
        runlog.close()
        trackers.close()  # wandb finishes its run


def _say_if_killed(cfg: HubConfig) -> None:
    """A warning, before anything loads, when the last hub in cfg.run.run_dir died without a
    word (`hub.run.marker`): what happened, the checkpoint a resume goes back to, the command."""
    run_dir = Path(cfg.run.run_dir) if cfg.run.run_dir else None
    if run_dir is None or not (run_dir / MARKER).exists():
        return
    step = Checkpoints(run_dir).latest_step() if (run_dir / "checkpoints").is_dir() else None
    if notice := unclean_notice(run_dir, step):
        log.warning("%s", notice)


def _listeners(cfg: HubConfig) -> tuple[socket.socket, socket.socket | None]:
    """The peers' and the dashboard's (None: no dashboard) listeners, bound before the run
    directory is made or anything loads, and the TLS pair they serve checked: a ConfigError
    naming the port and the fix when one is in use."""
    tls_context(cfg.network.tls_cert, cfg.network.tls_key)
    sock = bind(cfg.network.host, cfg.network.port, "port", cfg.overlay.tcp_congestion)
    try:
        return sock, (None if cfg.view.dashboard_port < 0 else
                      bind(cfg.view.dashboard_host, cfg.view.dashboard_port, "dashboard_port"))
    except BaseException:
        sock.close()
        raise


def _close(listeners: tuple[socket.socket | None, ...]) -> None:
    for listener in listeners:
        if listener is not None:
            listener.close()


async def _open_new_or_resumed(cfg: HubConfig, stream: Any, resume: bool, ranks: Ranks | None,
                               setup: Setup, peers: LocalPeers
                               ) -> tuple[HubRun, Scorer, Trackers, Path | None]:
    """`_open_run` (with the task and reward `setup` makes, if it makes them), and the
    directory it made for a new run (`_new_run_dir`), which is removed again if it fails."""
    if callable(setup):  # made now that the ports are bound: a dataset may take a while
        setup = await asyncio.to_thread(setup)
    run_id = uuid.uuid4().hex[:12]  # a new run's (a resumed run keeps its own)
    made = _new_run_dir(cfg, resume, run_id)
    try:
        return (*await _open_run(cfg, stream, resume, ranks, setup, run_id, peers=peers), made)
    except BaseException:
        _remove(made)
        raise


def _new_run_dir(cfg: HubConfig, resume: bool, run_id: str) -> Path | None:
    """The directory this start will make for a new run (the run's, or the first of its parents
    that is not there yet); None for a resumed run or a directory that exists already: those
    are never removed."""
    run_dir = Path(cfg.run.run_dir or f"runs/{run_id}")
    if resume or run_dir.exists():
        return None
    while not run_dir.parent.exists():  # runs/ too, if this start makes it
        run_dir = run_dir.parent
    return run_dir


def _remove(run_dir: Path | None) -> None:
    """A new run's directory, made by a start that failed before it served: nothing of it is
    left behind (its config.json and run log say nothing a user could resume from)."""
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)


def log_listening(run: HubRun, ranks: Ranks | None = None) -> None:
    """The line that says the hub serves, and where: what users and scripts wait for. The CLI
    logs it once its own signal handlers are set, so that a Ctrl-C after it stops the run
    cleanly (`echo2p2p.hub.run`)."""
    cfg, hub = run.cfg, run.hub
    log.info("hub %s listening on %s (model %s, task %s, S=%d, kappa=%d, relay %s, learner on %d "
             "rank(s)); run dir %s; hub key %s", hub.core.run_id, run.url, cfg.run.model,
             hub.setup.kind, cfg.staleness.max_lag, cfg.staleness.kappa, cfg.overlay.relay,
             ranks.world if ranks else 1, run.runlog.run_dir, hub.core.hub_key.hex())


def make_learner(cfg: HubConfig, model: Any, tokenizer: Any, ranks: Ranks | None) -> Any:
    """The run's learner on `model` (sharded over `ranks`; every rank makes the same one, with
    micro-batches within `learner_micro_bytes` for this model's shape)."""
    from ..learning.learner import Learner

    return Learner(model, lr=cfg.grpo.lr, clip_eps=cfg.grpo.clip_eps, kl_coef=cfg.grpo.kl_coef,
                   temperature=cfg.grpo.temperature, pad_id=tokenizer.pad_token_id,
                   mismatch_correction=cfg.grpo.mismatch_correction,
                   mismatch_tis_cap=cfg.grpo.mismatch_tis_cap,
                   mismatch_mask_bound=cfg.grpo.mismatch_mask_bound,
                   micro_tokens=micro_tokens(cfg, ModelShape.of(model)), ranks=ranks,
                   precision=cfg.learner.learner_precision, checkpointing=cfg.learner.learner_checkpointing)


def _load_policy(cfg: HubConfig, weights: bool = True) -> tuple[Any, Any]:
    """The policy (fp32; `weights` False: on the meta device) and tokenizer."""
    import torch

    from echo2p2p.policy.model import load_policy

    if cfg.learner.torch_threads:
        torch.set_num_threads(cfg.learner.torch_threads)
    torch.manual_seed(cfg.run.seed)
    model, tokenizer = load_policy(cfg.run.model, device=cfg.learner.device, weights=weights)
    return model.float(), tokenizer


def follow_rank(cfg: HubConfig, ranks: Ranks) -> None:
    """A learner rank other than 0: the policy's architecture, the learner sharded over it with
    rank 0's weights (`Ranks.shard`), then rank 0's calls."""
    model, tokenizer = _load_policy(cfg, weights=False)
    follow(make_learner(cfg, model, tokenizer, ranks), ranks, tokenizer)


def _fit_and_predict(cfg: HubConfig, shape: ModelShape, runlog: RunLog, peers: LocalPeers,
                     resumed: bool, ranks: Ranks | None) -> HubConfig:
    """`cfg` fitted to the model and the memory budget (`hub.learning.fitting.fit`; ConfigError
    on "max_memory" when a budget the user set cannot hold it); the predicted footprint and
    what was fitted logged, and kept in the run log as a `footprint` record (what /status and
    the run summary can show). A sharded learner is not fitted to memory: every rank must cut
    the same micro-batches, and the other ranks fit to the model only (`follow_rank`)."""
    sharded = ranks is not None
    given = None if sharded else cfg.memory.max_memory_bytes
    budget = float("inf") if sharded else given or memory_budget_bytes()
    fitted = fit(cfg, shape, budget, peers, budget_given=given is not None, resumed=resumed)
    cfg, footprint = fitted.cfg, fitted.footprint
    runlog.event({"event": "footprint", "version": 0, "checkpoint_every": cfg.run.checkpoint_every,
                  "checkpoint_every_s": cfg.memory.checkpoint_every_s,
                  "catch_up_versions": cfg.overlay.catch_up_versions,
                  "learner_micro_tokens": cfg.learner.learner_micro_tokens, "params": shape.params,
                  "predicted_ram_bytes": footprint.ram_bytes,
                  "predicted_demo_ram_bytes": fitted.total_bytes,
                  "memory_budget_bytes": fitted.budget_bytes,
                  "predicted_disk_bytes": footprint.disk_bytes,
                  "predicted_disk_per_version_bytes": footprint.disk_per_version_bytes})
    for line in log_line(fitted, peers, shape).splitlines():
        log.info("%s", line)
    log.info("checkpoint every %d version(s) or %g s of training, catch-up deltas from up to %d "
             "versions back, learner micro-batches of %d tokens", cfg.run.checkpoint_every,
             cfg.memory.checkpoint_every_s, cfg.overlay.catch_up_versions,
             cfg.learner.learner_micro_tokens)
    if fitted.warning:
        log.warning("%s (the memory available now; the kernel may kill the hub)", fitted.warning)
    return cfg


def fitted_sources(cfg: HubConfig, sources: Mapping[str, str], peers: LocalPeers, *,
                   resumed: bool = False) -> tuple[HubConfig, dict[str, str], list[str]]:
    """What `--print-config` shows: the config as a start would fit it (the model's shape read
    from its config.json on the meta device, no weights; the same budget), each fitted field's
    source saying why, and the start log's footprint lines (`resumed`: a checkpoint loads
    while the model is resident). ConfigError as a start's."""
    shape = model_shape(cfg.run.model)
    given = cfg.memory.max_memory_bytes
    fitted = fit(cfg, shape, given or memory_budget_bytes(), peers, budget_given=given is not None,
                 resumed=resumed)
    lines = log_line(fitted, peers, shape).splitlines() + ([fitted.warning] if fitted.warning else [])
    return fitted.cfg, {**sources, **fitted.why}, lines


def model_shape(model: str) -> ModelShape:
    """The shape of `model` from its config alone (the architecture on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from echo2p2p.policy.model import model_source

    config = AutoConfig.from_pretrained(model_source(model))
    with torch.device("meta"):
        return ModelShape.of(AutoModelForCausalLM.from_config(config))


def memory_budget_bytes() -> float:
    """The RAM a hub may use when no --max-memory is given: what the machine has available now
    plus what this process holds already (its model may be loaded)."""
    import psutil

    return psutil.virtual_memory().available + psutil.Process().memory_info().rss


def _prompt_format(cfg: HubConfig, setup: TaskSetup, tokenizer: Any) -> Any:
    """The run's prompt format, checked against the tokenizer; an environment whose observations
    are user turns gets the chat template's turn markup, in its replay (which the welcome gives
    the peers too)."""
    prompts = cfg.tasks.prompts.check(tokenizer, repr(cfg.run.model))
    if setup.env and getattr(setup.task.factory(), "user_turns", False):
        setup.reward.turn = prompts.observation_turn(tokenizer)
    return prompts


def _leased(task: Any, tokenizer: Any, prompts: Any) -> list[TokenizedProblem]:
    """The task's train problems with their prompt ids, rendered as the hub leases them (a
    conversational row's messages through the chat template)."""
    from echo2p2p.policy.prompts import prompt_of

    from ..learning.learner import encode_prompt

    return [TokenizedProblem(p, encode_prompt(tokenizer, prompt_of(p), prompts))
            for p in task.problems("train")]


async def _open_run(cfg: HubConfig, stream: Any, resume: bool, ranks: Ranks | None = None,
                    setup: TaskSetup | None = None, run_id: str = "", *,
                    peers: LocalPeers = LocalPeers()) -> tuple[HubRun, Scorer, Trackers]:
    """Everything `start_hub` serves: the policy, the task, the hub, the learner and the run
    log, resumed from cfg.run.run_dir's checkpoint if `resume` (else new: `run_id`), version 0
    (or the resumed one) published; and the evaluation scorer and trackers (the caller's)."""
    from ..learning.spotcheck import SpotChecker

    saved = None
    if resume:
        if not cfg.run.run_dir:
            raise ConfigError("run_dir", "--resume needs the run directory")
        saved = await asyncio.to_thread(Checkpoints(Path(cfg.run.run_dir)).load)
    run_id = saved[1]["run_id"] if saved else run_id or uuid.uuid4().hex[:12]
    run_dir = Path(cfg.run.run_dir or f"runs/{run_id}")
    # the run's config.json, without the secrets (a resumed run is given them again)
    config = {"run_id": run_id, **{k: v for k, v in as_dict(cfg).items() if k not in SECRETS}}
    runlog = RunLog(run_dir, config, stream)
    # before the policy loads: a tracker's missing package is a ConfigError on report_to
    trackers = await asyncio.to_thread(open_trackers, cfg.view, run_dir, run_id, config)
    runlog.listeners += trackers.listeners
    setup = setup or await asyncio.to_thread(open_setup, cfg)
    await asyncio.to_thread(setup.check_runnable, cfg.scoring.unisolated_code)
    if setup.env and ranks is not None and cfg.tasks.eval_every:
        raise ConfigError("eval_every", "held-out episodes are evaluated on one learner rank "
                                        "only: set --eval-every 0 with --nproc-per-node")
    task = setup.task
    model, tokenizer = await asyncio.to_thread(_load_policy, cfg)
    cfg = _fit_and_predict(cfg, ModelShape.of(model), runlog, peers, saved is not None, ranks)
    prompts = _prompt_format(cfg, setup, tokenizer)  # before any prompt is leased
    # the spot-checker's copy first: the learner may shard the model in place
    spot = SpotChecker(model, cfg) if cfg.trust.spot_check_fraction > 0 else None
    learner = make_learner(cfg, model, tokenizer, ranks)
    learner = Leader(learner, ranks) if ranks is not None else learner
    problems = _leased(task, tokenizer, prompts)
    key = load_or_make_key(run_dir / "hub_key")
    estimates = Estimates(cfg)

    def on_event(record: dict[str, Any]) -> None:
        line = None
        if record["event"] == "propagation":
            if record["complete"]:  # T_bcast counts the reload (the paper's), when all did
                estimates.observe_broadcast(record["t_bcast_s"] or record["done_s"])
            line = propagation_line(record) if record["version"] % 10 == 5 else None
        runlog.event(record, line)

    decoder = CompletionDecoder(tokenizer)  # the eval scorer's too: ids for a reward reading them
    hub = Hub(cfg, run_id, task, problems, key, on_event=on_event, spot=spot, decode=decoder,
              setup=setup)
    checkpoints = Checkpoints(run_dir) if cfg.run.checkpoint_every else None
    eval_scorer = Scorer(setup.reward, decoder=decoder, timeout_s=cfg.scoring.score_timeout_s,
                         name="eval-scorer")
    on_disk = VersionFiles(run_dir / "versions", keep_chunks=cfg.overlay.keep_versions,
                           keep_streams=kept_streams(cfg))  # memory-mapped (hub.overlay.versions)
    run = HubRun(cfg, hub, learner, tokenizer, runlog, key, checkpoints, eval_scorer,
                 Publisher(cfg.overlay, key, spot, on_disk), estimates)
    if saved is not None:
        run.resume(saved)
    await run.publish()
    return run, eval_scorer, trackers
