"""The overlap capacity model: the provisioning rule in both readings, schedules, busy fraction."""

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from echo2p2p.capacity import (Reading, Workload, broadcast_s, feasible_schedules,
                               predicted_busy_fraction, predicted_stale_fraction,
                               predicted_staleness, required_throughput, smallest_schedule)
from echo2p2p.errors import ConfigError

SEQ, OVL = Reading.SEQUENTIAL, Reading.OVERLAPPED

rates = st.floats(0.1, 1e5)
seconds = st.floats(0.01, 1e4)
bcasts = st.floats(0.0, 1e4)
readings = st.sampled_from(list(Reading))


@st.composite
def workloads(draw):
    max_lag = draw(st.integers(0, 8))
    return Workload(draw(rates), draw(seconds), draw(bcasts), max_lag,
                    draw(st.integers(1, max_lag + 1)))


def test_sequential_hand_computed():
    """R=64, T=30 s, T_bcast=12 s, kappa=2: 2*64 / (2*30 - 12) = 128/48 = 2.667 rollouts/s."""
    need = required_throughput(Workload(64, 30.0, 12.0, max_lag=4, kappa=2), SEQ)
    assert need.feasible and need.reading is SEQ
    assert need.rollouts_per_s == pytest.approx(128 / 48)
    assert "sequential" in need.reason


def test_overlapped_hand_computed():
    """Same workload, overlapped: 64 / 30 = 2.133 rollouts/s; the 12 s broadcast fits in 60 s."""
    need = required_throughput(Workload(64, 30.0, 12.0, max_lag=4, kappa=2), OVL)
    assert need.feasible and need.rollouts_per_s == pytest.approx(64 / 30)
    assert "overlapped" in need.reason


def test_broadcast_longer_than_period_is_infeasible_with_reason():
    """T_bcast=12 s > kappa*T_train = 1*10 s: both readings say no, name both times and the fix."""
    w = Workload(64, 10.0, 12.0, max_lag=0, kappa=1)
    for reading in Reading:
        need = required_throughput(w, reading)
        assert not need.feasible and need.rollouts_per_s is None
        assert "12.0 s" in need.reason and "10.0 s" in need.reason
        assert "raise kappa or S" in need.reason
        assert "kappa >= 2 fits, with S >= 1" in need.reason  # 2*10 = 20 s > 12 s


def test_equal_broadcast_and_period_splits_the_readings():
    """T_bcast = kappa*T_train = 12 s leaves no time to generate (sequential) but is enough when
    workers generate during the download (overlapped: 64/12 = 5.333/s)."""
    w = Workload(64, 12.0, 12.0, max_lag=0, kappa=1)
    assert not required_throughput(w, SEQ).feasible
    assert required_throughput(w, OVL).rollouts_per_s == pytest.approx(64 / 12)


def test_busy_fraction_hand_computed():
    """Below the requirement the learner waits for the slower side."""
    w = Workload(64, 30.0, 12.0, max_lag=4, kappa=2)
    # sequential, mu = 1/s: period 2*30 = 60 s vs 12 + 2*64/1 = 140 s  ->  60/140
    assert predicted_busy_fraction(w, 1.0, SEQ) == pytest.approx(60 / 140)
    # overlapped, mu = 1/s: 30 s of training per 64 s of generating  ->  30/64
    assert predicted_busy_fraction(w, 1.0, OVL) == pytest.approx(30 / 64)
    # overlapped with a broadcast (12 s) longer than the period (10 s), ample pool:
    # R/mu = 0.64 s < 10 s, but a version only every 12 s  ->  10/12
    slow = Workload(64, 10.0, 12.0, max_lag=0, kappa=1)
    assert predicted_busy_fraction(slow, 100.0, OVL) == pytest.approx(10 / 12)
    assert predicted_busy_fraction(w, 0.0, SEQ) == 0.0
    assert predicted_busy_fraction(w, 128 / 48, SEQ) == 1.0


def test_schedules_hand_computed():
    """T_train=10 s, T_bcast=20 s: sequential needs kappa*10 > 20 (kappa >= 3), overlapped
    kappa*10 >= 20 (kappa >= 2); S is then kappa - 1 at least."""
    assert smallest_schedule(10.0, 20.0, SEQ) == (2, 3)
    assert smallest_schedule(10.0, 20.0, OVL) == (1, 2)
    assert feasible_schedules(10.0, 20.0, OVL, max_lag_limit=3) == [
        (1, 2), (2, 2), (2, 3), (3, 2), (3, 3), (3, 4)]
    assert feasible_schedules(10.0, 0.0, SEQ, max_lag_limit=1) == [(0, 1), (1, 1), (1, 2)]
    assert smallest_schedule(1.0, 100.0, OVL) is None  # kappa=100 needs S=99 > 16
    assert feasible_schedules(1.0, 100.0, OVL) == []


@pytest.mark.parametrize("field, kwargs", [
    ("rollouts_per_step", dict(rollouts_per_step=0)),
    ("rollouts_per_step", dict(rollouts_per_step=-5)),
    ("rollouts_per_step", dict(rollouts_per_step=math.nan)),
    ("train_step_s", dict(train_step_s=0.0)),
    ("train_step_s", dict(train_step_s=math.inf)),
    ("bcast_s", dict(bcast_s=-1.0)),
    ("bcast_s", dict(bcast_s=math.nan)),
    ("max_lag", dict(max_lag=-1)),
    ("kappa", dict(kappa=0)),
    ("kappa", dict(kappa=6)),  # > S + 1 = 5
])
def test_workload_rejects_bad_fields_by_name(field, kwargs):
    """Workload refuses zero, negative, NaN or infinite values and kappa > S + 1, by name."""
    base = dict(rollouts_per_step=64, train_step_s=30.0, bcast_s=12.0, max_lag=4, kappa=2)
    with pytest.raises(ConfigError) as info:
        Workload(**(base | kwargs))
    assert info.value.field == field


@settings(deadline=None)
@given(workloads(), readings)
def test_verdict_is_a_number_or_a_reason(w, reading):
    """Feasible: a finite positive throughput. Infeasible: None and a sentence. Never negative."""
    need = required_throughput(w, reading)
    if need.feasible:
        assert need.rollouts_per_s is not None
        assert math.isfinite(need.rollouts_per_s) and need.rollouts_per_s > 0
    else:
        assert need.rollouts_per_s is None and "broadcast" in need.reason


@settings(deadline=None)
@given(workloads(), rates, readings)
def test_required_grows_with_rollouts_per_step(w, other_r, reading):
    """More rollouts per step never need less throughput."""
    lo, hi = sorted((w.rollouts_per_step, other_r))
    a = required_throughput(Workload(lo, w.train_step_s, w.bcast_s, w.max_lag, w.kappa), reading)
    b = required_throughput(Workload(hi, w.train_step_s, w.bcast_s, w.max_lag, w.kappa), reading)
    assert a.feasible == b.feasible
    if a.feasible:
        assert a.rollouts_per_s <= b.rollouts_per_s


@settings(deadline=None)
@given(rates, st.integers(1, 8), seconds, seconds, bcasts, bcasts)
def test_sequential_requirement_falls_as_the_gap_grows(r, kappa, t1, t2, b1, b2):
    """At fixed kappa and R, a wider kappa*T_train - T_bcast never needs more throughput."""
    w1, w2 = (Workload(r, t, b, kappa, kappa) for t, b in ((t1, b1), (t2, b2)))
    gap1, gap2 = kappa * t1 - b1, kappa * t2 - b2
    assume(0 < gap1 <= gap2)
    need1, need2 = required_throughput(w1, SEQ), required_throughput(w2, SEQ)
    assert need1.rollouts_per_s >= need2.rollouts_per_s


@settings(deadline=None)
@given(workloads(), readings, st.floats(0, 1e6), st.floats(0, 1e6))
def test_more_throughput_never_lowers_busy_fraction(w, reading, mu1, mu2):
    """Adding a worker never lowers predicted utilization, which stays in [0, 1]."""
    lo, hi = sorted((mu1, mu2))
    a, b = predicted_busy_fraction(w, lo, reading), predicted_busy_fraction(w, hi, reading)
    assert 0.0 <= a <= b <= 1.0


@settings(deadline=None)
@given(workloads(), readings, st.floats(0, 1e6))
def test_busy_is_one_exactly_when_the_requirement_is_met(w, reading, mu):
    """Busy fraction is 1 at or above a feasible requirement and below 1 everywhere else."""
    need = required_throughput(w, reading)
    busy = predicted_busy_fraction(w, mu, reading)
    met = need.feasible and mu >= need.rollouts_per_s
    assert (busy == 1.0) == met
    if need.feasible:
        assert predicted_busy_fraction(w, need.rollouts_per_s, reading) == 1.0


def test_busy_fraction_rejects_negative_throughput():
    """A negative or NaN pool throughput is a caller bug, not a prediction."""
    w = Workload(64, 30.0, 12.0, 4, 2)
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError):
            predicted_busy_fraction(w, bad, SEQ)


@settings(deadline=None)
@given(seconds, bcasts, readings, st.integers(0, 12))
def test_schedules_agree_and_respect_kappa_bound(train_s, bcast_s, reading, limit):
    """smallest_schedule is the first of feasible_schedules; every listed (S, kappa) has
    kappa <= S + 1 and is feasible; every unlisted one in range is not."""
    listed = feasible_schedules(train_s, bcast_s, reading, limit)
    assert smallest_schedule(train_s, bcast_s, reading, limit) == (listed[0] if listed else None)
    assert listed == sorted(listed)
    for s in range(limit + 1):
        for kappa in range(1, s + 2):
            ok = required_throughput(Workload(1.0, train_s, bcast_s, s, kappa), reading).feasible
            assert ok == ((s, kappa) in listed)


def test_staleness_hand_computed():
    """kappa=2, b = T_bcast/T_train = 0.5. Even step t: starts over [t-1, t) see version t-2
    (lag 2). Odd step t: [t-1, t-0.5) still sees t-3 (lag 3), [t-0.5, t) sees t-1 (lag 1).
    Averaged over the two phases: {1: 1/4, 2: 1/2, 3: 1/4}."""
    dist = predicted_staleness(Workload(64, 10.0, 5.0, max_lag=4, kappa=2))
    assert dist == pytest.approx({1: 0.25, 2: 0.5, 3: 0.25})
    assert predicted_staleness(Workload(64, 10.0, 0.0, max_lag=1, kappa=1)) == {1: 1.0}
    assert predicted_staleness(Workload(64, 10.0, 5.0, max_lag=0, kappa=1)) == {0: 1.0}


@settings(deadline=None)
@given(st.floats(0.1, 100), st.floats(0, 50), st.integers(1, 8))
def test_staleness_is_a_distribution_with_known_mean(train_s, bcast_s, kappa):
    """Shares sum to 1 over lags >= 1, with mean lag b + (kappa + 1)/2 (b = T_bcast/T_train)."""
    dist = predicted_staleness(Workload(64, train_s, bcast_s, max_lag=kappa, kappa=kappa))
    assert min(dist) >= 1 and all(p > 0 for p in dist.values())
    assert sum(dist.values()) == pytest.approx(1.0)
    mean = sum(lag * p for lag, p in dist.items())
    assert mean == pytest.approx(bcast_s / train_s + (kappa + 1) / 2, rel=1e-6, abs=1e-6)


def test_stale_fraction_hand_computed():
    """Lags reach kappa + ceil(b). S=2, kappa=2, b=0.5: lag 3 (a quarter) is dropped; S=3 keeps
    all. With b = 0 lags are uniform on 1..kappa, so kappa = S + 1 (allowed by check_schedule)
    already drops the 1/kappa of lag kappa: here kappa=2 -> 1/2."""
    assert predicted_stale_fraction(Workload(64, 10.0, 5.0, max_lag=2, kappa=2)) == 0.25
    assert predicted_stale_fraction(Workload(64, 10.0, 5.0, max_lag=3, kappa=2)) == 0.0
    assert max(predicted_staleness(Workload(64, 10.0, 3.0, max_lag=8, kappa=3))) == 4
    assert max(predicted_staleness(Workload(64, 10.0, 10.0, max_lag=8, kappa=2))) == 3
    assert predicted_stale_fraction(Workload(64, 10.0, 0.0, max_lag=1, kappa=2)) == 0.5


def test_broadcast_time_hand_computed():
    """1 GB to 4 workers (uplinks 100, 100, 200, 400 Mbit/s) from a 1 Gbit/s hub: a star sends
    4 copies (32 s); the overlay is held to (1000 + 800) / 4 = 450 Mbit/s (x1.4: 24.9 s); the
    striped chain to 4/3 of the slowest uplink, 133 Mbit/s (x1.4: 84 s)."""
    uplinks = [100e6, 100e6, 200e6, 400e6]
    assert broadcast_s(1e9, 1e9, uplinks, "star") == pytest.approx(32.0)
    for overlay in ("pipelined", "gossip"):
        assert broadcast_s(1e9, 1e9, uplinks, overlay) == pytest.approx(1.4 * 8e9 / 450e6)
    assert broadcast_s(1e9, 1e9, uplinks, "striped-chain") == pytest.approx(1.4 * 8e9 / (400e6 / 3))


def test_broadcast_time_is_held_to_the_hub_uplink():
    """Fast workers never make a version reach them faster than the hub can send it once, and a
    lone worker gets it at the hub's rate whatever the relay."""
    assert broadcast_s(1e9, 1e9, [10e9] * 8, "pipelined") == pytest.approx(1.4 * 8.0)
    for relay in ("pipelined", "striped-chain"):
        assert broadcast_s(1e9, 1e9, [10e9], relay) == pytest.approx(1.4 * 8.0)
    assert broadcast_s(1e9, 1e9, [10e9], "star") == pytest.approx(8.0)
