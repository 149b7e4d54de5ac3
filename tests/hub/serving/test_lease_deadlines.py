"""Lease deadlines against real peers (issue 30): a slow peer's leases do not expire while they
wait in its queue behind its own slow generations; a silent peer's leases still do."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import aiohttp
import pytest

from echo2p2p import messages as m
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.worker import Rollouts
from echo2p2p.session import Session, Side


GENERATE_S = 1.5  # the slow engine's time per group
LEASE_TIMEOUT_S = 4.0  # shorter than the 4 leases the slow peer queues (4 x 1.5 s)


class SlowEngine:
    """The honest rollouts, each group taking GENERATE_S longer: an engine on a slow machine.
    Notes, for each group, its lease id and the seconds from the lease's arrival to the group."""

    def __init__(self, honest: Rollouts):
        self.honest = honest
        self.arrived: dict[str, float] = {}  # lease id -> when the peer queued it (monotonic)
        self.made: list[tuple[str, float]] = []  # (lease id, seconds since it arrived)

    def generate(self, lease: m.LeaseGrant, seed: int, welcome: m.Welcome):
        time.sleep(GENERATE_S)  # the engine's own time, in the worker's thread: not a sync
        out = self.honest.generate(lease, seed, welcome)
        self.made.append((lease.lease_id, time.monotonic() - self.arrived[lease.lease_id]))
        return out

    def play(self, lease, seed, welcome, env):  # no environment in this run
        raise NotImplementedError


async def test_a_slow_peer_with_leases_queued_past_the_timeout_gets_every_group_accepted(hub_cfg):
    """4 leases queued on a peer whose engine takes 1.5 s a group, under a 4 s lease timeout:
    the last of them is made more than a timeout after it arrived, yet nothing expires and every
    group is admitted (a deadline counts from the lease's place in its peer's queue, and each
    group the peer delivers renews the leases it still holds)."""
    cfg = hub_cfg.replace(lease_timeout_s=LEASE_TIMEOUT_S, new_peer_leases=4)
    engines: list[SlowEngine] = []

    def slow(honest: Rollouts) -> SlowEngine:
        engines.append(SlowEngine(honest))
        return engines[-1]

    async with start_hub(cfg, stream=None) as run:
        peer = PeerClient(replace(PeerConfig(hub_url=run.url, name="slow"), leases_in_flight=4,
                                  torch_threads=1), rollouts=slow)
        take = peer.worker.take

        def noted(lease: m.LeaseGrant, deadline: float) -> None:  # when a lease reached the peer
            engines[0].arrived[lease.lease_id] = time.monotonic()
            take(lease, deadline)

        peer.worker.take = noted
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(peer.run(stop))
            await asyncio.wait_for(run.hub.until(
                lambda: run.hub.statistics().admitted_groups >= 6), 90)
            stop.set()
        stats = run.hub.statistics()
    assert stats.leases_expired == 0 and stats.rejected == 0, stats
    assert peer.statistics().rejected == {}
    late = [lease_id for lease_id, waited_s in engines[0].made if waited_s > LEASE_TIMEOUT_S]
    assert late, f"no lease waited past the timeout: {engines[0].made}"


async def test_a_silent_peer_loses_every_lease_it_holds(hub_cfg):
    """A peer that takes leases and never answers: each expires (the one with n leases of its
    peer's ahead of it no later than n + 1 timeouts after its grant: nothing renews it) and goes
    back to the queue; the hub counts the expiries."""
    cfg = hub_cfg.replace(lease_timeout_s=1.0, new_peer_leases=3)
    async with start_hub(cfg, stream=None) as run, aiohttp.ClientSession() as http, \
            http.ws_connect(run.url) as ws:
        s = Session(Side.PEER, 0.0)
        await ws.send_bytes(s.send(m.Hello("silent", "transformers", "cpu")))
        s.receive((await ws.receive()).data, 0.0)
        await ws.send_bytes(s.send(m.LeaseRequest(3)))
        grants: list[m.LeaseGrant] = []
        while len(grants) < 3:
            if isinstance(msg := s.receive((await ws.receive()).data, 0.0), m.LeaseGrant):
                grants.append(msg)
        assert sorted(g.deadline_s for g in grants) == [
            pytest.approx(n * cfg.staleness.lease_timeout_s, abs=0.2) for n in (1, 2, 3)]
        (pid,) = run.hub.peer_views()

        def lost() -> bool:
            views = run.hub.peer_views()
            return not views[pid].open_leases and run.hub.statistics().leases_expired >= 3

        await asyncio.wait_for(run.hub.until(lost), 10)
