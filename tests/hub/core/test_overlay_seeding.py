"""The seed watch as the core drives it (issue 42, item 1): the hub deals chunks only to peers it
has seen fetch what they are dealt. A peer that fetches its share from the hub's chunk route,
one that never does, and one with no chunk server; the silent one's share goes to the other at
the tick its grace asked for (`WakeAt`), it is recorded (`seeder_silent`) and dealt nothing
more for a while; the one without a server is never dealt a share. Real sockets:
tests/hub/overlay/test_seeding.py.
"""

from __future__ import annotations

import os

from echo2p2p import messages as m
from echo2p2p.hub.core.actions import Record, Send
from echo2p2p.hub.core.overlay_actions import WakeAt
from echo2p2p.relay import owners_of

from tests.blob_versions import blob_version
from tests.hub.overlay.core_rig import Rig, plans, records, seeds, to

KEY = bytes(range(32))
CHUNK = 16 << 10


def fetch(rig: Rig, peer_id: str, version: int, indices: list[int]) -> None:
    """`peer_id` fetches chunks `indices` of `version` (in full) from the hub's chunk route."""
    for i in indices:
        rig.tracker.seeding.asked(peer_id, (version, None), i, rig.clock)
        rig.tracker.seeding.answered(peer_id, (version, None), i, True, rig.clock)


def wake(actions) -> float:
    """The tick the actions ask for (the earliest)."""
    return min(a.when for a in actions if isinstance(a, WakeAt))


def silences(actions) -> list[dict]:
    return [r for r in records(actions) if r.get("event") == "seeder_silent"]


def test_a_gossip_seeder_that_fetches_nothing_has_its_seeds_dealt_again_and_is_benched():
    """Two newcomers on probation share v1 (nobody proven: dealt as before); one fetches its
    seeds, one never asks: at the tick its grace asked for its seeds go to the other (one plan
    revision, only the added seeds), and v2 deals it none. A peer with no chunk server gets no
    seed in either."""
    rig = Rig(relay="gossip")
    rig.join("good"), rig.join("idle"), rig.join("nat", listen_addr=None)
    rig.tracker.publish(blob_version(KEY, 1, os.urandom(8 * CHUNK), chunk_bytes=CHUNK), rig.clock)
    dealt = rig.drain()
    (mine,), (theirs,) = seeds(to(dealt, "good")), seeds(to(dealt, "idle"))
    assert sorted(mine + theirs) == list(range(8)) and mine and theirs
    assert seeds(to(dealt, "nat")) == [[]]
    fetch(rig, "good", 1, mine)
    when = wake(dealt)
    rig.clock = when - 0.01
    rig.tracker.tick(rig.clock)  # not yet: nothing
    assert rig.drain() == []
    rig.clock = when
    rig.tracker.tick(rig.clock)
    actions = rig.drain()
    assert [type(a) for a in actions] == [Record, Send]  # the record, then good's re-deal
    (added,) = seeds(to(actions, "good"))
    assert sorted(added) == sorted(theirs)  # re-dealt: only the added seeds
    assert plans(to(actions, "good"))[0].revision == 2
    (silence,) = silences(actions)
    assert silence["peer"] == "idle" and silence["chunks"] == len(theirs)
    assert silence["quiet_s"] >= 1.0 and silence["bench_s"] == 60.0  # the floor, by rule
    rig.tracker.publish(blob_version(KEY, 2, os.urandom(8 * CHUNK), chunk_bytes=CHUNK), rig.clock)
    actions = rig.drain()
    assert sorted(seeds(to(actions, "good"))[0]) == list(range(8))
    assert seeds(to(actions, "idle")) == [[]] and seeds(to(actions, "nat")) == [[]]
    fetch(rig, "good", 2, list(range(8)))
    rig.tracker.tick(wake(actions))
    assert silences(rig.drain()) == []  # good fetched all it was dealt: nobody is silent


def test_a_tracker_owner_that_fetches_nothing_is_routed_around_within_its_grace():
    """The tracker (`relay = "pipelined"`): an owner that never fetches the chunks it owns from
    the hub is dropped from v1's plan (a new revision without it) at its grace's tick, not
    after a receiver's stall deadline and an accusation."""
    rig = Rig()
    rig.join("good"), rig.join("idle")
    rig.tracker.publish(blob_version(KEY, 1, os.urandom(8 * CHUNK), chunk_bytes=CHUNK), rig.clock)
    dealt = rig.drain()
    (plan,) = plans(to(dealt, "good"))
    owners = [plan.sources[o].peer_id if o != m.HUB_OWNER else None for o in owners_of(plan)]
    assert "idle" in owners and "good" in owners
    fetch(rig, "good", 1, [i for i, o in enumerate(owners) if o == "good"])
    rig.clock = wake(dealt)
    rig.tracker.tick(rig.clock)
    actions = rig.drain()
    (later,) = plans(to(actions, "good"))
    assert later.revision == 2 and "idle" not in {s.peer_id for s in later.sources}
    (silence,) = silences(actions)
    assert silence["peer"] == "idle" and silence["chunks"] == owners.count("idle")


def test_a_peer_that_reports_its_share_whole_is_not_silent():
    """A share fetched from other peers (reported whole) is as good as one fetched from the hub."""
    rig = Rig()
    good, _ = rig.join("good"), rig.join("other")
    rig.tracker.publish(blob_version(KEY, 1, os.urandom(8 * CHUNK), chunk_bytes=CHUNK), rig.clock)
    dealt = rig.drain()
    for peer in rig.peers.values():
        rig.tracker.transfer_reported(peer, m.TransferReport(1, None, 1.0, 0, 0, []), rig.clock)
    rig.tracker.tick(wake(dealt))
    assert silences(rig.drain()) == [] and good.stream_version == 1
