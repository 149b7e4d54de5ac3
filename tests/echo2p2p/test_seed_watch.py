"""The hub's seed watch, driven synchronously with an explicit clock: who may be dealt chunks
(probation, proven, benched) and when a dealt peer that fetches nothing is silent."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p.seed_watch import SeedWatch, WatchPolicy

V1, V2 = (1, None), (2, None)
POLICY = WatchPolicy(probation_chunks=1, prove_manifests=2, floor_s=1.0, chunk_times=2.0,
                     bench_s=60.0, max_bench_s=200.0)


def fetch(watch: SeedWatch, peer: str, key, index: int, now: float, ok: bool = True) -> None:
    """`peer` asks the hub's chunk route for chunk `index` at `now` and gets it (or not)."""
    watch.asked(peer, key, index, now)
    watch.answered(peer, key, index, ok, now)


def test_a_peer_that_asks_nothing_is_silent_after_its_grace_and_benched():
    """Nothing heard for the grace (not a moment before): its chunks come back to deal again,
    it is dealt nothing for bench_s, then tried on probation again."""
    watch = SeedWatch(POLICY)
    watch.dealt(V1, "p1", "p1", [3, 5], 1.0, now=10.0)
    assert watch.wake_at() == 11.0
    assert watch.due(10.99) == []
    (silence,) = watch.due(11.0)
    assert (silence.peer_id, silence.chunks, silence.quiet_s, silence.bench_s) == (
        "p1", (3, 5), 1.0, 60.0)
    assert watch.due(12.0) == [] and watch.wake_at() is None  # told once
    assert watch.cap("p1", 70.99) == 0 and watch.standing("p1", 70.99) == "benched"
    assert watch.cap("p1", 71.0) == 1


def test_each_silence_in_a_row_doubles_the_bench_up_to_its_cap():
    watch = SeedWatch(POLICY)
    benches, now = [], 0.0
    for _ in range(4):
        watch.dealt(V1, "p1", "p1", [0], 1.0, now)
        (silence,) = watch.due(now + 1.0)
        benches.append(silence.bench_s)
        now += 1.0 + silence.bench_s
    assert benches == [60.0, 120.0, 200.0, 200.0]


def test_a_request_open_at_the_hub_is_no_silence():
    """A request waiting for one of the hub's upload slots: the hub is slow, not the peer."""
    watch = SeedWatch(POLICY)
    watch.dealt(V1, "p1", "p1", [0, 1], 1.0, now=0.0)
    watch.asked("p1", V1, 0, now=0.5)
    assert watch.due(30.0) == [] and watch.wake_at() is None
    watch.answered("p1", V1, 0, True, now=30.0)
    assert watch.wake_at() == 31.0  # then it must ask again within its grace
    fetch(watch, "p1", V1, 1, now=30.9)
    assert watch.due(100.0) == [] and watch.standing("p1", 100.0) == "probation"


def test_a_peer_that_stops_asking_is_silent_with_what_it_had_not_fetched():
    watch = SeedWatch(POLICY)
    watch.dealt(V1, "p1", "p1", [0, 1, 2], 1.0, now=0.0)
    fetch(watch, "p1", V1, 0, now=0.5)
    fetch(watch, "p1", V1, 9, now=1.2)  # any chunk of the manifest counts, once
    assert watch.due(2.1) == []
    (silence,) = watch.due(2.2)
    assert silence.chunks == (1, 2)


def test_asking_again_for_a_chunk_it_was_sent_neither_shields_nor_renews():
    """Else asking for one chunk over and over would keep a share it never fetches alive."""
    watch = SeedWatch(POLICY)
    watch.dealt(V1, "p1", "p1", [0, 1], 1.0, now=0.0)
    fetch(watch, "p1", V1, 0, now=0.5)
    for t in (0.9, 1.2):
        watch.asked("p1", V1, 0, now=t)  # left open, even
    (silence,) = watch.due(1.5)
    assert silence.chunks == (1,)


def test_a_failed_answer_lets_the_chunk_count_again():
    watch = SeedWatch(POLICY)
    watch.dealt(V1, "p1", "p1", [0], 1.0, now=0.0)
    fetch(watch, "p1", V1, 0, now=0.5, ok=False)  # e.g. the hub's write timed out
    watch.asked("p1", V1, 0, now=1.4)
    assert watch.due(5.0) == []  # open again


def test_shares_fetched_whole_make_a_peer_proven():
    """Probation until `prove_manifests` shares in a row were fetched whole (from the hub, or
    reported whole); then no cap but its uplink's; a silence sends it back."""
    watch = SeedWatch(POLICY)
    assert watch.cap("p1", 0.0) == 1
    watch.dealt(V1, "p1", "p1", [4], 1.0, now=0.0)
    fetch(watch, "p1", V1, 4, now=0.1)
    assert watch.cap("p1", 0.2) == 1
    watch.dealt(V2, "p1", "p1", [2, 3], 1.0, now=1.0)
    fetch(watch, "p1", V2, 2, now=1.1)
    watch.whole("p1", V2, now=1.5)  # chunk 3 came over a link: the manifest is whole anyway
    assert watch.cap("p1", 1.6) is None and watch.standing("p1", 1.6) == "proven"
    watch.dealt((3, 2), "p1", "p1", [0], 1.0, now=2.0)
    assert len(watch.due(3.0)) == 1 and watch.cap("p1", 3.0) == 0


def test_a_share_of_a_superseded_version_is_dropped_but_its_quiet_carries_over():
    """Versions faster than the grace must not hide a peer that never asks: its quiet carries to
    its share of the next version; a peer that was asking starts afresh."""
    watch = SeedWatch(POLICY)
    for peer in ("idle", "busy"):
        watch.dealt(V1, peer, peer, [0, 1], 1.0, now=0.0)
    watch.asked("busy", V1, 0, now=0.6)  # open when v2 comes
    watch.superseded(2, now=0.7)
    for peer in ("idle", "busy"):
        watch.dealt(V2, peer, peer, [1], 1.0, now=0.7)
    (silence,) = watch.due(1.0)
    assert (silence.key, silence.peer_id) == (V2, "idle")
    assert watch.wake_at() == 1.7
    watch.superseded(3, now=1.5)
    watch.dealt((3, None), "idle", "idle", [0], 1.0, now=50.0)  # carried once only
    assert watch.wake_at() == 51.0


def test_a_peer_that_left_is_not_waited_for_and_its_standing_goes_unless_benched():
    watch = SeedWatch(POLICY)
    watch.dealt(V1, "p1", "p1", [0], 1.0, now=0.0)
    watch.dealt(V1, "p2", "token:t", [1], 1.0, now=0.0)
    watch.left("p1", now=0.5)
    (silence,) = watch.due(2.0)
    assert silence.identity == "token:t"
    watch.left("p2", now=2.0)  # a token's standing outlives the connection
    assert watch.cap("token:t", 3.0) == 0


def test_standings_are_bounded_and_benches_go_last():
    """At most max_identities standings: the oldest unbenched go first (they were on
    probation, or earn their standing again), benches stay."""
    watch = SeedWatch(WatchPolicy(max_identities=3))
    watch.dealt(V1, "bad", "bad", [0], 1.0, now=0.0)
    watch.due(5.0)
    for i in range(5):  # one share each fetched whole: half way to proven
        watch.dealt(V2, f"p{i}", f"p{i}", [0], 1.0, now=6.0 + i)
        watch.whole(f"p{i}", V2, now=6.0 + i)
    watch.dealt((4, None), "x", "x", [0], 1.0, now=20.0)
    watch.due(30.0)  # x is benched now: 7 standings, pruned to 3
    assert watch.cap("bad", 30.0) == 0 and watch.cap("x", 30.0) == 0
    for peer in ("p0", "p4"):
        watch.dealt((5, None), peer, peer, [0], 1.0, now=31.0)
        watch.whole(peer, (5, None), now=31.0)
    assert watch.cap("p4", 31.0) is None  # kept: its second share proves it
    assert watch.cap("p0", 31.0) == 1  # forgotten: starts again


def test_the_grace_is_a_few_chunk_times_at_the_hub_rate_never_under_the_floor():
    assert POLICY.grace_s(1 << 20, None) == 1.0
    assert POLICY.grace_s(1 << 20, 100e6) == 1.0  # 2 x 84 ms
    assert math.isclose(POLICY.grace_s(16 << 20, 100e6), 2 * 8 * (16 << 20) / 100e6)
    assert POLICY.grace_s(1 << 20, float("nan")) == 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["deal", "ask", "answer", "whole", "due", "left",
                                            "superseded"]),
                          st.sampled_from(["a", "b"]), st.integers(0, 3), st.booleans()),
                max_size=40))
def test_any_sequence_keeps_the_watch_consistent(events):
    """Whatever the order of events: a silent peer is reported once per share, never while a
    counted request of it is open, and `wake_at` is never later than a silence `due` finds."""
    watch, now, version = SeedWatch(POLICY), 0.0, 1
    for kind, peer, index, ok in events:
        now += 0.4
        key = (version, None)
        if kind == "deal":
            watch.dealt(key, peer, peer, [index], 1.0, now)
        elif kind == "ask":
            watch.asked(peer, key, index, now)
        elif kind == "answer":
            watch.answered(peer, key, index, ok, now)
        elif kind == "whole":
            watch.whole(peer, key, now)
        elif kind == "left":
            watch.left(peer, now)
        elif kind == "superseded":
            version += 1
            watch.superseded(version, now)
        else:
            wake = watch.wake_at()
            found = watch.due(now)
            assert len({(s.key, s.peer_id) for s in found}) == len(found)
            assert not found or (wake is not None and wake <= now)
            assert all(watch.cap(s.identity, now) == 0 for s in found)
