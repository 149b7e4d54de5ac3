"""`RolloutBuffer` with dynamic sampling: uniform groups are counted and never queued, the
informative share slides over the recent admissions with a floor, and the totals survive a
checkpoint."""

from __future__ import annotations

from echo2p2p.buffer import MIN_INFORMATIVE_FRAC, YIELD_WINDOW, RolloutBuffer, ScoredGroup


def group(n: int, rewards: list[float]) -> ScoredGroup:
    return ScoredGroup(f"L{n}", "p", [1], 0, (), rewards)


def test_uniform_groups_are_counted_not_queued_and_nan_is_left_to_the_learner():
    """Equal rewards (any value) are filtered; a NaN group is queued (the learner drops it)."""
    buf = RolloutBuffer(max_lag=2, filter_uniform=True)
    assert not buf.put(group(0, [1.0, 1.0])) and not buf.put(group(1, [0.0, 0.0]))
    assert buf.put(group(2, [0.0, 1.0])) and buf.put(group(3, [float("nan")] * 2))
    stats = buf.statistics()
    assert (stats.queued, stats.admitted_total, stats.filtered_total) == (2, 4, 2)
    assert buf.filtered_since_batch == 2 and buf.informative_frac() == 0.5
    assert buf.in_leases() == 4  # two queued groups took four leases
    assert [g.lease_id for g in buf.take_batch(0, 2)] == ["L2", "L3"]
    assert buf.filtered_since_batch == 0


def test_the_informative_share_slides_and_has_a_floor():
    """All uniform: the floor (the budget widens 4x, no more); a window of informative groups
    later: 1.0 again."""
    buf = RolloutBuffer(max_lag=2, filter_uniform=True)
    assert buf.informative_frac() == 1.0  # nothing seen yet
    for n in range(YIELD_WINDOW):
        buf.put(group(n, [1.0, 1.0]))
    assert buf.informative_frac() == MIN_INFORMATIVE_FRAC
    for n in range(YIELD_WINDOW // 2):
        buf.put(group(100 + n, [0.0, 1.0]))
    assert buf.informative_frac() == 0.5
    for n in range(YIELD_WINDOW // 2):
        buf.put(group(200 + n, [0.0, 1.0]))
    assert buf.informative_frac() == 1.0


def test_off_every_group_is_queued_and_the_totals_round_trip():
    """Without filtering a uniform group is queued as before; the filtered total is kept by a
    checkpoint's totals (and absent from an old one: 0)."""
    off = RolloutBuffer(max_lag=2)
    assert off.put(group(0, [1.0, 1.0])) and len(off) == 1 and off.informative_frac() == 1.0
    on = RolloutBuffer(max_lag=2, filter_uniform=True)
    on.put(group(0, [1.0, 1.0]))
    back = RolloutBuffer(max_lag=2, filter_uniform=True)
    back.restore_totals(on.totals())
    assert back.statistics() == on.statistics()
    old = {k: v for k, v in on.totals().items() if k != "filtered"}
    back.restore_totals(old)
    assert back.statistics().filtered_total == 0
