"""Windowed rates (`echo2p2p.rates`), explicit clocks: one definition for every rate shown."""

from __future__ import annotations

import pytest

from echo2p2p.rates import BusyRate, WindowSum


def test_a_window_sum_counts_the_last_window_over_the_seconds_it_covers():
    """Per second over the window, or over the time since `since` while that is shorter;
    amounts older than the window fall out."""
    rate = WindowSum(since=100.0, window_s=60.0)
    assert rate.per_s(100.0) == 0.0
    for t in range(101, 131):  # 8 a second for 30 s
        rate.add(float(t), 8)
    assert rate.per_s(130.0) == pytest.approx(240 / 30)
    assert rate.per_s(160.0) == pytest.approx(240 / 60)  # the same events, a full window
    assert rate.per_s(175.0) == pytest.approx(8 * 15 / 60)  # t <= 115 fell out
    assert rate.total(300.0) == 0.0 and rate.per_s(300.0) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        WindowSum(0.0, window_s=0.0)


def test_busy_rate_is_a_ratio_of_sums_so_bursty_arrivals_do_not_inflate_it():
    """Submissions of 8 completions that took 20 ms each, seen by a hub whose loop bunched
    them: alternately 2 ms and 38 ms apart. The rate is 8 per 20 ms = 400/s; an average of
    per-submission rates (what the hub used to keep) reads 2,105/s, five times too high."""
    rate, t, ratios = BusyRate(since=0.0), 0.0, []
    for i in range(40):
        busy = 0.002 if i % 2 else 0.038
        t += busy
        rate.add(t, 8, busy)
        ratios.append(8 / busy)
    assert rate.last == pytest.approx(400.0)
    assert sum(ratios) / len(ratios) > 5 * rate.last


def test_busy_rate_keeps_its_last_measure_when_the_window_empties():
    """A peer on standby makes nothing: its rate stays what it was, not 0 (0 means on trial)."""
    rate = BusyRate(since=0.0, window_s=10.0)
    assert rate.add(1.0, 8, 0.5) == pytest.approx(16.0)
    assert rate.add(100.0, 0, 0.0) == pytest.approx(16.0)
