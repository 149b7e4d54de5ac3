"""Peers on gossip keep taking versions across a hub SIGKILLed and resumed: real processes on
loopback (`tests.chaos.harness`), S = 2 and kappa = 3, where the resumed hub's orphan leases once
dated new leases for a version that needed the batch waiting on them, and the run hung with
the peers holding the last version before the kill (issue 32)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import Cluster, HubLog, read_metrics, steps, versions_held

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

START_S, RUN_S = 180, 240


def test_peers_take_every_version_after_a_resume_on_gossip(cluster: Cluster, tmp_path):
    """A hub on --relay gossip with 3 generating peers is SIGKILLed between two publications
    (step 4 or later) and resumed on its port: it reaches max_steps, and each peer assembles
    every version published once all three were back."""
    max_steps, run_dir = 18, tmp_path / "run"
    hub = cluster.start_hub(run_dir, "--max-steps", str(max_steps), "--max-lag", "2",
                            "--publish-every", "3", "--lease-timeout-s", "15", "--relay", "gossip")
    peers = [cluster.start_peer(hub, f"gen-{i}") for i in range(3)]

    def past_a_publication() -> bool:
        assert hub.alive, hub.text()[-3000:]
        done = hub.live.steps
        return len(hub.live.holds) == 3 and bool(done) and done[-1] >= 4 and done[-1] % 3 != 2

    cluster.wait_for(past_a_publication, START_S + RUN_S, "the hub past step 4, between publications")
    killed_at = hub.live.steps[-1]
    cluster.kill(hub)
    hub2 = cluster.start_hub(run_dir, resume=True, port=hub.port, name="hub-resumed")
    cluster.wait_exit(hub2, RUN_S, f"the resumed hub (killed after step {killed_at}) to reach "
                      f"max_steps={max_steps}")
    assert hub2.popen.returncode == 0, hub2.text()[-3000:]
    assert steps(read_metrics(run_dir))[-1]["step"] == max_steps - 1

    log = HubLog.read(hub2.log)
    back = max(log.joined_line[pid] for pid, name in log.names.items()
               if name in {p.name for p in peers})
    after = log.published_after(back, max_steps)
    assert len(after) >= 2, f"too few versions after the resume to judge: {after}"
    missing = {p.name: sorted(set(after) - versions_held(p)) for p in peers}
    assert not any(missing.values()), f"versions published after the resume not taken: {missing}"
