"""The log budget: the first lines of a kind in a window are logged, the rest counted and told
once when the window ends; kinds are counted apart and bounded. Synchronous, explicit `now`."""

from __future__ import annotations

import logging

from echo2p2p.log_budget import OTHER, LogBudget, Suppressed

INFO, WARNING = logging.INFO, logging.WARNING


def test_a_flood_of_one_kind_logs_its_budget_and_is_told_once_at_the_windows_end():
    b = LogBudget(lines_per_window=3, window_s=60.0)
    logged = [b.admit("relay", INFO, t / 100) for t in range(10_000)]  # 100 s of lines...
    assert logged[:3] == [True] * 3 and not any(logged[3:])  # ...all in one window (t < 60 s)
    assert b.due(59.9) == []
    assert b.due(60.0) == [Suppressed("relay", 9_997, INFO, 60.0)]
    assert b.due(60.0) == []  # told once
    assert b.admit("relay", INFO, 200.0)  # a new window: its own budget
    assert b.window_end == 260.0


def test_kinds_are_counted_apart_and_the_highest_level_held_back_is_told():
    b = LogBudget(lines_per_window=1)
    assert b.admit("a", INFO, 0.0) and b.admit("b", INFO, 0.0)
    assert not b.admit("a", INFO, 1.0) and not b.admit("a", WARNING, 2.0)
    assert b.holding and b.due(60.0) == [Suppressed("a", 2, WARNING, 60.0)]


def test_a_window_with_nothing_held_back_tells_nothing():
    b = LogBudget(lines_per_window=5)
    for t in range(5):
        assert b.admit("a", INFO, float(t))
    assert not b.holding and b.due(100.0) == [] and b.window_end is None


def test_kinds_past_the_bound_share_one_budget():
    """A caller whose kinds carry a peer's text cannot grow the table: past max_kinds, new kinds
    share OTHER's budget."""
    b = LogBudget(lines_per_window=2, max_kinds=3)
    assert all(b.admit(k, INFO, 0.0) for k in "abc")
    assert [b.admit(f"x{i}", INFO, 0.0) for i in range(100)] == [True, True] + [False] * 98
    assert b.due(60.0) == [Suppressed(OTHER, 98, INFO, 60.0)]
