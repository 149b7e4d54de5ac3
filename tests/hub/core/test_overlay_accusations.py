"""The hub believes no relay report without its own evidence, as the core decides it: a report
is counted, then checked (`CheckRelay`, `CheckGossip`) only where the accuser was told to fetch
that chunk from the accused, once per accuser and manifest; the verdict the shell brings back
(`relay_checked`, `gossip_checked`) convicts, clears or takes a relay out of relaying, and a
false "corrupt" costs the accuser. Every advertised chunk server is probed first (`ProbeRelay`).
Real sockets: tests/hub/overlay/test_relay_evidence.py.
"""

from __future__ import annotations

import os
import random

from echo2p2p import messages as m
from echo2p2p.hub.core.accusations import Accusations
from echo2p2p.hub.core.actions import Record, Send
from echo2p2p.hub.core.overlay_actions import CheckGossip, CheckRelay, ProbeRelay
from echo2p2p.hub.serving.counters import Counters
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S
from echo2p2p.relay import owners_of

from tests.blob_versions import blob_version
from tests.hub.overlay.core_rig import Rig, plans, records, to

KEY = bytes(range(32))
CHUNK = 16 << 10


class Judged(Rig):
    """The tracker's rig with the relay judges over it; trust events are kept in `distrusted`."""

    def __init__(self, tickets: bool = True, **cfg):
        super().__init__(**cfg)
        self.counters = Counters()
        self.distrusted: list[tuple[str, str]] = []
        self.judges = Accusations(
            self.cfg.overlay.relay, self.peers, self.tracker, self.outbox, self.counters,
            distrust=lambda peer, event: self.distrusted.append((peer.peer_id, event)),
            tickets=tickets, min_rate_bytes_s=MIN_RATE_BYTES_S, rng=random.Random(0))

    def publish(self, v: int) -> list:
        self.tracker.publish(blob_version(KEY, v, os.urandom(16 * CHUNK), chunk_bytes=CHUNK),
                             self.clock)
        return self.drain()

    def owned(self, peer_id: str, v: int = 1) -> int:
        broadcast = self.tracker.broadcasts[(v, None)]
        return next(i for i in range(broadcast.n_chunks) if broadcast.owner(i) == peer_id)


def checks(actions, kind=CheckRelay) -> list:
    return [a for a in actions if isinstance(a, kind)]


def owners(plan: m.RelayPlan) -> set[str]:
    return {plan.sources[o].peer_id for o in owners_of(plan) if o != m.HUB_OWNER}


def test_accusations_about_chunks_the_accused_was_not_dealt_are_not_checked():
    """An accuser that was not told to fetch the chunk from the accused (another chunk, a
    manifest it was not sent, a version long gone) gets no check: the hub never asks, so the
    accused is never judged on it. Each report is counted; nonsense is not."""
    rig = Judged()
    target, _, accuser = rig.join("a"), rig.join("b"), rig.join("raw", relay=False)
    rig.publish(1)
    index = rig.owned("a")
    other = next(i for i in range(16) if rig.tracker.broadcasts[(1, None)].owner(i) != "a")
    for report in (m.RelayReport(1, "a", "stall", other, None),
                   m.RelayReport(1, "a", "stall", index, 0),
                   m.RelayReport(7, "a", "stall", index, None),
                   m.RelayReport(1, "gone", "stall", index, None),  # nobody: not counted
                   m.RelayReport(1, "raw", "stall", index, None),  # itself: not counted
                   m.RelayReport(1, "a", "bored", index, None)):  # no such fault: not counted
        rig.judges.heard(accuser, report)
    assert rig.drain() == []
    assert sum(rig.counters.relay_reports.values()) == 3
    assert target.relay == "ok" and rig.judges.pending == 0


def test_a_false_corrupt_accusation_costs_the_accuser_not_the_accused():
    """Three accusers say an honest relay served a corrupt chunk: the hub asks the relay for
    that chunk itself (one check each), finds it intact, and each accuser (not the relay)
    takes a false_report; the relay keeps relaying."""
    rig = Judged()
    target = rig.join("a")
    rig.join("b")
    accusers = [rig.join(f"liar-{i}", relay=False) for i in range(3)]
    rig.publish(1)
    index = rig.owned("a")
    for accuser in accusers:
        rig.judges.heard(accuser, m.RelayReport(1, "a", "corrupt", index, None))
    asked = checks(rig.drain())
    assert [(c.accused_id, c.server_url, c.index) for c in asked] == [
        ("a", target.server_url, index)] * 3
    for check in asked:
        rig.judges.relay_checked(check.check_id, "intact", 0.01, rig.clock)
    actions = rig.drain()
    assert [type(a) for a in actions] == [Record] * 3
    assert {r["verdict"] for r in records(actions)} == {"intact"}
    assert rig.distrusted == [(a.peer_id, "false_report") for a in accusers]
    assert target.relay == "ok" and not rig.judges.bad


def test_one_accuser_is_heard_once_per_manifest():
    """The same accusation repeated on one connection is counted each time and checked once:
    a peer cannot make the hub fetch a chunk over and over."""
    rig = Judged()
    rig.join("a")
    accuser = rig.join("raw", relay=False)
    rig.publish(1)
    index = rig.owned("a")
    for _ in range(20):
        rig.judges.heard(accuser, m.RelayReport(1, "a", "corrupt", index, None))
    assert rig.counters.relay_reports[("a", "corrupt")] == 20
    (check,) = checks(rig.drain())
    rig.judges.relay_checked(check.check_id, "intact", 0.01, rig.clock)
    rig.judges.relay_checked(check.check_id, "intact", 0.01, rig.clock)  # heard once
    assert len(records(rig.drain())) == 1 and rig.distrusted == [("raw", "false_report")]


def test_a_relay_address_that_never_answers_is_never_dealt_chunks():
    """Each advertised chunk server is probed at the join; one that never answers is judged
    "failed" and owns no chunk of any version; one that answers relays, with the uplink the
    hub timed as its first estimate. A peer with no server is not probed."""
    rig = Judged()
    dead, live = rig.join("dead", relay=False), rig.join("live", relay=False)
    dead.relay = live.relay = "unprobed"
    nat = rig.join("nat", listen_addr=None)
    for peer in (dead, live, nat):
        rig.judges.probe(peer, 0)
    probes = rig.drain()
    assert probes == [ProbeRelay("dead", dead.server_url, 0),
                      ProbeRelay("live", live.server_url, 0)]
    rig.judges.probed("dead", False, None)
    rig.judges.probed("live", True, 8e6)
    assert (dead.relay, live.relay, live.upload_bps) == ("failed", "ok", 8e6)
    for v in (1, 2):
        for plan in plans(to(rig.publish(v), "live")):
            assert "dead" not in {s.peer_id for s in plan.sources} and owners(plan) == {"live"}


def test_a_relay_that_fails_the_hubs_check_stays_out_of_later_versions():
    """A relay the hub itself finds stalled on a contested chunk is routed around at once (a
    new plan to every member) and owns no chunk of any later version; no trust event: a stall
    proves no lie."""
    rig = Judged()
    for p in "abc":
        rig.join(p)
    accuser = rig.join("raw", relay=False)
    rig.publish(1)
    rig.judges.heard(accuser, m.RelayReport(1, "a", "stall", rig.owned("a"), None))
    (check,) = checks(rig.drain())
    rig.judges.relay_checked(check.check_id, "pending", 10.0, rig.clock)  # it never had it
    actions = rig.drain()
    assert isinstance(actions[0], Record) and actions[0].record["verdict"] == "stall"
    assert {a.peer_id for a in actions if isinstance(a, Send)} == {"a", "b", "c", "raw"}
    assert all("a" not in owners(plan) for a in "bc" for plan in plans(to(actions, a)))
    assert rig.peers["a"].relay == "failed" and "a" in rig.judges.bad and rig.distrusted == []
    (plan,) = plans(to(rig.publish(2), "b"))
    assert owners(plan) and "a" not in owners(plan)
    rig.judges.probe(rig.peers["a"], 2)  # its identity failed a check: never probed again
    assert checks(rig.drain(), ProbeRelay) == []


def test_a_corrupt_chunk_convicts_the_relay_once():
    rig = Judged()
    rig.join("a"), rig.join("b")
    accusers = [rig.join(f"r{i}", relay=False) for i in range(2)]
    rig.publish(1)
    index = rig.owned("a")
    for accuser in accusers:
        rig.judges.heard(accuser, m.RelayReport(1, "a", "corrupt", index, None))
    for check in checks(rig.drain()):
        rig.judges.relay_checked(check.check_id, "corrupt", 0.01, rig.clock)
    assert rig.distrusted == [("a", "bad_chunk")]  # one chunk, one conviction
    assert rig.peers["a"].relay == "failed"


def test_a_slow_relay_is_timed_on_its_newest_share_and_stops_relaying():
    """Accused of "slow", the hub asks for a chunk of the relay's share in the newest manifest,
    and one far past the receivers' own rule makes it relay nothing more on this connection
    (no trust event: slowness is not malice), its estimate what the hub measured."""
    rig = Judged()
    rig.join("a"), rig.join("b")
    accuser = rig.join("raw", relay=False)
    rig.publish(1)
    rig.judges.heard(accuser, m.RelayReport(1, "a", "slow", rig.owned("a"), None))
    (check,) = checks(rig.drain())
    broadcast = rig.tracker.broadcasts[(1, None)]
    assert broadcast.owner(check.index) == "a"
    rig.judges.relay_checked(check.check_id, "intact", 60.0, rig.clock)
    (record,) = records(rig.drain())
    assert record["verdict"] == "slow" and rig.peers["a"].relay == "slow"
    assert 0 < rig.peers["a"].upload_bps < 8 * CHUNK and rig.distrusted == []


def test_gossip_checks_dial_the_accused_and_judge_the_piece():
    """Gossip: a report about a peer with a chunk server is checked over a link (`CheckGossip`),
    once per (accuser, accused, manifest) and once per chunk; a corrupt piece is bad_chunk and
    reseeds around it, a stall takes it out of relaying with no trust event, an intact piece
    costs nobody anything."""
    rig = Judged(relay="gossip")
    for p in "abc":
        rig.join(p)
    accusers = [rig.join(f"r{i}", relay=False) for i in range(3)]
    rig.publish(1)
    rig.judges.heard(accusers[0], m.RelayReport(1, "a", "corrupt", 0, None))
    rig.judges.heard(accusers[0], m.RelayReport(1, "a", "corrupt", 1, None))  # heard already
    rig.judges.heard(accusers[1], m.RelayReport(1, "a", "corrupt", 0, None))  # chunk checked
    rig.judges.heard(accusers[1], m.RelayReport(1, "b", "stall", 2, None))
    rig.judges.heard(accusers[2], m.RelayReport(1, "c", "corrupt", 99, None))  # no such chunk
    corrupt, stall = checks(rig.drain(), CheckGossip)
    assert (corrupt.accused_id, corrupt.index, stall.accused_id, stall.index) == ("a", 0, "b", 2)
    rig.judges.gossip_checked(corrupt.check_id, "corrupt", rig.clock)
    rig.judges.gossip_checked(stall.check_id, "stall", rig.clock)
    actions = rig.drain()
    assert [r["verdict"] for r in records(actions)] == ["corrupt", "stall"]
    assert rig.distrusted == [("a", "bad_chunk")]
    assert rig.peers["a"].relay == rig.peers["b"].relay == "failed"
    assert any(isinstance(a, Send) and isinstance(a.message, m.RelayPlan) for a in actions)
    untrusting = Judged(relay="gossip", tickets=False)  # no tickets to dial with: no check
    untrusting.join("a")
    raw = untrusting.join("raw", relay=False)
    untrusting.publish(1)
    untrusting.judges.heard(raw, m.RelayReport(1, "a", "corrupt", 0, None))
    assert checks(untrusting.drain(), CheckGossip) == []
