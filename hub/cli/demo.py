"""Run a hub until it is done (`serve`), or a hub plus N local peer processes (`demo`).

The demo's peers are real `echo2-peer join` processes talking to the hub over loopback
websockets; they are stopped when the learner reaches `max_steps`, and when the demo is
stopped: SIGTERM or SIGINT (Ctrl-C) ends the run cleanly (checkpoint, run log) and stops them,
a second one exits at once; each peer runs in a process group of its own and, on Linux, is sent
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
from ..learning.run_setup import start_hub
from ..learning.loop import HubRun

log = logging.getLogger(__name__)


LOCAL_PEERS: list[int] = []  # the demo's peer processes, for a hub that must exit at once


def stop_local_peers() -> None:
    """SIGTERM to the demo's peer processes (safe in a signal handler)."""
    for pid in LOCAL_PEERS:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


async def run_serve(cfg: HubConfig, resume: Path | None = None, ranks: Any = None,
                    setup: Any = None, sources: Any = None) -> list[dict[str, Any]]:
    """Serve until max_steps; the step records. `resume`: the run directory to continue
    (cfg.run.run_dir is it); `ranks`: this is rank 0 of a sharded learner; `setup`: the task and
    reward (`hub.tasks.task_setup`; None: as cfg names them); `sources`: where each field of
    cfg came from (`hub.config_presets`)."""
    async with start_hub(cfg, stream=sys.stdout, resume=resume is not None, ranks=ranks,
                         setup=setup, sources=sources) as run:
        await run.finished.wait()
        _summary(run)
    return run.records


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


async def run_demo(cfg: HubConfig, n_peers: int, *, engine: str = "transformers",
                   python: str = sys.executable, ranks: Any = None,
                   setup: Any = None, sources: Any = None) -> list[dict[str, Any]]:
    """`run_serve`, with `n_peers` local `echo2-peer join` processes, until `max_steps` or a
    SIGTERM or SIGINT; the peers are stopped either way."""
    async with start_hub(cfg, stream=sys.stdout, ranks=ranks, setup=setup, sources=sources) as run, \
            _stopped_by_signals() as stopped:
        print(f"hub listening on {run.url}; starting {n_peers} local peers "
              f"(S={cfg.staleness.max_lag}, kappa={cfg.staleness.kappa}, G={cfg.grpo.group_size}, "
              f"{cfg.grpo.prompts_per_step} prompts/step, "
              f"{cfg.run.max_steps or 'unlimited'} steps)", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if engine == "vllm":  # one core's worth of KV cache, in GiB
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines drown the run's
        device = "cuda" if cfg.learner.device.startswith("cuda") else "cpu"  # the learner's kind
        peers: list[asyncio.subprocess.Process] = []
        try:
            for i in range(n_peers):
                peers.append(await asyncio.create_subprocess_exec(
                    python, "-m", "echo2p2p.peer.cli", "join", run.url, "--name", f"local-{i}",
                    "--engine", engine, "--device", device, "--torch-threads", "1",
                    "--log-level", "warning", env=env, start_new_session=True,
                    preexec_fn=_die_with_parent))
                LOCAL_PEERS.append(peers[-1].pid)
            finished = asyncio.ensure_future(run.finished.wait())
            try:
                await asyncio.wait([finished, stopped], return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if stopped.done():
                print(f"stopped by {stopped.result()}: stopping the peers and the hub", flush=True)
        finally:
            for proc in peers:
                if proc.returncode is None:
                    proc.terminate()
            for proc in peers:
                await proc.wait()
        _summary(run)
    return run.records


@contextlib.asynccontextmanager
async def _stopped_by_signals() -> Any:
    """A future that SIGTERM or SIGINT completes with the signal's name, for a clean stop;
    the handlers are removed by the first (a second signal acts as it would without them)."""
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[str] = loop.create_future()
    signals = (signal.SIGTERM, signal.SIGINT)

    def stop(sig: signal.Signals) -> None:
        for s in signals:
            loop.remove_signal_handler(s)
        if not stopped.done():
            stopped.set_result(sig.name)

    for sig in signals:
        loop.add_signal_handler(sig, stop, sig)
    try:
        yield stopped
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        stopped.cancel()


def _die_with_parent() -> None:
    """In a peer process before it runs: the kernel sends it SIGTERM when the demo dies
    (Linux prctl PR_SET_PDEATHSIG; elsewhere the demo's own stop is all there is)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _summary(run: HubRun) -> None:
    evals = [(r["version"], r["eval/accuracy"]) for r in run.records if "eval/accuracy" in r]
    if evals:
        (v0, a0), (v1, a1) = evals[0], evals[-1]
        print(f"held-out reward: v{v0} {a0:.3f} -> v{v1} {a1:.3f} ({a1 - a0:+.3f}); "
              f"run log in {run.runlog.run_dir}/metrics.jsonl", flush=True)
    if rejected := run.hub.statistics().rejected_by:
        told = ", ".join(f"{reason} {n}" for reason, n in sorted(rejected.items(),
                                                                  key=lambda kv: -kv[1]))
        print(f"groups rejected: {sum(rejected.values())} ({told}); admitted: "
              f"{run.hub.statistics().admitted_groups}", flush=True)
