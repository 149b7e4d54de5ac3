"""Free riders (issue 42, item 1): a peer that takes a share of a version and never passes it on.

An idle connection (hello and heartbeats, no chunk server, or one that answers 503 to
everything) and a leaf written from the protocol docs (no chunk server, no links; it fetches
every version from the hub's chunk route) were each dealt seed chunks the honest peer then
waited `relay_stall_s` for: on main an idle peer cut this hub from 262.5 to 33.2 steps/min.
The hub now deals a share only to a peer whose chunk server it reached and that it has seen
fetch what it was dealt (a newcomer on a probation share), deals a silent one's share again
within a grace of about a second, and waits for no idle peer in its propagation records.

Each attacker runs in a process of its own (it measures a rate: steps/min of the same hub
before, with and after it, back to back). The rate is printed in the row, never asserted; the
assertions are on what the hub dealt, from its run log.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import yes
from .harness import (HONEST, Rates, attacker_process, hub_alive, hub_and_honest_peer, peer_id,
                      run_events, small_cfg, steps_per_min)

pytestmark = pytest.mark.system

STEPS = 30  # learner steps per phase: three anchors (full versions) at anchor_every 10
PROBATION = 1  # echo2p2p.seed_watch.WatchPolicy.probation_chunks


async def measured(tmp_path, kind: str, name: str, **params: Any
                   ) -> tuple[Rates, dict[str, Any], str, str, list[dict], list[dict], bool]:
    """The honest hub's steps/min without, with and after attacker `kind` (its peer called
    `name`); its last counts, its peer id, the honest peer's, the propagation records of the
    versions published while it was there, the seed watch's records, and whether the hub
    still answered."""
    cfg = small_cfg(tmp_path, max_lag=2)
    async with hub_and_honest_peer(cfg) as (run, _):
        honest = peer_id(run, HONEST)
        without = await steps_per_min(run, STEPS)
        async with attacker_process(kind, run.url, **params) as attacker:
            await attacker.wait_report(lambda r: r.get("welcomed", 0) >= 1)
            them = peer_id(run, name)
            first = run.hub.statistics().newest_version + 1
            with_ = await steps_per_min(run, STEPS)
            last = run.hub.statistics().newest_version
        after = await steps_per_min(run, STEPS)
        alive = await hub_alive(run)
    records = [p for p in run_events(run, "propagation") if first <= p["version"] <= last]
    assert records, "no version was published while the attacker was there"
    return (Rates(without, with_, after), attacker.report, them, honest, records,
            run_events(run, "seeder_silent"), alive)


def anchors(records: list[dict], them: str, honest: str) -> list[dict]:
    """Records of versions both peers fetched in full (an anchor, or the honest peer behind):
    the manifests an attacker's share would hold the honest peer back on."""
    return [p for p in records
            if p["peers_on_delta"] == 0 and them in p["chunks_dealt"] and honest in p["chunks_dealt"]]


@pytest.mark.parametrize("serve", [False, True], ids=["no-server", "server-503"])
async def test_an_idle_peer_holds_no_share_the_honest_peer_waits_on(tmp_path, row, serve):
    """An idle connection is dealt no seed chunk: without a chunk server none at all; with one
    that answers 503 and never fetches, a probation share (at most one chunk) until the hub
    saw it fetch nothing of one within its grace, then none while benched. It is not waited
    for in the propagation records."""
    r = row("42-1a. idle peer: hello + heartbeats" + (", chunk server answering 503" if serve
                                                      else ", no chunk server"))
    rates, report, them, honest, records, silent, alive = await measured(
        tmp_path, "idle", "idle-0", serve=serve)
    r.steps_per_min, r.hub_alive = rates.cell(), yes(alive)
    r.honest_training = f"yes: {STEPS} steps with it ({rates.with_:.0f}/min)"
    dealt = [p["chunks_dealt"].get(them, 0) for p in records]
    theirs = [s for s in silent if s["peer"] == them]
    shared = anchors(records, them, honest)
    r.reaction = (f"dealt {sum(dealt)} seed chunks over {len(records)} versions "
                  f"({len(shared)} fetched in full by both: at most "
                  f"{max((p['chunks_dealt'][them] for p in shared), default=0)} each); "
                  + (f"silent {len(theirs)}x (v{theirs[0]['version']}, {theirs[0]['quiet_s']:.1f} s "
                     f"quiet: re-dealt, benched {theirs[0]['bench_s']:.0f} s); " if theirs else "")
                  + f"not waited for in {sum(p.get('peers_idle', 0) for p in records)} records")
    r.note = f"lost {rates.loss:.0%} (printed, not asserted); attacker {report}"
    assert alive
    assert all(p.get("peers_idle") == 1 and p["peers"] == 1 for p in records), records
    assert all(p["chunks_dealt"][them] <= PROBATION for p in shared), shared
    if not serve:
        assert sum(dealt) == 0, dealt  # a peer without a chunk server is never dealt a share
        return
    assert theirs, "the hub never found the silent seeder"  # then none while benched:
    assert all(p["chunks_dealt"].get(them, 0) == 0 for p in records
               if p["version"] > theirs[0]["version"]), records


async def test_a_leaf_without_chunk_server_or_links_is_dealt_no_share(tmp_path, row):
    """A peer written from the protocol docs without the optional parts (no chunk server, no
    gossip links) fetches every version from the hub's chunk route: it is never dealt a seed,
    so nothing it holds is anything the honest peer waits for."""
    r = row("42-1b. leaf peer: no chunk server, no links, every chunk from the hub")
    rates, report, them, honest, records, silent, alive = await measured(tmp_path, "leaf", "leaf")
    r.steps_per_min, r.hub_alive = rates.cell(), yes(alive)
    r.honest_training = f"yes: {STEPS} steps with it ({rates.with_:.0f}/min)"
    dealt = [p["chunks_dealt"].get(them, 0) for p in records]
    fetched = sum(them in p["done_by_peer_s"] for p in records)
    r.reaction = (f"dealt {sum(dealt)} seed chunks over {len(records)} versions; it fetched "
                  f"{report.get('versions', 0)} versions ({report.get('chunks', 0)} chunks) from "
                  f"the hub, {fetched} of them counted in the propagation records")
    r.note = f"lost {rates.loss:.0%} (printed, not asserted); attacker {report}"
    assert alive
    assert report.get("versions", 0) >= 2, report  # a working leaf: it downloads
    assert sum(dealt) == 0, dealt
    assert not [s for s in silent if s["peer"] == them]  # nothing dealt, nothing to be silent on
