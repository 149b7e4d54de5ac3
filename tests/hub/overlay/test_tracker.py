"""The hub's version tracker, driven synchronously: who is announced what, catch-up, re-dealing
around a relay that goes, and the propagation record once a version has spread.

Peers here are real `PeerConn`s with real protocols that said hello and were welcomed; they have
no socket (the tracker never touches one), and what the tracker sends them is read back from
their outboxes with the peer side's decoder.
"""

from __future__ import annotations

import asyncio
import random
import struct

from echo2p2p import messages as m
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.serving.peers import PeerConn
from echo2p2p.pool import Pool
from echo2p2p.hub.overlay.tracker import VersionTracker
from echo2p2p.hub_protocol import HubProtocol
from echo2p2p.overlay.store import GONE

from tests.blob_versions import blob_version

KEY = bytes(range(32))
BLOB = b"\1" * (1 << 18)


class Rig:
    def __init__(self, **cfg):
        self.cfg = HubConfig.from_flat(**{"relay": "pipelined", **cfg})  # the tracker unless told
        self.peers: dict[str, PeerConn] = {}
        self.pool = Pool("all", 0.0)
        self.records: list[dict] = []
        self.quarantined: set[str] = set()
        self.clock = 100.0
        self.tracker = VersionTracker(self.cfg.overlay, self.peers, self.pool,
                                      quarantined=lambda c: c.peer_id in self.quarantined,
                                      on_event=self.records.append, now=lambda: self.clock)

    def join(self, peer_id: str, relay: bool = True) -> PeerConn:
        proto = HubProtocol(self.clock, 1 << 20)
        hello = m.Hello(peer_id, "transformers", "cpu",
                        listen_addr=f"http://127.0.0.1:{9000 + len(self.peers)}")
        proto.receive_frame(m.encode(hello), self.clock)
        conn = PeerConn(peer_id, hello, None, proto, None)  # type: ignore[arg-type]
        conn.post(m.Welcome(peer_id, "run", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7))
        conn.relay = "ok" if relay else "failed"
        self.peers[peer_id] = conn
        self.pool.join(peer_id, peer_id, 0.0, True, self.clock)
        self.pool.replan(None, self.clock)
        return conn


def sent(conn: PeerConn) -> list[m.Message]:
    out = []
    while not conn.outbox.empty():
        out.append(m.decode(conn.outbox.get_nowait()))
        conn.outbox.task_done()
    return out


def test_publish_announces_in_full_then_as_a_delta_to_peers_on_its_base():
    rig = Rig()
    a, b = rig.join("a"), rig.join("b")
    sent(a), sent(b)
    rig.tracker.publish(blob_version(KEY, 0, BLOB))
    (ann,) = sent(a)
    assert isinstance(ann, m.VersionAnnouncement) and ann.manifest.base_version is None
    assert sent(b)[0].plan == ann.plan and a.announced == b.announced == 0
    rig.tracker.transfer_reported(a, m.TransferReport(0, None, 1.0, 0, 0, []))
    assert a.stream_version == 0 and b.stream_version is None
    rig.tracker.publish(blob_version(KEY, 1, BLOB, base=(0, BLOB)))
    (to_a,), (to_b,) = sent(a), sent(b)
    assert (to_a.manifest.base_version, to_b.manifest.base_version) == (0, None)
    assert rig.tracker.newest_version == 1


def test_a_late_joiner_catches_up_once_on_the_newest_in_full():
    rig = Rig()
    rig.tracker.publish(blob_version(KEY, 0, BLOB))
    late = rig.join("late")
    sent(late)
    rig.tracker.catch_up(late)
    rig.tracker.catch_up(late)  # already announced: nothing more
    (ann,) = sent(late)
    assert ann.manifest.version == 0 and late.announced == 0


def test_a_relay_that_leaves_is_dealt_around_and_the_others_are_told():
    rig = Rig()
    conns = [rig.join(p) for p in "abc"]
    for c in conns:
        sent(c)
    rig.tracker.publish(blob_version(KEY, 0, b"\2" * (4 << 20), chunk_bytes=1 << 18))
    for c in conns:
        sent(c)
    del rig.peers["a"]
    rig.tracker.peer_left("a")
    for c in conns[1:]:
        (plan,) = sent(c)
        assert isinstance(plan, m.RelayPlan)
        assert "a" not in {s.peer_id for s in plan.sources}


def seeds_of(plan: m.RelayPlan) -> list[int]:
    seed = plan.gossip.seed
    return list(struct.unpack(f"<{len(seed) // 4}I", seed))


def test_gossip_deals_each_chunk_to_one_seeder_and_a_leaving_seeders_to_the_others():
    """Gossip: one announcement per peer, no per-chunk owners; every chunk has exactly one
    seeder, and when one leaves mid-version its seeds go, once each, to the seeders still here
    (and to no quarantined peer); once the version has spread, nothing more is sent."""
    rig = Rig(relay="gossip")
    conns = [rig.join(p) for p in "abcd"]
    for c in conns:
        sent(c)
    rig.tracker.publish(blob_version(KEY, 0, b"\2" * (4 << 20), chunk_bytes=1 << 18))
    first = {}
    for c in conns:
        (ann,) = sent(c)
        assert ann.plan.owners == b"" and ann.plan.sources == []
        first[c.peer_id] = seeds_of(ann.plan)
    n = len(rig.tracker.newest.full.chunks)
    assert sorted(i for s in first.values() for i in s) == list(range(n))
    rig.quarantined.add("d")
    del rig.peers["a"]
    rig.tracker.peer_left("a")
    added = {c.peer_id: [seeds_of(p) for p in sent(c)] for c in conns[1:]}
    assert added["d"] == []
    revisions = [p for c in ("b", "c") for p in added[c]]
    assert sorted(i for s in revisions for i in s) == sorted(first["a"])
    for c in conns[1:3]:
        rig.tracker.transfer_reported(c, m.TransferReport(0, None, 1.0, 0, 0, []))
        rig.tracker.holding_reported(c, 0)
    rig.tracker.transfer_reported(conns[3], m.TransferReport(0, None, 1.0, 0, 0, []))
    rig.tracker.holding_reported(conns[3], 0)
    del rig.peers["b"]
    rig.tracker.peer_left("b")  # v0 has spread: its seeds are nobody's concern
    assert sent(conns[2]) == []


def test_a_quarantined_peer_only_pulls():
    rig = Rig()
    rig.join("a")
    rig.quarantined.add("a")
    assert rig.tracker.member(rig.peers["a"]).url is None


def test_propagation_is_reported_once_every_peer_still_here_has_it():
    rig = Rig()
    a, b = rig.join("a"), rig.join("b")
    rig.tracker.publish(blob_version(KEY, 0, BLOB))
    rig.clock += 2.0
    rig.tracker.holding_reported(a, 0)  # no transfer reported yet: not believed
    rig.tracker.transfer_reported(a, m.TransferReport(0, None, 2.0, 0, 0, []))
    rig.clock += 0.5
    rig.tracker.holding_reported(a, 0)  # its engine reloaded
    assert not rig.records and 0 in rig.tracker.propagation
    del rig.peers["b"]
    rig.tracker.peer_left("b")  # the one still waited for left: the version has spread
    (record,) = rig.records
    assert record["event"] == "propagation" and record["complete"] and record["done_s"] == 2.0
    assert record["serving"]["t50_s"] == 2.5  # a serves it; 90 % of the two never did:
    assert record["t_bcast_s"] is None
    assert 0 not in rig.tracker.propagation


def test_propagation_waits_for_the_reloads_and_times_them():
    """Transfers done is not spread: the record waits until every peer serves the version (or
    a newer one), and T_bcast is the 90 % point of serving, reloads included."""
    rig = Rig()
    a, b = rig.join("a"), rig.join("b")
    rig.tracker.publish(blob_version(KEY, 0, BLOB))
    rig.clock += 1.0
    for peer in (a, b):
        rig.tracker.transfer_reported(peer, m.TransferReport(0, None, 1.0, 0, 0, []))
    rig.clock += 3.0
    rig.tracker.holding_reported(a, 0)
    assert not rig.records
    rig.clock += 1.0
    rig.tracker.holding_reported(b, 0)
    (record,) = rig.records
    assert record["done_s"] == 1.0 and record["serving"]["t50_s"] == 4.0
    assert record["t_bcast_s"] == 5.0


def test_the_hub_serves_the_chunks_of_the_versions_it_keeps():
    """Its chunks while a version is kept, GONE once newer ones have pushed it out."""
    rig = Rig(keep_versions=2)
    rig.tracker.publish(blob_version(KEY, 0, BLOB))
    first = asyncio.run(rig.tracker.chunk_lookup(0, None, 0, 0.0))
    assert first == rig.tracker.snapshot(0, None).chunks[0]
    assert asyncio.run(rig.tracker.chunk_lookup(0, None, 99, 0.0)) is GONE
    for version in (1, 2):
        rig.tracker.publish(blob_version(KEY, version, BLOB))
    assert rig.tracker.snapshot(0, None) is None and sorted(rig.tracker.published) == [1, 2]
    assert asyncio.run(rig.tracker.chunk_lookup(0, None, 0, 0.0)) is GONE


def test_each_broadcast_is_predicted_from_the_measured_hub_and_peer_rates():
    """No prediction until the hub's send rate and some peer's upload are measured; then the
    capacity model's T_bcast over them, a peer not measured yet counting as their mean."""
    rig = Rig()
    a, b = rig.join("a"), rig.join("b")
    rig.tracker.publish(blob_version(KEY, 0, BLOB))
    rig.clock += 2.0
    rig.tracker.chunk_served(0, len(BLOB))  # the hub sent a whole copy in 2 s
    for peer in (a, b):
        rig.tracker.transfer_reported(peer, m.TransferReport(0, None, 2.0, 0, 0, []))
        rig.tracker.holding_reported(peer, 0)
    (spread,) = rig.records
    assert spread["predicted_bcast_s"] is None  # nothing was measured at its publication
    assert rig.tracker.hub_send_bps == 8 * len(BLOB) / 2.0
    rig.tracker.publish(blob_version(KEY, 1, BLOB))
    assert rig.tracker.propagation[1].predicted_bcast_s is None  # no peer's upload known
    a.upload_bps = 1e5
    v2 = blob_version(KEY, 2, random.Random(0).randbytes(len(BLOB)))  # incompressible
    rig.tracker.publish(v2)
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
        rig.tracker.publish(blob_version(KEY, 0, b"\2" * (4 << 20), chunk_bytes=1 << 18))
        caplog.clear()
        with caplog.at_level("DEBUG", logger="echo2p2p.hub.serving.server"):
            rig.tracker.route_around("a")
        assert caplog.messages.count("routed v0 around a") == 1, (relay, caplog.messages)
