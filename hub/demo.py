"""Run a hub until it is done (`serve`), or a hub plus N local peer processes (`demo`).

The demo's peers are real `echo2-peer join` processes talking to the hub over loopback
websockets; they are stopped when the learner reaches `max_steps`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from .config import HubConfig
from .trainer import HubRun, start_hub

log = logging.getLogger(__name__)


async def run_serve(cfg: HubConfig, resume: Path | None = None) -> int:
    """Serve until max_steps; `resume`: the run directory to continue (cfg.run_dir is it)."""
    async with start_hub(cfg, stream=sys.stdout, resume=resume is not None) as run:
        await run.finished.wait()
        _summary(run)
    return 0


async def run_demo(cfg: HubConfig, n_peers: int) -> int:
    async with start_hub(cfg, stream=sys.stdout) as run:
        print(f"hub listening on {run.url}; starting {n_peers} local peers "
              f"(S={cfg.max_lag}, kappa={cfg.kappa}, G={cfg.group_size}, "
              f"{cfg.prompts_per_step} prompts/step, {cfg.max_steps or 'unlimited'} steps)", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        peers = [await asyncio.create_subprocess_exec(
            sys.executable, "-m", "echo2p2p.peer.cli", "join", run.url, "--name", f"local-{i}",
            "--torch-threads", "1", "--log-level", "warning", env=env) for i in range(n_peers)]
        try:
            await run.finished.wait()
        finally:
            for proc in peers:
                if proc.returncode is None:
                    proc.terminate()
            for proc in peers:
                await proc.wait()
        _summary(run)
    return 0


def _summary(run: HubRun) -> None:
    evals = [(r["version"], r["eval/accuracy"]) for r in run.records if "eval/accuracy" in r]
    if evals:
        (v0, a0), (v1, a1) = evals[0], evals[-1]
        print(f"held-out accuracy: v{v0} {a0:.3f} -> v{v1} {a1:.3f} ({a1 - a0:+.3f}); "
              f"run log in {run.runlog.run_dir}/metrics.jsonl", flush=True)
