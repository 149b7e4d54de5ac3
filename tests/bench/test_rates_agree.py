"""The rates a user sees agree wherever they are shown: a real `echo2-hub demo` on the tiny
model, read from its terminal lines, `echo2-hub status`, /status, /metrics, the dashboard's feed
and `echo2-hub report` (`bench.rates_agree`)."""

from __future__ import annotations

import pytest

from bench import rates_agree


@pytest.mark.system
def test_every_surface_shows_the_same_rates_on_a_real_demo(tmp_path):
    """Each step figure equals the run log's record of its step to the places shown; the live
    figures agree between surfaces; the peers' admitted/s add up to the hub's, and a peer's
    generation rate while busy is never below what it had admitted (named apart: they differ
    whenever peers wait for leases)."""
    result = rates_agree.run(12, tmp_path / "run")
    assert result["disagreements"] == []
    live, records = result["live"]["/status"], result["records"]
    overall = records[live["step"]]["rollout/per_s"]
    admitted = [a for a, _ in live["peers"].values()]
    assert len(admitted) == 2 and overall > 0
    assert sum(admitted) == pytest.approx(overall, rel=0.2)
    assert all(gen >= a for a, gen in live["peers"].values())
    assert live["gen/s (active)"] == pytest.approx(sum(g for _, g in live["peers"].values()),
                                                   rel=0.01)
    assert set(result["terminal"]) == set(records)
