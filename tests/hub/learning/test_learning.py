"""Learning parity: the distributed run learns as well as the single-process synchronous one."""

from __future__ import annotations

import asyncio

import pytest

from bench.sync_baseline import train_sync
from echo2p2p.hub.run.start import start_hub

from tests.conftest import running_peers

STEPS = 40


@pytest.mark.system  # 40 steps of real training, twice
async def test_distributed_run_matches_synchronous_baseline(hub_cfg):
    """Hub + 2 peers over websockets at S = 2 and the in-process S = 0 loop, same learner and
    settings, both end within 0.1 held-out accuracy of each other after the same steps.

    Fair because only the schedule differs: same base checkpoint, task, lr, G, prompts per step
    and bf16 weight path; the distributed run trains on rollouts up to 2 versions old
    (importance-corrected) and samples with other seeds. 0.1 is about three standard errors of
    a 200-problem accuracy, and far below the rise both runs make from the base policy.
    """
    cfg = hub_cfg.replace(max_steps=STEPS, max_lag=2, prompts_per_step=8, group_size=8,
                  eval_every=STEPS, eval_problems=200)
    async with start_hub(cfg, stream=None) as run, running_peers(run.url, 2, torch_threads=1):
        await asyncio.wait_for(run.finished.wait(), 240)
    evals = [r["eval/accuracy"] for r in run.records if "eval/accuracy" in r]
    base, distributed = evals[0], evals[-1]

    records = await asyncio.to_thread(
        train_sync, steps=STEPS, prompts_per_step=cfg.grpo.prompts_per_step, group_size=cfg.grpo.group_size,
        lr=cfg.grpo.lr, seed=cfg.run.seed, max_new_tokens=cfg.grpo.max_new_tokens, eval_every=STEPS,
        eval_problems=cfg.tasks.eval_problems)
    synchronous = records[-1]["eval_accuracy"]

    print(f"parity: base {base:.3f} distributed(S=2) {distributed:.3f} synchronous(S=0) {synchronous:.3f}")
    assert distributed - base >= 0.25 and synchronous - base >= 0.25, (base, distributed, synchronous)
    assert abs(distributed - synchronous) <= 0.1, (distributed, synchronous)
