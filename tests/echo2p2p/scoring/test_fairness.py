"""Fair queueing of scoring over owners: least-used first, batches of many owners' items in that
order (an unmeasured or slow owner's item alone), the per-item budget; synchronous, with
explicit `now`."""

from __future__ import annotations

import math

import pytest

from echo2p2p.scoring.fairness import BATCH_S, RELEASE, WINDOW_S, FairQueue


def test_the_least_used_owner_is_served_first_and_slow_items_one_at_a_time():
    """While two owners wait, the one that used less gets the next item; items slower than
    BATCH_S at their owner's mean go one per batch."""
    q = FairQueue()
    q.push("burner", ["b1", "b2"], now=0.0)
    q.push("honest", ["h1", "h2"], now=0.0)
    q.charge("burner", 4.0, 4, now=0.0)
    q.charge("honest", 0.5, 4, now=0.0)
    assert q.pop(1.0, max_items=256) == [("honest", "h1")]
    assert q.pop(1.0, max_items=256) == [("honest", "h2")]
    assert q.pop(1.0, max_items=256) == [("burner", "b1")]  # alone, but its items are slow
    assert q.pop(1.0, max_items=256) == [("burner", "b2")]
    assert not q


def test_a_batch_holds_many_cheap_owners_items_in_fair_order():
    """Cheap owners that used alike share one batch round robin; one that used more comes in
    once the others' items, charged at their means on the way, have caught up with it."""
    q = FairQueue()
    for owner, items in (("a", 8), ("b", 8), ("c", 9)):
        q.charge(owner, items / 1024, items, now=0.0)  # 1/1024 s an item (exact in binary)
        q.push(owner, [f"{owner}{i}" for i in range(1, 4)], now=0.0)
    batch = q.pop(0.0, max_items=256)
    assert [item for _, item in batch] == ["a1", "b1", "a2", "b2", "c1", "a3", "b3", "c2", "c3"]
    assert all(item.startswith(owner) for owner, item in batch) and not q


def test_a_batch_takes_what_fits_in_batch_s_at_the_owners_means():
    """Items go in while the batch's time at their owners' means stays within BATCH_S, and
    never past max_items."""
    q = FairQueue()
    for owner in "ab":
        q.charge(owner, 0.4 * BATCH_S * 10, 10, now=0.0)  # 0.4 BATCH_S an item
        q.push(owner, [owner] * 5, now=0.0)
    assert len(q.pop(0.0, max_items=256)) == 2  # a third would make 1.2 BATCH_S
    q.charge("c", 0.001, 1000, now=0.0)  # 1 us an item
    q.push("c", ["c"] * 300, now=0.0)
    assert q.pop(0.0, max_items=256) == [("c", "c")] * 256


def test_an_unmeasured_owner_has_one_item_a_batch_and_a_slow_one_opens_the_next():
    """At its turn an owner not yet measured has one item in the batch (its first measure)
    and the cheap owners' go on; a known-slow owner's turn ends the batch, and it opens the
    next one alone."""
    q = FairQueue()
    q.charge("cheap", 0.001, 10, now=0.0)
    q.push("cheap", ["c1", "c2"], now=0.0)
    q.push("fresh", ["f1", "f2"], now=0.0)  # level with cheap: next after c1
    assert q.pop(0.0, max_items=256) == [("cheap", "c1"), ("fresh", "f1"), ("cheap", "c2")]
    q.charge("fresh", 1.0, 1, now=0.0)  # slow
    q.push("cheap", ["c3", "c4"], now=0.0)
    assert q.pop(0.0, max_items=256) == [("cheap", "c3"), ("cheap", "c4")]
    q.push("cheap", ["c5"], now=0.0)
    q.charge("cheap", 5.0, 100, now=0.0)  # cheap now ranks after fresh
    assert q.pop(0.0, max_items=256) == [("fresh", "f2")]
    assert q.pop(0.0, max_items=256) == [("cheap", "c5")]


def test_usage_decays_over_the_window_and_is_forgotten():
    """Seconds used count e^-1 after WINDOW_S, and an owner decayed to nothing is dropped."""
    q = FairQueue()
    q.charge("a", 10.0, 1, now=0.0)
    assert q.usage_s("a", WINDOW_S) == pytest.approx(10.0 / math.e)
    q.forget(now=WINDOW_S)
    assert q.usage_s("a", WINDOW_S) > 0  # still remembered
    q.forget(now=100 * WINDOW_S)
    assert q.usage_s("a", 100 * WINDOW_S) == 0.0 and not q._usage


def test_an_owner_is_over_budget_only_with_slow_items_and_others_scoring():
    """Slow items (mean above the per-item budget) put an owner over budget while another
    scores; cheap items, scoring alone, or usage decayed below RELEASE x one item's budget do
    not."""
    q = FairQueue()
    q.charge("burner", 4.4, 4, now=0.0)  # 1.1 s an item
    assert not q.over_budget("burner", 2.0, now=0.0)  # within a looser budget
    assert not q.over_budget("burner", 1.0, now=0.0)  # alone
    q.charge("honest", 3.0, 16, now=0.0)  # 0.19 s an item
    assert not q.over_budget("burner", 2.0, now=0.0)  # within a looser budget still
    assert q.over_budget("burner", 1.0, now=0.0)
    assert not q.over_budget("honest", 1.0, now=0.0)
    released = WINDOW_S * math.log(4.4 / RELEASE)  # 4.4 s decayed to RELEASE x 1 s
    assert q.over_budget("burner", 1.0, now=released - 1)
    assert not q.over_budget("burner", 1.0, now=released + 1)


def test_one_sample_at_the_budget_holds_its_owner_over_until_it_decays():
    """An owner found over budget after one sample of 1.02 s (a budget of 1 s) stays over for
    over a minute, not until that one sample decays under the budget a second later: each
    turn back under the budget would get it leases again, every one refused."""
    q = FairQueue()
    q.charge("honest", 3.0, 16, now=0.0)
    q.charge("burner", 1.02, 1, now=0.0)
    assert q.over_budget("burner", 1.0, now=0.0)
    assert q.usage_s("burner", 2.0) < 1.0  # the plain rule would let it go here
    assert q.over_budget("burner", 1.0, now=2.0) and q.over_budget("burner", 1.0, now=60.0)
    assert not q.over_budget("burner", 1.0, now=WINDOW_S * math.log(1.02 / RELEASE) + 1)


def test_when_every_owner_is_slow_nobody_is_over_budget():
    """A policy whose samples all run long (every peer's mean near the limit) singles out no
    peer; one 3x slower than the cheapest other is still over; sybils cannot hide a burner."""
    q = FairQueue()
    for peer in ("a", "b", "c"):
        q.charge(peer, 7.2, 4, now=0.0)  # 1.8 s an item, all of them
    assert not any(q.over_budget(p, 1.0, now=0.0) for p in "abc")
    q.charge("cheap", 0.8, 4, now=0.0)  # 0.2 s an item: now a, b and c stand out
    assert all(q.over_budget(p, 1.0, now=0.0) for p in "abc")
    assert not q.over_budget("cheap", 1.0, now=0.0)


def test_drop_and_push_front_keep_order():
    """Dropped items come back; items pushed in front go first, in their order."""
    q = FairQueue()
    q.push("a", [1, 2, 3], now=0.0)
    q.push("b", [4], now=0.0)
    assert q.drop(lambda x: x in (2, 4)) == [2, 4]
    q.push("a", [7, 8], now=0.0, front=True)
    assert list(q) == [7, 8, 1, 3]


def test_an_owner_alone_gets_a_batch_its_mean_time_allows():
    """Alone, an unmeasured owner gets one item; a cheap one up to max_items; a slow one, one."""
    q = FairQueue()
    q.push("new", list(range(10)), now=0.0)
    assert q.pop(0.0, max_items=256) == [("new", 0)]
    q.charge("new", 0.001, 100, now=0.0)  # 10 us an item
    assert q.pop(0.0, max_items=4) == [("new", i) for i in (1, 2, 3, 4)]
    q.charge("new", 100.0, 100, now=0.0)  # now ~1 s an item
    assert q.pop(0.0, max_items=256) == [("new", 5)]


def test_a_new_owner_starts_level_with_the_least_used_waiting_one():
    """An owner new to the queue gets no head start over the peers waiting (it ranks as the
    least-used of them), and is not starved by them either: it is next once that one is
    charged for an item."""
    q = FairQueue()
    q.charge("honest", 5.0, 30, now=0.0)
    q.push("honest", ["h1", "h2"], now=0.0)
    q.push("fresh", ["f1", "f2"], now=0.0)
    assert q.pop(0.0, max_items=256) == [("honest", "h1")]
    q.charge("honest", 0.2, 1, now=0.0)
    assert q.pop(0.0, max_items=256) == [("fresh", "f1")]
    assert not q.over_budget("fresh", 1.0, now=0.0)  # its start orders it, it is no usage
