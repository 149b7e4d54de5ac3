"""Start a run and serve it until it is done: the one entry point (`run`) that `echo2-hub serve`
and `demo`, and a script's `echo2p2p.hub.api.Run`, call; the demo adds N local peer processes.

The demo's peers are real `echo2-peer join` processes talking to the hub over loopback
websockets; they are stopped when the learner reaches `max_steps`. SIGTERM or SIGINT (Ctrl-C)
stops either command cleanly: the learner loop ends after its step in progress (and the demo's
peers are sent SIGTERM at the same moment), the step is checkpointed, one line says how to
resume, and the process exits with 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM).
A second signal exits at once (the run directory is whole at any moment: the last checkpoint and
the journal after it). Each demo peer runs in a process group of its own and, on Linux, is sent
SIGTERM by the kernel if the demo dies without a word (killed, crashed). With the vLLM engine they
run under the vLLM environment's Python (`peer_python`): vLLM pins a transformers of its own,
so on a CPU machine it lives in a venv of its own (`.ci/vllm-env`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from echo2p2p.errors import ConfigError

from ..config import HubConfig
from .loop import HubRun
from ..learning.fitting import LocalPeers
from .marker import running
from .start import log_listening, start_hub
from ..view.run_data import read_run

log = logging.getLogger(__name__)

# A demo peer still running this long after its SIGTERM is killed: its own stop waits for the
# generation in progress and its interpreter's teardown (2-7 s measured on a loaded 2-core
# machine), and nothing it holds is needed (a resumed demo starts peers of its own).
PEERS_EXIT_S = 2.0


class Stopped(KeyboardInterrupt):
    """The run was stopped by a signal and ended cleanly (checkpointed, told how to resume);
    `echo2-hub` exits with 128 + `signum`. A KeyboardInterrupt, as a Ctrl-C is to a script."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


LOCAL_PEERS: list[int] = []  # the demo's peer processes, for a hub that must exit at once


def stop_local_peers() -> None:
    """SIGTERM to the demo's peer processes (safe in a signal handler)."""
    for pid in LOCAL_PEERS:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


async def _finished_or(run: HubRun, stopped: asyncio.Future[int]) -> bool | None:
    """Wait until the run reaches max_steps (True) or a signal stops it (None)."""
    finished = asyncio.ensure_future(run.finished.wait())
    try:
        await asyncio.wait([finished, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        finished.cancel()
    return None if stopped.done() else True


async def _stop(run: HubRun, signum: int, how: str) -> None:
    """End the learner loop after its step in progress, checkpoint, and say how to resume."""
    saved = await run.stop()
    name = signal.Signals(signum).name
    settings = run.runlog.run_dir / "config.json"
    print(f"stopped by {name} at v{run.hub.core.step} ({run.hub.core.step} steps trained): "
          + (f"checkpoint saved, its settings in {settings} (--resume reads them: the "
             f"model, task and every other field need no flag); resume with: {how}" if saved else
             "no checkpoint (checkpoint_every is 0): this run cannot be resumed"), flush=True)


def resume_hint(cfg: HubConfig, run_dir: Path, command: str, scripted: bool = False,
                flags: str = "") -> str:
    """How to continue the run in `run_dir`: the command (`serve` or `demo`, with `flags`, the
    ones not saved with the run: every config field is, in config.json, and `--resume` reads
    them), or, a script's run, the call. The dashboard token is not saved either (a secret),
    so it is asked for again."""
    if scripted:
        return f"Run(...).{command}(resume={str(run_dir)!r}) in your script"
    token = " --dashboard-token TOKEN" if cfg.view.dashboard_token else ""
    return f"echo2-hub {command} --resume {run_dir}{flags}{token}"


def demo_flags(local_peers: int, engine: str, python: str) -> str:
    """The demo's own flags, which no config field saves, as the run was started with them:
    `--peers` always (the one a resumed demo most needs the same), `--engine` and
    `--peer-python` where they differ from the defaults."""
    return (f" --peers {local_peers}" + (f" --engine {engine}" if engine != "transformers" else "")
            + (f" --peer-python {python}" if python != sys.executable else ""))


def peer_python(engine: str, given: str = "") -> str:
    """The interpreter the demo's peers run under: `given`; for vllm the first of
    $ECHO2_VLLM_PYTHON, ./.venv-vllm and the checkout's .venv-vllm, and this Python, that can
    import vLLM; else this Python. ConfigError naming the fix when none can."""
    if given:
        if not Path(given).is_file():
            raise ConfigError("peer_python", f"no such file: {given}")
        return given
    if engine != "vllm":
        return sys.executable
    checkout = Path(__file__).resolve().parents[2]
    candidates = [os.environ.get("ECHO2_VLLM_PYTHON", ""), ".venv-vllm/bin/python",
                  str(checkout / ".venv-vllm" / "bin" / "python"), sys.executable]
    for python in filter(None, candidates):
        if Path(python).is_file() and subprocess.run(
                [python, "-c", "import importlib.util as u, sys; "
                               "sys.exit(not (u.find_spec('vllm') and u.find_spec('echo2p2p')))"],
                capture_output=True).returncode == 0:
            return python
    raise ConfigError("engine", "vLLM is not installed here: run .ci/vllm-env (a CPU venv of "
                                "3.4 GB, about 2 minutes) or pip install 'echo2p2p[vllm]' on a "
                                "GPU machine, or name its Python with --peer-python")


async def run(cfg: HubConfig, *, local_peers: int = 0, engine: str = "transformers",
              python: str = sys.executable, ranks: Any = None, setup: Any = None,
              sources: Any = None, resume: Path | None = None,
              scripted: bool = False) -> list[dict[str, Any]]:
    """Serve a run until max_steps; the step records. The one entry point of a run: `echo2-hub
    serve` and `demo` (through `echo2p2p.hub.api.Run`), and a script's `Run`, all come here.
    `local_peers`: the demo's `echo2-peer join` processes to start (`engine`, under `python`),
    stopped either way at the end. `resume`: the run directory to continue (cfg.run.run_dir is
    it); `ranks`: this is rank 0 of a sharded learner; `setup`: the task and reward
    (`hub.tasks.task_setup`; None: as cfg names them); `sources`: where each field of cfg came
    from (`hub.config_presets`); `scripted`: the run is a Python script's (`Run` with a reward
    function or rows of its own), which is how it resumes. `Stopped` after a clean stop by a
    signal."""
    async with start_hub(cfg, stream=sys.stdout, resume=resume is not None, ranks=ranks,
                         setup=setup, sources=sources, peers=LocalPeers(local_peers, engine)) as run:
        if local_peers:
            how = resume_hint(cfg, run.runlog.run_dir, "demo", scripted,
                              demo_flags(local_peers, engine, python))
        else:
            how = resume_hint(cfg, run.runlog.run_dir, "serve", scripted)
        async with _stopped_by_signals(how) as stopped, _marked(run.runlog.run_dir, how):
            log_listening(run, ranks)  # after the handlers: a Ctrl-C from now on stops cleanly
            if local_peers:
                print(f"hub listening on {run.url}; starting {local_peers} local peers "
                      f"(S={cfg.staleness.max_lag}, kappa={cfg.staleness.kappa}, "
                      f"G={cfg.grpo.group_size}, {cfg.grpo.prompts_per_step} prompts/step, "
                      f"{cfg.run.max_steps or 'unlimited'} steps)", flush=True)
                if engine == "vllm":  # its peers log warnings only: say why nothing comes yet
                    print("the local peers start vLLM: a first start compiles the model "
                          "(minutes on a CPU), a later one loads it from its cache "
                          "(echo2-peer --model-cache, in its vllm folder)", flush=True)
            peers: list[asyncio.subprocess.Process] = []
            try:
                for i in range(local_peers):
                    peers.append(await _start_peer(cfg, run.url, f"local-{i}", engine, python))
                if await _finished_or(run, stopped) is None:
                    _terminate(peers)  # with the learner's stop: no step after they left
                    await _stop(run, stopped.result(), how)
            finally:
                _terminate(peers)
                await _wait_or_kill(peers)
        _summary(run)
    if stopped.done() and not stopped.cancelled():
        raise Stopped(stopped.result())
    return run.records


async def _start_peer(cfg: HubConfig, url: str, name: str, engine: str,
                      python: str) -> asyncio.subprocess.Process:
    """One local `echo2-peer join` process, in a process group of its own."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if engine == "vllm":  # one core's worth of KV cache, in GiB
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines drown the run's
    device = "cuda" if cfg.learner.device.startswith("cuda") else "cpu"  # the learner's kind
    proc = await asyncio.create_subprocess_exec(
        python, "-m", "echo2p2p.peer.cli", "join", url, "--name", name, "--engine", engine,
        "--device", device, "--torch-threads", "1", "--log-level", "warning", env=env,
        start_new_session=True, preexec_fn=_die_with_parent)
    LOCAL_PEERS.append(proc.pid)
    return proc


def _terminate(peers: list[asyncio.subprocess.Process]) -> None:
    for proc in peers:
        if proc.returncode is None:
            proc.terminate()


async def _wait_or_kill(peers: list[asyncio.subprocess.Process]) -> None:
    """Wait for the peers to exit; kill those still running after PEERS_EXIT_S."""
    waits = [asyncio.ensure_future(proc.wait()) for proc in peers]
    if waits:
        await asyncio.wait(waits, timeout=PEERS_EXIT_S)
    for proc in peers:
        if proc.returncode is None:
            proc.kill()
    await asyncio.gather(*waits)


@contextlib.asynccontextmanager
async def _stopped_by_signals(how: str) -> Any:
    """A future that SIGTERM or SIGINT completes with the signal's number, for a clean stop.
    From the first on, until the process exits (its stop and teardown included), a second one
    exits at once, saying `how` to resume from the last checkpoint (a Python-level handler: it
    runs even while the event loop waits on a thread)."""
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[int] = loop.create_future()
    signals = (signal.SIGTERM, signal.SIGINT)
    before = {sig: signal.getsignal(sig) for sig in signals}

    def at_once(signum: int, frame: Any) -> None:
        stop_local_peers()
        os.write(2, f"echo2-hub: stopped at once by a second {signal.Signals(signum).name}; "
                    f"the last checkpoint is kept: resume with: {how}\n".encode())
        os._exit(128 + signum)

    def stop(sig: signal.Signals) -> None:
        for s in signals:
            loop.remove_signal_handler(s)
            signal.signal(s, at_once)
        if not stopped.done():
            print(f"stopping on {sig.name}: the step in progress ends, then a checkpoint "
                  f"(again to exit at once)", flush=True)
            stopped.set_result(int(sig))

    for sig in signals:
        loop.add_signal_handler(sig, stop, sig)
    try:
        yield stopped
    finally:
        if not stopped.done():
            for sig in signals:
                loop.remove_signal_handler(sig)
                signal.signal(sig, before[sig])
            stopped.cancel()


@contextlib.asynccontextmanager
async def _marked(run_dir: Path, how: str) -> Any:
    """The run dir's RUNNING marker while the run serves: a kill that leaves it is said at
    the next start, with `how` to resume (`hub.run.marker`)."""
    with running(run_dir, how):
        yield


def _die_with_parent() -> None:
    """In a peer process before it runs: the kernel sends it SIGTERM when the demo dies
    (Linux prctl PR_SET_PDEATHSIG; elsewhere the demo's own stop is all there is)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def held_out_line(run_dir: Path, records: list[dict[str, Any]]) -> str | None:
    """`held-out reward: v0 0.250 -> v20 0.797 (+0.547); run log in ...`: from the run's first
    evaluation to its last, read from the run log, so that a resumed run's line covers the whole
    run (this process's `records` hold only what it trained: 'v20 0.797 -> v20 0.797' after a
    resume at v19); from `records` while the log has no step yet."""
    try:
        evals = read_run(run_dir).evals
    except (OSError, ValueError):
        evals = [(r["version"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    if not evals:
        return None
    (v0, a0), (v1, a1) = evals[0], evals[-1]
    return (f"held-out reward: v{v0} {a0:.3f} -> v{v1} {a1:.3f} ({a1 - a0:+.3f}); "
            f"run log in {run_dir}/metrics.jsonl")


def _summary(run: HubRun) -> None:
    if line := held_out_line(run.runlog.run_dir, run.records):
        print(line, flush=True)
    if rejected := run.hub.statistics().rejected_by:
        told = ", ".join(f"{reason} {n}" for reason, n in sorted(rejected.items(),
                                                                  key=lambda kv: -kv[1]))
        print(f"groups rejected: {sum(rejected.values())} ({told}); admitted: "
              f"{run.hub.statistics().admitted_groups}", flush=True)
