"""Control-frame floods (issue 42, item 3): one connection, in a process of its own, sends one
kind of frame as fast as its socket takes them: `version_held` (5,553 a second took training
from 71.9 to 26.2 steps/min, then 0, and was never closed), `relay_report` accusing the honest
peer (3,361 a second: 61.9 -> 7.5 steps/min and 80,127 log lines in 40 s), heartbeats, transfer
reports and lease requests. Each kind has a rate (`echo2p2p.frame_budget`): past it the frames
are dropped and counted, and a connection that keeps at it is closed with 4006 and the kind,
and costs its identity trust.
"""

from __future__ import annotations

import aiohttp
import pytest

from echo2p2p.frame_budget import HUB_RATES

from .conftest import yes
from .harness import (HONEST, Rates, attacker_process, hub_alive, hub_and_honest_peer, mark,
                      peer_id, small_cfg, steps_per_min, still_training)

MEASURED_STEPS = 30  # learner steps timed before, during and after the flood


@pytest.mark.parametrize("kind", sorted(HUB_RATES))
async def test_a_flood_of_one_frame_kind_is_dropped_then_closed(tmp_path, row, kind):
    """The flood's frames past the kind's rate are dropped and counted, its connection is
    closed with 4006 'too many <kind> frames' and a `flood` trust event, and the honest peer
    trains on."""
    r = row(f"42-3a. {kind} flood from one connection")
    async with hub_and_honest_peer(small_cfg(tmp_path)) as (run, honest):
        hub = run.hub
        honest_identity = hub.peer_views()[peer_id(run, HONEST)].identity
        without = await steps_per_min(run, MEASURED_STEPS)
        since = mark(run, honest)
        async with attacker_process("flood", run.url, frame=kind,
                                    accuse=peer_id(run, HONEST)) as flood:
            await flood.wait_report(lambda c: c.get("welcomed") == 1)
            with_ = await steps_per_min(run, MEASURED_STEPS)
            await flood.wait_report(lambda c: c.get("closed_4006", 0) >= 1)
        report = flood.report  # its last counts, as it stopped
        after = await steps_per_min(run, MEASURED_STEPS)
        r.honest_training = await still_training(run, honest, since)
        stats = hub.statistics()
        r.hub_alive = yes(alive := await hub_alive(run))
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{run.port}/status") as resp:
            shown = (await resp.json())["frames_dropped"]
    rates = Rates(without, with_, after)
    r.steps_per_min = rates.cell()
    flooders = [who for who, events in stats.trust_events.items() if events.get("flood")]
    r.reaction = (f"{report.get('sent', 0)} frames sent over {report.get('welcomed')} "
                  f"connections, each closed 4006 'too many {kind} frames'; hub dropped "
                  f"{stats.frames_dropped.get(kind, 0)}, closed_for_flooding "
                  f"{stats.closed_for_flooding}, flood trust events for {flooders}")
    r.note = f"rate {HUB_RATES[kind].per_s:g}/s, burst {HUB_RATES[kind].burst:g}"
    assert alive
    assert report.get("closed_4006", 0) >= 1, report  # the goodbye's code, through its flood
    assert stats.closed_for_flooding == report["welcomed"]  # every connection of it
    assert stats.frames_dropped.get(kind, 0) >= 1 and shown == stats.frames_dropped
    assert flooders and honest_identity not in flooders
