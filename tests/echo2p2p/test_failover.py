"""Download failover as pure code: owners by plan, failed sources wait then go to the hub, the
hub is retried after a pause. Synchronous, with explicit `now`."""

from __future__ import annotations

import struct

from hypothesis import given, strategies as st

from echo2p2p import messages as m
from echo2p2p.failover import HUB, HUB_WINDOW, Failover


def plan(owners: list[int], peers: list[str], revision: int = 1, version: int = 1) -> m.RelayPlan:
    sources = [m.RelaySource(p, f"http://{p}:1") for p in peers]
    return m.RelayPlan(version, None, revision, sources, struct.pack(f"<{len(owners)}I", *owners))


H = m.HUB_OWNER


def test_everything_comes_from_the_hub_until_a_plan_arrives():
    """No plan yet: every chunk is routed to the hub."""
    f = Failover(3, "me")
    assert [f.route(i, 0.0) for i in range(3)] == [HUB, HUB, HUB]
    assert f.statistics().revision == 0


def test_chunks_follow_their_owner_and_ours_come_from_the_hub():
    """A peer's chunks are asked of it; the hub's and our own are asked of the hub."""
    f = Failover(4, "me", replan_wait_s=3.0)
    assert f.plan(plan([0, 1, H, 0], ["a", "me"]), {"a"}) is None
    assert [f.route(i, 0.0) for i in range(4)] == ["a", HUB, HUB, "a"]


def test_a_source_without_a_usable_url_is_replaced_by_the_hub():
    """A source we cannot reach (no URL) has its chunks fetched from the hub."""
    f = Failover(2, "me")
    f.plan(plan([0, 1], ["a", "b"]), {"a"})
    assert [f.route(i, 0.0) for i in range(2)] == ["a", HUB]


def test_only_newer_plans_that_fit_are_taken():
    """An older or equal revision changes nothing; a wrong chunk count or a bad owner is
    ignored, with the reason."""
    f = Failover(2, "me")
    f.plan(plan([0, 0], ["a"], revision=2), {"a"})
    assert f.plan(plan([1, 1], ["a", "b"], revision=2), {"a", "b"}) is None
    assert f.route(0, 0.0) == "a"
    assert f.plan(plan([0, 0, 0], ["b"], revision=3), {"b"}) == "wrong chunk count"
    assert f.plan(plan([5, 0], ["b"], revision=3), {"b"}) is not None
    assert f.route(0, 0.0) == "a" and f.revision == 2


def test_a_failed_source_is_reported_once_waits_for_a_replan_then_goes_to_the_hub():
    """First fault: report it. Its chunks wait `replan_wait_s` for a new plan, then come from
    the hub; a new plan that re-deals them is followed at once."""
    f = Failover(2, "me", replan_wait_s=3.0)
    f.plan(plan([0, 1], ["a", "b"]), {"a", "b"})
    assert f.failed("a", 10.0) is True
    assert f.failed("a", 11.0) is False  # reported once
    assert f.route(0, 12.0) is None and f.route(1, 12.0) == "b"
    assert f.route(0, 13.5) == HUB
    f.plan(plan([1, 1], ["a", "b"], revision=2), {"a", "b"})
    assert f.route(0, 12.0) == "b"
    assert f.statistics().failed_sources == ("a",)


def test_the_hub_is_retried_after_a_pause_never_avoided():
    """A failed hub request is not reported; hub-routed chunks wait `hub_retry_s`, then go
    to the hub again."""
    f = Failover(2, "me", hub_retry_s=1.0)
    f.plan(plan([H, 0], ["a"]), {"a"})
    assert f.failed(HUB, 5.0) is False
    assert f.route(0, 5.5) is None and f.route(1, 5.5) == "a"
    assert f.route(0, 6.0) == HUB
    assert f.statistics().hub_failures == 1


def test_a_failed_source_past_the_wait_still_respects_the_hub_pause():
    """A failed peer's chunks go to the hub only when the hub is not paused."""
    f = Failover(1, "me", replan_wait_s=1.0, hub_retry_s=1.0)
    f.plan(plan([0], ["a"]), {"a"})
    f.failed("a", 0.0)
    f.failed(HUB, 1.5)
    assert f.route(0, 2.0) is None
    assert f.route(0, 2.5) == HUB


def test_requests_keep_a_window_per_source_and_end_as_told():
    """At most `window` requests are out to a source at once, lowest chunk first; a chunk that
    came is not asked again, a failed one is asked again once routed (here: of the hub, after
    the replan wait), and the first failure of a peer source is to be reported."""
    f = Failover(5, "me", replan_wait_s=1.0)
    f.plan(plan([0, 0, 0, H, H], ["a"]), {"a"})
    assert f.requests(0.0, window=2) == [(0, "a"), (1, "a"), (3, HUB), (4, HUB)]
    assert f.requests(0.0, window=2) == [] and f.asked(2) is None and f.asked(1) == "a"
    assert f.finished(0, "a", None, 0.5) is False
    assert f.requests(0.5, window=2) == [(2, "a")]
    assert f.finished(1, "a", "stall", 0.6) is True  # reported: chunks 1 and 2 wait
    assert f.requests(0.7, window=2) == [] and f.waiting(0.7)
    assert f.finished(2, "a", "slow", 0.8) is False  # in, and "a" was reported already
    for i in (3, 4):
        f.finished(i, HUB, None, 0.9)
    assert not f.complete and f.requests(2.0, window=2) == [(1, HUB)]
    assert f.finished(1, HUB, None, 2.5) is False and f.complete


def test_a_resumed_download_wants_only_what_it_lacks():
    """Told which chunks are missing, the failover asks for those alone."""
    f = Failover(4, "me")
    f.want([1, 3])
    assert f.requests(0.0, window=4) == [(1, HUB), (3, HUB)]


@given(st.lists(st.tuples(st.sampled_from(["a", "b", HUB]), st.floats(0, 100)), max_size=20),
       st.floats(0, 200))
def test_a_chunk_goes_only_to_a_healthy_source_or_the_hub(faults, now):
    """Whatever failed when: a chunk is asked of its owner only if that owner never failed,
    of the hub only outside its pause, else it waits (a model kept here)."""
    f = Failover(2, "me", replan_wait_s=3.0, hub_retry_s=1.0)
    f.plan(plan([0, 1], ["a", "b"]), {"a", "b"})
    failed_at: dict[str, float] = {}
    hub_pause_until = float("-inf")
    for source, at in sorted(faults, key=lambda x: x[1]):
        reported = f.failed(source, at)
        if source == HUB:
            hub_pause_until = at + 1.0
            assert not reported
        else:
            assert reported == (source not in failed_at)
            failed_at.setdefault(source, at)
    for i, owner in enumerate(["a", "b"]):
        route = f.route(i, now)
        if owner not in failed_at:
            assert route == owner
        elif now - failed_at[owner] <= 3.0 or now < hub_pause_until:
            assert route is None
        else:
            assert route == HUB


def test_a_chains_wide_window_is_for_its_parent_not_the_hub():
    """A striped-chain member's plan asks 30 requests in flight: of its parent, whose chunks
    come down the ring; of the hub (its own stripe) still at most HUB_WINDOW, so the hub's
    queue is not every member's whole window deep (the children stalled on healthy parents
    behind it). A failed parent's chunks, from the hub meanwhile, take the whole window."""
    f = Failover(128, "me", replan_wait_s=1.0)
    f.plan(plan([0 if i % 4 == 0 else 1 for i in range(128)], ["me", "parent"]), {"parent"})
    sent = f.requests(0.0, 30)
    assert sum(s == "parent" for _, s in sent) == 30
    assert [i for i, s in sent if s == HUB] == [0, 4, 8, 12][:HUB_WINDOW] and HUB_WINDOW < 30
    f.finished(0, HUB, None, 1.0)
    assert f.requests(1.0, 30) == [(4 * HUB_WINDOW, HUB)]
    f.finished(1, "parent", "stall", 1.0)
    later = f.requests(5.0, 30)
    assert len(later) == 30 - HUB_WINDOW and {s for _, s in later} == {HUB}


def test_a_chunk_lower_than_all_out_to_its_source_is_asked_past_the_window():
    """A chain member's parent left: its first chunks were out to it while the next plan's
    parent got the window's later ones; when those first ones fail they are asked of the new
    parent at once (past the window, lowest first), not after chunks that may only reach the
    parent once these passed us."""
    f = Failover(8, "me")
    f.plan(plan([0] * 8, ["old"]), {"old"})
    assert f.requests(0.0, 2) == [(0, "old"), (1, "old")]
    f.plan(plan([0] * 8, ["new"], revision=2), {"new"})
    assert f.requests(0.0, 2) == [(2, "new"), (3, "new")]
    f.finished(0, "old", "unreachable", 1.0)
    f.finished(1, "old", "unreachable", 1.0)
    assert f.requests(1.0, 2) == [(0, "new")]
    f.finished(0, "new", None, 2.0)
    assert f.requests(2.0, 2) == [(1, "new")]


def test_a_request_out_to_a_source_the_hub_dealt_around_is_withdrawn_and_asked_again():
    """The hub re-dealt a's chunk to b (a fetched nothing of its share): the request out to a
    is `moved`, released without a report, and asked of b; the one out to b stays."""
    f = Failover(2, "me")
    f.plan(plan([0, 1], ["a", "b"]), {"a", "b"})
    assert f.requests(0.0, 4) == [(0, "a"), (1, "b")]
    assert f.moved() == []
    f.plan(plan([0, 0], ["b"], revision=2), {"a", "b"})
    assert f.moved() == [(0, "a")]
    f.release(0, "a")
    assert f.moved() == [] and f.requests(1.0, 4) == [(0, "b")]
    assert f.statistics().failed_sources == ()


def test_a_hub_that_keeps_failing_is_asked_less_and_less_often():
    """A stopped hub: each failed round doubles the pause (up to HUB_RETRY_MAX_S); the other
    failures of a round (requests out at once) do not; a chunk it serves ends the streak."""
    f = Failover(3, "me", hub_retry_s=1.0)
    t = 0.0
    pauses = []
    for _ in range(8):
        asked = f.requests(t, window=4)
        assert asked, t
        for i, source in asked:
            f.finished(i, source, "unreachable", t)
        assert f.hub.rounds == len(pauses) + 1 and f.hub.fresh is False  # 3 failed, 1 round
        pauses.append(f.hub.pause_s)
        assert f.route(0, f.hub.retry_at - 0.01) is None
        t = f.hub.retry_at
    assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert f.statistics().hub_failures == 24
    (i, source), *rest = f.requests(t, window=4)
    f.finished(i, source, None, t)  # the hub is back
    assert f.hub.rounds == 0
    for j, source in rest:
        f.finished(j, source, "unreachable", t + 1)
    assert f.hub.pause_s == 1.0 and f.hub.rounds == 1
