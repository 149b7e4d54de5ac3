"""The capacity estimates the learner loop keeps: EWMAs, the workload, what peers must deliver."""

from __future__ import annotations

import pytest

from echo2p2p.capacity import Reading, required_throughput
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.learning.estimates import Estimates


def test_first_measurement_is_taken_as_is_then_averaged():
    """An EWMA starts at its first measurement; each later one weighs 0.3."""
    est = Estimates(HubConfig())
    est.observe_train_step(2.0)
    est.observe_train_step(1.0)
    est.observe_broadcast(4.0)
    assert est.train_step_s == pytest.approx(0.7 * 2.0 + 0.3 * 1.0)
    assert est.bcast_s == 4.0


def test_every_peer_works_until_a_step_was_timed_or_with_s_zero():
    """No requirement (None: every peer active) before a step was timed, or when S = 0."""
    untimed = Estimates(HubConfig.from_flat(max_lag=1))
    assert untimed.required_rollouts_per_s() is None
    assert "needs a measured learner step" in untimed.metrics(0.0, None)["capacity/required_why"]
    synchronous = Estimates(HubConfig.from_flat(max_lag=0))
    synchronous.observe_train_step(1.0)
    assert synchronous.required_rollouts_per_s() is None
    assert "S = 0" in synchronous.metrics(0.0, None)["capacity/required_why"]


def test_a_broadcast_slower_than_a_period_says_so_in_the_metrics():
    """A broadcast longer than kappa*T_train: no requirement, and the model's sentence (raise
    kappa or S) in `capacity/required_why`, which the dashboard and the report show."""
    est = Estimates(HubConfig.from_flat(max_lag=2, publish_every=1))
    est.observe_train_step(0.05)
    est.observe_broadcast(0.08)
    assert est.required_rollouts_per_s() is None
    metrics = est.metrics(100.0, None)
    assert metrics["capacity/required_rollouts_per_s"] is None
    assert "raise kappa or S" in metrics["capacity/required_why"]


def test_requirement_and_metrics_follow_the_capacity_model():
    """Once timed, the requirement is the capacity model's (overlapped reading) on the
    measured workload, and the metrics carry the estimates."""
    cfg = HubConfig.from_flat(max_lag=2, publish_every=1, prompts_per_step=4, group_size=8)
    est = Estimates(cfg)
    est.observe_train_step(0.5)
    est.observe_broadcast(0.1)
    workload = est.workload()
    assert (workload.train_step_s, workload.bcast_s) == (0.5, 0.1)
    expected = required_throughput(workload, Reading.OVERLAPPED).rollouts_per_s
    assert est.required_rollouts_per_s() == pytest.approx(expected)
    metrics = est.metrics(100.0, expected)
    assert metrics["capacity/train_step_s"] == 0.5 and metrics["capacity/bcast_s"] == 0.1
    assert metrics["capacity/gen_rollouts_per_s"] == 100.0
    assert metrics["capacity/required_rollouts_per_s"] == round(expected, 2)
    assert metrics["capacity/required_why"] is None
    assert 0.0 <= metrics["capacity/predicted_busy_frac"] <= 1.0
