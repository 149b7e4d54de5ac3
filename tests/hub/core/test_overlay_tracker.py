"""The hub's version tracker as the core drives it: events in, actions out, a clock by hand.

Who is announced what (with which relay plan), catch-up, re-dealing around a relay that goes,
and the propagation record once a version has spread: each a sequence of calls on
`hub.core.tracker.VersionTracker` over `Peer`s, asserted on the actions drained from the
outbox (`tests.hub.overlay.core_rig`).
"""

from __future__ import annotations

import random

from echo2p2p import messages as m
from echo2p2p.hub.core.actions import Record, Send
from echo2p2p.hub.core.overlay_actions import WakeAt

from tests.blob_versions import blob_version
from tests.hub.overlay.core_rig import Rig, records, seeds, to

KEY = bytes(range(32))
BLOB = b"\1" * (1 << 18)
BIG = b"\2" * (4 << 20)


def test_publish_announces_in_full_then_as_a_delta_to_peers_on_its_base():
    rig = Rig()
    a, b = rig.join("a"), rig.join("b")
    rig.tracker.publish(blob_version(KEY, 0, BLOB), rig.clock)
    actions = rig.drain()
    # The shares dealt are watched (a tick at the grace's end), then one announcement each.
    assert [type(x) for x in actions] == [WakeAt, Send, Send]
    assert actions[0].when > rig.clock
    (ann,) = to(actions, "a")
    assert isinstance(ann, m.VersionAnnouncement) and ann.manifest.base_version is None
    assert to(actions, "b")[0].plan == ann.plan and a.announced == b.announced == 0
    rig.tracker.transfer_reported(a, m.TransferReport(0, None, 1.0, 0, 0, []), rig.clock)
    assert a.stream_version == 0 and b.stream_version is None
    rig.tracker.publish(blob_version(KEY, 1, BLOB, base=(0, BLOB)), rig.clock)
    actions = rig.drain()
    (to_a,), (to_b,) = to(actions, "a"), to(actions, "b")
    assert (to_a.manifest.base_version, to_b.manifest.base_version) == (0, None)
    assert rig.tracker.newest_version == 1


def test_a_late_joiner_catches_up_once_on_the_newest_in_full():
    rig = Rig()
    rig.tracker.publish(blob_version(KEY, 0, BLOB), rig.clock)
    late = rig.join("late")
    rig.tracker.catch_up(late, rig.clock)
    rig.tracker.catch_up(late, rig.clock)  # already announced: nothing more
    (ann,) = to(rig.drain(), "late")
    assert ann.manifest.version == 0 and late.announced == 0


def test_a_relay_that_leaves_is_dealt_around_and_the_others_are_told():
    rig = Rig()
    for p in "abc":
        rig.join(p)
    rig.tracker.publish(blob_version(KEY, 0, BIG, chunk_bytes=1 << 18), rig.clock)
    rig.drain()
    actions = rig.leave("a")
    assert {x.peer_id for x in actions} == {"b", "c"}  # the members still here, once each
    for p in "bc":
        (plan,) = to(actions, p)
        assert isinstance(plan, m.RelayPlan) and plan.revision == 2
        assert "a" not in {s.peer_id for s in plan.sources}


def test_a_relay_quarantined_or_failed_is_dealt_around_as_one_that_left():
    """`route_around` (a quarantine, a failed check) re-deals as a departure does, and the
    peer itself, still here, is told the new plan too."""
    rig = Rig()
    for p in "abc":
        rig.join(p)
    rig.tracker.publish(blob_version(KEY, 0, BIG, chunk_bytes=1 << 18), rig.clock)
    rig.drain()
    rig.quarantined.add("a")
    rig.tracker.route_around("a", rig.clock)
    actions = rig.drain()
    assert sorted(x.peer_id for x in actions) == ["a", "b", "c"]
    assert all("a" not in {s.peer_id for s in plan.sources}
               for p in "abc" for plan in to(actions, p))
    rig.tracker.route_around("a", rig.clock)  # nothing of it left to deal
    assert rig.drain() == []


def test_gossip_deals_each_chunk_to_one_seeder_and_a_leaving_seeders_to_the_others():
    """Gossip: one announcement per peer, no per-chunk owners; every chunk has exactly one
    seeder, and when one leaves mid-version its seeds go, once each, to the seeders still here
    (and to no quarantined peer); once the version has spread, nothing more is sent."""
    rig = Rig(relay="gossip")
    peers = [rig.join(p) for p in "abcd"]
    rig.tracker.publish(blob_version(KEY, 0, BIG, chunk_bytes=1 << 18), rig.clock)
    actions = rig.drain()
    first = {}
    for p in peers:
        (ann,) = to(actions, p.peer_id)
        assert ann.plan.owners == b"" and ann.plan.sources == []
        first[p.peer_id] = m.unpack_ids(ann.plan.gossip.seed)
    n = len(rig.tracker.newest.full.chunks)
    assert sorted(i for s in first.values() for i in s) == list(range(n))
    rig.quarantined.add("d")
    actions = rig.leave("a")
    assert to(actions, "d") == []
    revisions = seeds(to(actions, "b")) + seeds(to(actions, "c"))
    assert sorted(i for s in revisions for i in s) == sorted(first["a"])
    assert all(p.revision == 2 for x in "bc" for p in to(actions, x))
    for p in peers[1:]:
        rig.tracker.transfer_reported(p, m.TransferReport(0, None, 1.0, 0, 0, []), rig.clock)
        rig.tracker.holding_reported(p, 0, rig.clock)
    assert [r["event"] for r in records(rig.drain())] == ["propagation"]
    assert rig.leave("b") == []  # v0 has spread: its seeds are nobody's concern


def test_a_quarantined_peer_only_pulls():
    rig = Rig()
    rig.join("a")
    rig.quarantined.add("a")
    assert rig.tracker.member(rig.peers["a"], rig.clock).url is None


def test_propagation_is_reported_once_every_peer_still_here_has_it():
    rig = Rig()
    a, b = rig.join("a"), rig.join("b")
    rig.tracker.publish(blob_version(KEY, 0, BLOB), rig.clock)
    rig.clock += 2.0
    rig.tracker.holding_reported(a, 0, rig.clock)  # no transfer reported yet: not believed
    rig.tracker.transfer_reported(a, m.TransferReport(0, None, 2.0, 0, 0, []), rig.clock)
    rig.clock += 0.5
    rig.tracker.holding_reported(a, 0, rig.clock)  # its engine reloaded
    assert records(rig.drain()) == [] and 0 in rig.tracker.propagation
    actions = rig.leave("b")  # the one still waited for left: the version has spread
    assert [type(x) for x in actions] == [Send, Record]  # a's plan without b, then the record
    assert "b" not in {s.peer_id for s in to(actions, "a")[0].sources}
    (record,) = records(actions)
    assert record["event"] == "propagation" and record["complete"] and record["done_s"] == 2.0
    assert record["serving"]["t50_s"] == 2.5  # a serves it; 90 % of the two never did:
    assert record["t_bcast_s"] is None
    assert 0 not in rig.tracker.propagation


def test_propagation_waits_for_the_reloads_and_times_them():
    """Transfers done is not spread: the record waits until every peer serves the version (or
    a newer one), and T_bcast is the 90 % point of serving, reloads included."""
    rig = Rig()
    a, b = rig.join("a"), rig.join("b")
    rig.tracker.publish(blob_version(KEY, 0, BLOB), rig.clock)
    rig.clock += 1.0
    for peer in (a, b):
        rig.tracker.transfer_reported(peer, m.TransferReport(0, None, 1.0, 0, 0, []), rig.clock)
    rig.clock += 3.0
    rig.tracker.holding_reported(a, 0, rig.clock)
    assert records(rig.drain()) == []
    rig.clock += 1.0
    rig.tracker.holding_reported(b, 0, rig.clock)
    (record,) = records(rig.drain())
    assert record["done_s"] == 1.0 and record["serving"]["t50_s"] == 4.0
    assert record["t_bcast_s"] == 5.0


def test_a_superseded_version_reports_how_far_it_got():
    """A version still spreading when a newer one is published is recorded then, incomplete."""
    rig = Rig()
    a = rig.join("a")
    rig.join("b")
    rig.tracker.publish(blob_version(KEY, 0, BLOB), rig.clock)
    rig.tracker.transfer_reported(a, m.TransferReport(0, None, 1.0, 0, 0, []), rig.clock)
    rig.drain()
    rig.tracker.publish(blob_version(KEY, 1, BLOB), rig.clock)
    (record,) = records(rig.drain())
    assert record["version"] == 0 and not record["complete"]


def test_the_hub_keeps_the_chunks_of_the_newest_versions_only():
    """Its snapshots while a version is kept, none once newer ones have pushed it out."""
    rig = Rig(keep_versions=2)
    rig.tracker.publish(blob_version(KEY, 0, BLOB), rig.clock)
    assert rig.tracker.snapshot(0, None) is rig.tracker.newest.full
    for version in (1, 2):
        rig.tracker.publish(blob_version(KEY, version, BLOB), rig.clock)
    assert rig.tracker.snapshot(0, None) is None and sorted(rig.tracker.published) == [1, 2]


def test_each_broadcast_is_predicted_from_the_measured_hub_and_peer_rates():
    """No prediction until the hub's send rate and some peer's upload are measured; then the
    capacity model's T_bcast over them, a peer not measured yet counting as their mean."""
    rig = Rig()
    a, b = rig.join("a"), rig.join("b")
    rig.tracker.publish(blob_version(KEY, 0, BLOB), rig.clock)
    rig.clock += 2.0
    rig.tracker.chunk_served(0, len(BLOB), rig.clock)  # the hub sent a whole copy in 2 s
    for peer in (a, b):
        rig.tracker.transfer_reported(peer, m.TransferReport(0, None, 2.0, 0, 0, []), rig.clock)
        rig.tracker.holding_reported(peer, 0, rig.clock)
    (spread,) = records(rig.drain())
    assert spread["predicted_bcast_s"] is None  # nothing was measured at its publication
    assert rig.tracker.hub_send_bps == 8 * len(BLOB) / 2.0
    rig.tracker.publish(blob_version(KEY, 1, BLOB), rig.clock)
    assert rig.tracker.propagation[1].predicted_bcast_s is None  # no peer's upload known
    a.upload_bps = 1e5
    v2 = blob_version(KEY, 2, random.Random(0).randbytes(len(BLOB)))  # incompressible
    rig.tracker.publish(v2, rig.clock)
    # By hand, from the model's definition (pipelined overlay): 1.4 (its measured factor over
    # the bound) x 8 M / min(B_hub, (B_hub + sum of uplinks) / N), b counting as a's 1e5.
    hub_bps = 8 * len(BLOB) / 2.0  # 1,048,576 > (1,048,576 + 2e5) / 2: the uplinks bind
    want = 1.4 * 8 * v2.full.wire_bytes / ((hub_bps + 1e5 + 1e5) / 2)
    assert rig.tracker.propagation[2].predicted_bcast_s == round(want, 3)
    assert 4.5 < want < 5.0  # ~262 kB over ~0.62 Mb/s


def test_routing_a_version_around_a_peer_is_logged(caplog):
    """A version routed around a peer says so at DEBUG ("routed vN around pX"): on the tracker
    when its chunks are dealt to other relays, on gossip when its seeds are."""
    for relay in ("pipelined", "gossip"):
        rig = Rig(relay=relay)
        for p in "abc":
            rig.join(p)
        rig.tracker.publish(blob_version(KEY, 0, BIG, chunk_bytes=1 << 18), rig.clock)
        caplog.clear()
        with caplog.at_level("DEBUG", logger="echo2p2p.hub.serving.server"):
            rig.tracker.route_around("a", rig.clock)
        assert caplog.messages.count("routed v0 around a") == 1, (relay, caplog.messages)
