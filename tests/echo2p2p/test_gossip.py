"""The gossip core: picking order and windows, hub seeding and fallback, hostile links, the
hub's dealing, and the emulated sweep's O(N) control traffic."""

from __future__ import annotations

import random
import struct
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p.gossip import HUB, Swarm, pack_bits, unpack_bits
from echo2p2p.relay import MAX_NEIGHBOURS, Member, deal_seeds, gossip_plan

from bench.emulated_peers import run_chain, run_gossip, run_tracker
from bench.emulation import Setup, gossip_announcement, manifest

FAST = settings(max_examples=60, deadline=None)


def _linked(swarm: Swarm, holdings: dict[str, set[int]]) -> Swarm:
    for peer, held in holdings.items():
        assert swarm.link_up(peer)
        swarm.heard_have(peer, pack_bits(held, swarm.n_chunks))
    return swarm


class Mesh:
    """Swarms joined by in-memory links: a want is answered at once by the real serving side
    (`wanted`/`served`), a piece is `got` and announced with `had` to every link. The hub
    serves each chunk while `hub_up(index)` says so, and a want of it fails otherwise."""

    def __init__(self, n_peers: int, n_chunks: int, degree: int = 3, seed: int = 0):
        members = [Member(f"p{i}", f"http://10.0.0.{i}:1") for i in range(n_peers)]
        deals = gossip_plan(members, n_chunks, degree, random.Random(seed))
        self.swarms = {p: Swarm(n_chunks, p, d.seed) for p, d in deals.items()}
        for p, d in deals.items():
            for nb in d.neighbours:
                self.swarms[p].link_up(nb.peer_id)
                self.swarms[nb.peer_id].link_up(p)
        for p, s in self.swarms.items():
            for other in s.links:
                self.swarms[other].heard_have(p, s.bitfield())
        self.hub_sent: Counter[int] = Counter()
        self.log: list[tuple[float, str, int, str]] = []

    def hub_up(self, index: int) -> bool:
        return True

    def step(self, now: float) -> None:
        for p, swarm in self.swarms.items():
            for i, source in swarm.requests(now):
                self.log.append((now, p, i, source))
                if source == HUB:
                    if not self.hub_up(i):
                        swarm.failed(i, HUB, now)
                        continue
                    self.hub_sent[i] += 1
                else:
                    server = self.swarms[source]
                    assert server.wanted(p, i) is None
                    server.served(p, i)
                swarm.got(i, source, now)
                for other in swarm.links:
                    self.swarms[other].heard_had(p, [i])

    def run(self, until: float) -> float:
        now = 0.0
        while now <= until and not all(s.complete for s in self.swarms.values()):
            self.step(now)
            now += 0.5
        return now


# --- picking -------------------------------------------------------------------------------


def test_rarest_chunk_is_asked_first():
    """Chunk 3 is held by one link, 2 by two, 1 by three, 0 by four: wants go 3, 2, 1, 0."""
    swarm = _linked(Swarm(4, "me", (), window=1),
                    {"a": {0, 1, 2, 3}, "b": {0, 1, 2}, "c": {0, 1}, "d": {0}})
    assert swarm.requests(0.0) == [(3, "a"), (2, "b"), (1, "c"), (0, "d")]


def test_windows_are_respected():
    """At most `window` wants per link and `hub_window` of the hub are out at once."""
    swarm = _linked(Swarm(8, "me", (4, 5, 6, 7), window=2, hub_window=2), {"a": {0, 1, 2, 3}})
    first = swarm.requests(0.0)
    assert Counter(src for _, src in first) == {"a": 2, HUB: 2}
    assert swarm.requests(0.1) == []
    done = next(i for i, src in first if src == "a")
    swarm.got(done, "a", 0.2)
    assert [src for _, src in swarm.requests(0.2)] == ["a"]


def test_hub_is_asked_for_seeds_only_until_fallback():
    """Seeds come from the hub at once; a chunk no link holds only after 1-2 x hub_fallback_s
    of silence."""
    swarm = _linked(Swarm(6, "me", (0, 1), hub_fallback_s=10.0), {"a": {2, 3}})
    assert sorted(swarm.requests(0.0)) == [(0, HUB), (1, HUB), (2, "a"), (3, "a")]
    for i, src in ((0, HUB), (1, HUB), (2, "a"), (3, "a")):
        swarm.got(i, src, 1.0)
    assert swarm.requests(1.0) == []
    due = swarm.wake_at(1.0)
    assert 11.0 <= due < 21.0
    swarm.heard_had("a", [2])  # nothing new for us: no restart
    assert swarm.requests(due - 0.01) == []
    assert sorted(swarm.requests(due)) == [(4, HUB), (5, HUB)]


def test_peers_fall_back_at_different_times():
    """The fallback wait is drawn per peer in [1, 2) x hub_fallback_s, so the peers missing the
    same orphan do not all ask the hub for it at once."""
    waits = []
    for k in range(8):
        swarm = _linked(Swarm(2, f"p{k}", (), hub_fallback_s=10.0), {"a": set()})
        assert swarm.requests(0.0) == []
        waits.append(swarm.wake_at(0.0))
    assert all(10.0 <= w < 20.0 for w in waits) and len(set(waits)) == 8


def test_seeds_dealt_again_are_asked_of_the_hub_at_once():
    """A seeder left before the hub sent it its seeds: the hub deals them to us, and we ask
    for them without waiting for the fallback; out-of-range seeds are refused."""
    swarm = _linked(Swarm(6, "me", (0,)), {"a": set()})
    assert swarm.requests(0.0) == [(0, HUB)]
    with pytest.raises(ValueError):
        swarm.add_seed([6])
    swarm.add_seed([4])
    assert swarm.requests(0.1) == [(4, HUB)]


def test_news_restarts_the_fallback_wait():
    swarm = _linked(Swarm(4, "me", (), hub_fallback_s=10.0), {"a": set()})
    assert swarm.requests(0.0) == []
    first = swarm.wake_at(0.0)
    swarm.heard_had("a", [0])
    assert swarm.requests(8.0) == [(0, "a")]
    assert swarm.requests(first) == [] and swarm.wake_at(first) == 8.0 + first


def test_endgame_asks_a_second_link_and_got_names_the_loser():
    """With the last chunk in flight at one link, another link that holds it is asked too."""
    swarm = _linked(Swarm(1, "me", (), window=1), {"a": {0}})
    assert swarm.requests(0.0) == [(0, "a")]
    _linked(swarm, {"b": {0}})
    assert swarm.requests(0.1) == [(0, "b")]
    assert swarm.got(0, "b", 0.5) == ["a"]
    assert swarm.complete and swarm.wants(0) == frozenset()


def test_a_late_want_gets_a_second_source():
    """A want out for longer than reroute_factor x the quickest piece is also asked elsewhere."""
    swarm = _linked(Swarm(8, "me", (), window=1, endgame_chunks=0, reroute_factor=6.0),
                    {"a": set(range(8))})
    (i, _), = swarm.requests(0.0)
    swarm.got(i, "a", 1.0)  # the quickest piece: 1 s
    (j, _), = swarm.requests(1.0)
    _linked(swarm, {"b": {j}})
    assert swarm.requests(6.9) == [] and swarm.wake_at(6.9) == 7.0
    assert swarm.requests(7.1) == [(j, "b")]


def test_a_slow_link_is_asked_only_for_what_no_other_link_holds():
    """Once a link's pieces take SLOW_LINK_FACTOR x the median link's, it gets no want a
    faster link could answer; a chunk only it holds is still asked of it."""
    held = set(range(30))
    swarm = _linked(Swarm(32, "me", (), window=1, endgame_chunks=0, reroute_factor=1e6),
                    {"a": held, "b": held, "c": held, "s": held | {30, 31}})
    first = dict((src, i) for i, src in swarm.requests(0.0))
    assert first["s"] in (30, 31)
    for src in "abc":
        swarm.got(first[src], src, 0.1)
    swarm.got(first["s"], "s", 2.0)  # 20 x the others
    asked_of_s = []
    for k in range(12):
        now = 2.0 + 0.2 * k
        for i, src in swarm.requests(now):
            asked_of_s += [i] if src == "s" else []
            swarm.got(i, src, now + (2.0 if src == "s" else 0.1))
    assert asked_of_s == [({30, 31} - {first["s"]}).pop()]  # the one chunk only it holds
    assert len(swarm.missing) < 32 - 12


def test_link_down_releases_its_wants():
    swarm = _linked(Swarm(2, "me", ()), {"a": {0, 1}})
    assert sorted(swarm.requests(0.0)) == [(0, "a"), (1, "a")]
    _linked(swarm, {"b": {0, 1}})
    swarm.link_down("a")
    assert swarm.wants(0) == frozenset() and "a" not in swarm.links
    assert sorted(swarm.requests(0.1)) == [(0, "b"), (1, "b")]


def test_a_failed_link_is_avoided_and_the_hub_retried():
    swarm = _linked(Swarm(2, "me", (1,), hub_retry_s=1.0), {"a": {0}, "b": {0}})
    asked = dict(swarm.requests(0.0))
    bad = asked[0]
    assert swarm.failed(0, bad, 0.1) and not swarm.failed(0, bad, 0.2)
    assert bad not in swarm.links and not swarm.link_up(bad)
    assert swarm.statistics().avoided == (bad,)
    assert not swarm.failed(1, HUB, 0.3)
    assert swarm.requests(0.4) == [(0, "ab".replace(bad, ""))]
    assert swarm.wake_at(0.4) == pytest.approx(1.3)
    assert swarm.requests(1.3) == [(1, HUB)]


# --- hostile links -------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [b"", b"\xff", b"\xff\x03\x00", b"\xff\x07"])
def test_hostile_have_is_rejected(bits):
    """Ten chunks: the bitfield is exactly 2 bytes with bits 10-15 clear."""
    swarm = _linked(Swarm(10, "me", ()), {"a": {1}})
    with pytest.raises(ValueError):
        swarm.heard_have("a", bits)
    assert swarm.requests(0.0) == [(1, "a")]  # what it said before still stands


@pytest.mark.parametrize("indices", [[10], [-1], [2**40], [1.0], [3, 10]])
def test_hostile_had_is_rejected(indices):
    swarm = _linked(Swarm(10, "me", ()), {"a": set()})
    with pytest.raises(ValueError):
        swarm.heard_had("a", indices)
    assert swarm.requests(0.0) == []


def test_frames_from_no_link_and_bad_wants_are_refused():
    swarm = _linked(Swarm(4, "me", ()), {"a": set()})
    with pytest.raises(ValueError):
        swarm.heard_had("stranger", [0])
    swarm.got(0)
    swarm.got(1)
    assert swarm.wanted("a", 2) == "chunk not held"
    assert swarm.wanted("a", 99) == "chunk out of range"
    assert swarm.wanted("stranger", 0) == "no link"
    assert swarm.wanted("a", 0) is None and swarm.wanted("a", 1) is None
    swarm.got(2)
    assert swarm.wanted("a", 2) == "too many wants"
    swarm.served("a", 0)
    assert swarm.wanted("a", 2) is None


@FAST
@given(st.lists(st.tuples(st.sampled_from(["have", "had", "got", "fail", "down", "up", "ask"]),
                          st.sampled_from(["a", "b", "c", HUB]), st.integers(-3, 12),
                          st.binary(max_size=3)), max_size=40))
def test_any_sequence_of_link_events_fails_cleanly(ops):
    """Whatever links say, in any order: only ValueError, and windows always hold."""
    swarm = Swarm(10, "me", (7, 8), window=2, hub_window=2)
    now = 0.0
    for op, peer, i, bits in ops:
        now += 0.7
        try:
            {"have": lambda: swarm.heard_have(peer, bits), "had": lambda: swarm.heard_had(peer, [i]),
             "got": lambda: swarm.got(i, peer, now), "fail": lambda: swarm.failed(i, peer, now),
             "down": lambda: swarm.link_down(peer), "up": lambda: swarm.link_up(peer),
             "ask": lambda: swarm.wanted(peer, i)}[op]()
        except ValueError:
            pass
        out = swarm.requests(now)
        assert all(0 <= j < 10 for j, _ in out)
        load = Counter(src for j in range(10) for src in swarm.wants(j))
        assert all(n <= 2 for n in load.values())


def test_bitfields_round_trip():
    assert unpack_bits(pack_bits({0, 9, 17}, 18), 18) == {0, 9, 17}
    assert pack_bits({0, 9}, 10) == b"\x01\x02"


# --- swarms together -----------------------------------------------------------------------


def test_version_completes_with_the_hub_gone_after_the_seed_copy():
    """Once every chunk has left the hub once, its route goes: the swarm completes anyway,
    and the hub sent exactly one copy."""
    mesh = Mesh(12, 30)
    mesh.hub_up = lambda index: mesh.hub_sent[index] == 0
    mesh.run(until=200.0)
    assert all(s.complete for s in mesh.swarms.values())
    assert sorted(mesh.hub_sent) == list(range(30)) and set(mesh.hub_sent.values()) == {1}


def test_runs_are_deterministic_and_peers_differ():
    """The same deal and ids give the same wants; different ids pick in different orders."""
    logs = []
    for _ in range(2):
        mesh = Mesh(8, 20, seed=3)
        mesh.run(until=100.0)
        logs.append(mesh.log)
    assert logs[0] == logs[1]
    firsts = {tuple(i for i, _ in _linked(Swarm(6, f"p{k}", (), window=6),
                                          {"a": set(range(6))}).requests(0.0)) for k in range(4)}
    assert len(firsts) > 1


# --- the hub's dealing ---------------------------------------------------------------------


@FAST
@given(n_public=st.integers(0, 40), n_nat=st.integers(0, 40), n_chunks=st.integers(0, 300),
       degree=st.integers(0, 100), seed=st.integers(0, 9))
def test_every_chunk_has_one_seeder_and_neighbours_are_capped(n_public, n_nat, n_chunks, degree,
                                                               seed):
    """Every chunk has exactly one seeder, always one that accepts links (a NAT'd member seeds
    nothing: nobody could check it fetches); with none such, every member fetches every
    chunk for itself. Neighbour samples hold only members that accept links."""
    members = ([Member(f"s{i}", f"http://10.0.0.{i}:1", float(i % 3)) for i in range(n_public)]
               + [Member(f"n{i}", None) for i in range(n_nat)])
    deals = gossip_plan(members, n_chunks, degree, random.Random(seed))
    assert set(deals) == {mb.peer_id for mb in members}
    seeds = [i for d in deals.values() for i in d.seed]
    assert sorted(seeds) == (list(range(n_chunks)) if n_public else [])
    assert all(not d.seed for p, d in deals.items() if p.startswith("n"))
    for d in deals.values():
        assert d.own == ([] if n_public else list(range(n_chunks)))
        assert sorted(d.from_hub) == sorted(d.seed + d.own)
    for peer, d in deals.items():
        ids = [nb.peer_id for nb in d.neighbours]
        assert peer not in ids and len(set(ids)) == len(ids)
        assert all(i.startswith("s") for i in ids)  # only peers that accept links
        want = degree if peer.startswith("s") else 2 * degree
        assert len(ids) == min(want, MAX_NEIGHBOURS, n_public - peer.startswith("s"))


def test_orphaned_seeds_are_dealt_by_measured_upload():
    """Re-dealt seeds go one each to the members left, in proportion to their upload."""
    members = [Member("fast", "http://a:1", 3e6), Member("slow", None, 1e6)]
    seeds = deal_seeds(members, [5, 7, 9, 11])
    assert sorted(seeds["fast"] + seeds["slow"]) == [5, 7, 9, 11]
    assert (len(seeds["fast"]), len(seeds["slow"])) == (3, 1)
    assert deal_seeds([], [1]) == {}


# --- the emulated sweep --------------------------------------------------------------------


def test_emulated_hub_control_is_o_n_for_gossip():
    """16 emulated peers: gossip's hub control messages are a few per peer whatever the chunk
    count, and its plans grow by 4 bytes per added chunk in all; the tracker's plans grow by
    4 bytes per chunk per peer. Both complete, and gossip's hub sends one copy."""
    runs = {(name, n): run(Setup(16, n_chunks=n, chunk_bytes=(108 << 20) // n))
            for n in (54, 108) for name, run in (("gossip", run_gossip), ("tracker", run_tracker))}
    assert all(r.complete for r in runs.values())
    g54, g108, t54, t108 = (runs[k] for k in (("gossip", 54), ("gossip", 108),
                                              ("tracker", 54), ("tracker", 108)))
    assert g54.hub_msgs == g108.hub_msgs <= 3 * 16
    assert g108.hub_plan_bytes - g54.hub_plan_bytes <= 4 * 54 + 16
    assert t108.hub_plan_bytes - t54.hub_plan_bytes >= 16 * 4 * 54
    assert g54.hub_copies == g108.hub_copies == 1.0
    assert g54.p2p_msgs > 0 and t54.p2p_msgs == 0


def test_emulation_counts_the_real_announcement():
    """The sweep's gossip announcement is what messages.encode makes of the real message."""
    man = manifest(10, 1 << 20)
    encoded, plan_bytes = gossip_announcement(man, [1, 2], [])
    assert len(encoded) > plan_bytes >= len(struct.pack("<2I", 1, 2))


def test_a_natted_link_is_asked_first_and_its_wants_are_served_first():
    """A NAT'd peer's upload has only its links as outlets: of two links holding a chunk the
    NAT'd one is asked even when more loaded, and at our uplink its wants go before a public
    link's, whatever the chunks' rarity."""
    swarm = Swarm(8, "me", [], window=2)
    assert swarm.link_up("public") and swarm.link_up("nat", reachable=False)
    swarm.heard_have("public", pack_bits(range(8), 8))
    swarm.heard_have("nat", pack_bits(range(8), 8))
    picks = [source for _, source in swarm.requests(0.0)]
    assert picks[:2] == ["nat", "nat"] and picks[2:] == ["public", "public"]
    rare, common = 0, 1
    swarm.link_down("public")
    assert swarm.link_up("public2")
    swarm.heard_had("public2", [common])
    assert swarm.serve_rank("nat", common) < swarm.serve_rank("public2", rare)
    assert swarm.serve_rank("public2", rare) < swarm.serve_rank("public2", common)


def test_emulated_chain_leaves_slow_uplinks_out_and_the_hub_sends_one_copy():
    """The striped chain in the emulation, by the hub's real plans: with a third of the
    uplinks at B/4 and the hub's own rate unknown, the ring is the fast members (a slow one in
    it held 16 peers at 3.4 x the max-flow bound), every peer completes, and each chunk left
    the hub once; each ring member asks the window its plan names of its parent."""
    for n in (8, 16):
        res = run_chain(Setup(n, n_chunks=32, slow_fraction=1 / 3))
        assert res.complete and res.hub_copies == 1.0
        assert res.extra["ring"] == n - round(n / 3)


def test_emulated_chain_children_do_not_stall_on_healthy_parents():
    """16 peers, 24 MiB in 64 KiB chunks at 20 Mbit/s, with Download's stall and slow rules:
    each chunk leaves the hub once and no parent is reported (with the chain's whole window
    asked of the hub too, 16 stalls and 8.9 hub copies)."""
    res = run_chain(Setup(16, n_chunks=384, chunk_bytes=64 << 10, peer_bps=20e6, hub_bps=20e6,
                          latency_s=(0.0002, 0.001), stall_s=10.0))
    assert res.complete and res.hub_copies == 1.0 and "reports" not in res.extra


def test_emulated_chain_completes_when_members_leave():
    """1/8 of a 16-peer chain leaves mid-version (requests never time out here): the hub
    splices the ring and the rest complete (a departed member's stripes dealt elsewhere in the
    ring left a first hop waiting on its parent for them, and the ring on it)."""
    base = run_chain(Setup(16, n_chunks=54))
    res = run_chain(Setup(16, n_chunks=54, leave_at_s=0.3 * base.time_s))
    assert res.complete and res.hub_copies < 1.1
    # 64 peers, two neighbours of one leaving at once: its first wants went to the first,
    # its window to the second, and the new parent's (a Failover matter) never past the window
    net = dict(n_chunks=128, chunk_bytes=64 << 10, peer_bps=20e6, hub_bps=20e6,
               latency_s=(0.0002, 0.001), hub_bps_known=20e6, uplink_queue_bytes=256 << 10)
    base = run_chain(Setup(64, **net))
    assert run_chain(Setup(64, leave_at_s=0.3 * base.time_s, **net)).complete
