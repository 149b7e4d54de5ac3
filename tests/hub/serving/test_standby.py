"""Cost-aware activation in a live hub: a paid peer the free one makes unnecessary waits on
standby (no leases; versions only if warm) and goes back to work when the free peer leaves."""

from __future__ import annotations

import asyncio
import json

import pytest

from echo2p2p.hub.learning.learner import hold_step_time
from echo2p2p.hub.run.start import start_hub

from tests.conftest import running_peers, wait_until

STEP_S = 1.0  # the learner's step, held fixed: R = 16 rollouts per 1 s step needs ~18/s


def peer_id(run, name: str) -> str:
    return next(pid for pid, c in run.hub.peer_views().items() if c.name == name)


def state(run, peer_id: str) -> str:
    """Whether the pool has `peer_id` at work (active) or not (standby, quarantined)."""
    return run.hub.peer_views()[peer_id].state


@pytest.mark.parametrize("standby", ["warm", "cold"])
async def test_paid_peer_waits_on_standby_until_needed(hub_cfg, standby):
    cfg = hub_cfg.replace(max_lag=2, standby=standby, max_steps=200)
    async with start_hub(cfg, stream=None) as run:
        hold_step_time(run.learner, STEP_S)  # a slow learner, as a large model's
        async with running_peers(run.url, 1, name="paid", price_per_hour=3.6) as (paid,):
            async with running_peers(run.url, 1, name="free") as (free,):
                await asyncio.wait_for(run.hub.until(lambda: len(run.hub.peer_views()) == 2), 60)
                paid_id = peer_id(run, "paid")
                await asyncio.wait_for(run.hub.until(lambda: state(run, paid_id) != "active"), 120)
                # Leases it held when put on standby may still come back; no new ones go out.
                await asyncio.wait_for(run.hub.until(
                    lambda: len(run.hub.peer_views()[paid_id].open_leases) == 0), 60)
                submitted, version, step = paid.statistics().submitted, paid.version, run.hub.core.step
                acked_free = free.statistics().acked
                await asyncio.wait_for(run.hub.until(lambda: run.hub.core.step >= step + 4), 60)
                assert paid.statistics().submitted == submitted
                assert free.statistics().acked > acked_free
                if standby == "warm":
                    await wait_until(lambda: paid.version >= step + 2)
                else:
                    assert paid.version <= version + 1  # at most one announced before standby
                usd_standby = run.hub.statistics().cost["cost/usd_total"]
            # The free peer left: the paid one is the only worker and must go back to work.
            await asyncio.wait_for(run.hub.until(lambda: state(run, paid_id) == "active"), 60)
            step = run.hub.core.step
            await asyncio.wait_for(run.hub.until(lambda: run.hub.core.step >= step + 3), 60)
            assert paid.statistics().submitted > submitted
            assert paid.version >= step
            assert run.hub.statistics().cost["cost/usd_total"] > usd_standby
    records = [json.loads(line) for line in
               (run.runlog.run_dir / "metrics.jsonl").read_text().splitlines()]
    moves = [r for r in records if r.get("event") == "activation"]
    assert paid_id in moves[0]["standby"] and paid_id in moves[-1]["activated"]
    assert moves[0]["lp_bound_usd_per_hour"] == 0.0  # the free peer covers it all
    steps = [r for r in records if "step" in r and "event" not in r]
    assert steps[-1]["cost/usd_total"] > 0 and steps[-1]["cost/usd_per_1k_rollouts"] > 0
