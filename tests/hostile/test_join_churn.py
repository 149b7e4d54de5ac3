"""Join churn from many networks (issue 42, item 4): 32 addresses, each in a /24 of its own
(127.N.0.1), with 16 peer keys between them, say hello and leave as fast as the hub lets them,
from a process of their own: 1,697 joins a minute were accepted, none refused, and 935 catch-up
deltas announced (43.3 -> 23.4 steps/min). The hub's join budget is shared fairly among
networks (`echo2p2p.join_limits`): the churn gets the hub's rate between them and no more, the
rest is answered HTTP 429 before the websocket upgrade, and an honest peer from a quiet network
still gets in at once.
"""

from __future__ import annotations

import asyncio
import time

from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig

from .conftest import yes
from .harness import (Rates, attacker_process, hub_alive, hub_and_honest_peer, mark, small_cfg,
                      steps_per_min, still_training)

NETWORKS, KEYS = 32, 16
MEASURED_STEPS = 30


async def test_join_churn_from_many_networks_is_held_to_the_hubs_join_budget(tmp_path, row):
    """Joins welcomed stay within the hub's budget (its burst plus its rate for the time the
    churn ran); the rest are refused 429 before the upgrade; a peer joining from a quiet network
    meanwhile is welcomed; the honest peer trains on."""
    r = row(f"42-4. join churn: {NETWORKS} networks x {KEYS} keys")
    cfg = small_cfg(tmp_path)
    async with hub_and_honest_peer(cfg) as (run, honest):
        hub = run.hub
        without = await steps_per_min(run, MEASURED_STEPS)
        since = mark(run, honest)
        start = time.monotonic()
        async with attacker_process("churn", run.url, sources=NETWORKS, keys=KEYS) as churn:
            await churn.wait_report(lambda c: c.get("refused_http_429", 0) >= 1)
            with_ = await steps_per_min(run, MEASURED_STEPS)
            late = PeerClient(PeerConfig(hub_url=run.url, engine="relay", listen="", name="late"))
            stop = asyncio.Event()
            async with asyncio.TaskGroup() as tg:  # a new peer from 127.0.0.1, a quiet network
                tg.create_task(late.run(stop))
                await asyncio.wait_for(late.wait_welcomed(), 60)
                stop.set()
        elapsed_s = time.monotonic() - start
        report = churn.report
        after = await steps_per_min(run, MEASURED_STEPS)
        r.honest_training = await still_training(run, honest, since)
        r.hub_alive = yes(alive := await hub_alive(run))
        stats = hub.statistics()
    limits = cfg.limits
    budget = limits.join_burst_total + limits.joins_per_min_total * elapsed_s / 60
    r.steps_per_min = Rates(without, with_, after).cell()
    r.reaction = (f"{report.get('hellos', 0)} attempts in {elapsed_s:.0f} s: "
                  f"{report.get('welcomed', 0)} welcomed, {report.get('refused_http_429', 0)} "
                  f"answered 429 before the upgrade, {report.get('refused_4005', 0)} refused 4005 "
                  f"at hello; the late peer from a quiet network got in")
    r.note = (f"hub budget {limits.join_burst_total} at once + {limits.joins_per_min_total:g}/min "
              f"shared by networks; catch-up builds {stats.catch_up_builds}")
    assert alive
    assert report.get("welcomed", 0) <= budget, (report, budget)
    assert report.get("refused_http_429", 0) >= NETWORKS  # past its burst, every network heard 429
