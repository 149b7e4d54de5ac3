"""Dynamic sampling in a real run (a hub, its learner loop and a real peer): no trained batch
holds a group whose rewards are all equal, every filtered group is counted in the step records,
and the peer is credited for all it delivered."""

from __future__ import annotations

import pytest

from echo2p2p.hub import Run
from echo2p2p.hub.run.start import start_hub

from tests.conftest import running_peers, within


def half_uniform(prompt: str, completion: str, row: dict) -> float:
    """1 for every completion of half the prompts (no gradient); the other half by length."""
    if sum(map(ord, prompt)) % 2:
        return 1.0
    return float(len(completion.strip()) % 2)


@pytest.mark.timeout(300)
async def test_a_run_trains_informative_groups_only_and_counts_the_rest(tmp_path):
    """Steps train no zero-variance group; per-step filtered counts sum to the total; the
    peer's admitted groups are the trained, filtered and still queued ones together."""
    run = Run(reward=[half_uniform], port=0, prompts_per_step=4, group_size=4, eval_every=0,
              max_steps=3, dynamic_sampling=True, run_dir=str(tmp_path / "run"),
              torch_threads=1)
    async with start_hub(run.config, setup=run.setup()) as hub_run, \
            running_peers(hub_run.url, 1, torch_threads=1):
        await within(hub_run.finished.wait(), 240, "three steps of informative groups")
        stats = hub_run.hub.statistics()
    steps = [r for r in hub_run.records if "step" in r and "event" not in r]
    assert len(steps) == 3
    assert all(r["train/zero_variance_groups"] == 0 and r["train/groups"] == 4 for r in steps)
    total = steps[-1]["rollout/filtered_groups_total"]
    assert total > 0 and sum(r["rollout/filtered_groups"] for r in steps) == total
    assert stats.admitted_groups >= 3 * 4 + total
    assert stats.admitted_groups == 3 * 4 + stats.filtered_groups + stats.queued_groups \
        + stats.stale_in_queue
