"""A peer joining a multi-turn run: the environment comes from an installed package, named with
its version in the welcome, and a peer without it (or with another version) refuses to join in
one sentence saying what to install. No code travels over the wire. A bug in the installed
environment costs the lease it happened on, not the peer."""

from __future__ import annotations

import asyncio

import pytest

from echo2p2p.errors import JoinRefused
from echo2p2p.hub.tasks.task_setup import TaskSetup
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.worker import Rollouts
from echo2p2p.adapters.environments import (EnvironmentMissing, find_environment, installed,
                                           require_environment)
from echo2p2p.scoring.rewards import EpisodeReplay
from echo2p2p.adapters.environment_task import EnvironmentTask
from echo2p2p.tasks.takeaway import TakeAway, make

from tests.hostile.harness import small_cfg


def test_the_built_in_environment_is_an_installed_entry_point():
    assert "takeaway" in installed()
    found = find_environment("takeaway")
    assert found.version == TakeAway.version and isinstance(found.factory(), TakeAway)


@pytest.mark.parametrize("name, version, says", [
    ("no-such-game", "1", "environment 'no-such-game' is not installed (installed: takeaway"),
    ("takeaway", "999", "version 1 is installed here: install version 999"),
])
def test_a_missing_or_other_version_environment_is_refused_in_one_sentence(name, version, says):
    with pytest.raises(EnvironmentMissing) as err:
        require_environment(name, version)
    message = str(err.value)
    assert says in message and message.count(". ") == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, version", [("no-such-game", "1"), ("takeaway", "999")])
async def test_a_peer_refuses_to_join_a_run_whose_environment_it_lacks(tmp_path, name, version):
    """The hub names the environment in its welcome; the peer refuses before building an
    engine, and `run` ends with JoinRefused (echo2-peer prints it and exits 1)."""
    hub_cfg = small_cfg(tmp_path, max_steps=1)
    task = EnvironmentTask(name, version, make, train_size=8, eval_size=0)
    setup = TaskSetup(task, EpisodeReplay(make), task.kind, version)
    async with start_hub(hub_cfg, stream=None, setup=setup) as run:
        peer = PeerClient(PeerConfig(hub_url=run.url, name="lacks-it", torch_threads=1))
        with pytest.raises(JoinRefused, match=f"this run needs environment {name!r} version "
                                              f"{version}"):
            await peer.run()
        assert peer.swapper.engine is None  # refused before anything was built


class BrokenOnce:
    """Rollouts whose installed environment fails on the first lease (a bug in the package);
    the leases it failed go in `failed`."""

    def __init__(self, honest: Rollouts, failed: list[str]):
        self.honest, self.failed = honest, failed

    def play(self, lease, seed, welcome, env):
        if not self.failed:
            self.failed.append(lease.lease_id)
            raise RuntimeError("a bug in the environment package")
        return self.honest.play(lease, seed, welcome, env)


@pytest.mark.timeout(180)
async def test_a_peer_whose_environment_fails_drops_that_lease_and_goes_on(tmp_path):
    cfg = small_cfg(tmp_path, env="takeaway", model="tiny-takeaway", max_new_tokens=4,
                    max_steps=2)
    async with start_hub(cfg, stream=None) as run:
        failed: list[str] = []
        peer = PeerClient(PeerConfig(hub_url=run.url, name="broken-once", torch_threads=1),
                          rollouts=lambda honest: BrokenOnce(honest, failed))
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(peer.run(stop))
            await asyncio.wait_for(run.finished.wait(), 150)
            stop.set()
    assert len(failed) == 1 and peer.statistics().acked >= 2 * cfg.grpo.prompts_per_step
