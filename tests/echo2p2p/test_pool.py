"""The hub's pool: who is active, on trial or on standby, and the cost meter (explicit clocks)."""

from __future__ import annotations

import pytest

from echo2p2p.pool import Pool


def joined(pool: Pool, now: float = 0.0, **peers: tuple[float, float]) -> None:
    """Join peers given as name=(price $/h, measured rollouts/s; 0 = not measured yet)."""
    for name, (price, rate) in peers.items():
        pool.join(name, name, price, generates=True, now=now)
        if rate:
            pool.rate(name, rate, 1.0, now)  # `rate` completions in one busy second


def active(pool: Pool) -> set[str]:
    return {p for p in pool.accounts if pool.is_active(p)}


def test_everyone_works_until_a_requirement_is_known():
    pool = Pool()
    joined(pool, cheap=(0.5, 10.0), dear=(3.0, 10.0))
    assert pool.replan(None, 1.0) == ([], [])
    assert active(pool) == {"cheap", "dear"}


def test_cheapest_cover_works_and_the_rest_waits_on_standby():
    pool = Pool(margin=0.1)
    joined(pool, free=(0.0, 4.0), cheap=(0.5, 10.0), dear=(3.0, 10.0))
    activated, standby = pool.replan(12.0, 1.0)  # needs 13.2: free + cheap
    assert activated == [] and standby == ["dear"]
    assert active(pool) == {"free", "cheap"}
    assert pool.usd_per_hour() == pytest.approx(0.5)
    assert pool.lp_bound() == pytest.approx(0.5 * (13.2 - 4.0) / 10.0)


def test_unmeasured_and_relay_peers_stay_active():
    pool = Pool()
    joined(pool, known=(0.5, 10.0), new=(0.1, 0.0))
    pool.join("relay", "relay", 1.0, generates=False, now=0.0)
    pool.replan(1.0, 1.0)
    assert active(pool) == {"known", "new", "relay"}
    pool.rate("new", 50, 1.0, 1.0)  # measured now: cheaper per rollout, and enough alone
    pool.activator.switch_gain, pool.activator.patience = 0.0, 1
    assert pool.replan(1.0, 2.0) == ([], ["known"])


def test_policy_all_never_puts_anyone_on_standby():
    pool = Pool(policy="all")
    joined(pool, cheap=(0.5, 10.0), dear=(3.0, 10.0))
    pool.replan(1.0, 1.0)
    assert active(pool) == {"cheap", "dear"}
    with pytest.raises(ValueError, match="policy"):
        Pool(policy="cheapest")


def test_cost_accrues_only_while_active_and_survives_leaving():
    pool = Pool(margin=0.0)
    joined(pool, 0.0, a=(3.6, 10.0), b=(7.2, 10.0))  # $0.001/s and $0.002/s
    pool.replan(5.0, 100.0)  # a alone covers 5/s: b on standby after 100 s
    assert pool.usd_total(100.0) == pytest.approx(0.1 + 0.2)
    assert pool.usd_total(1100.0) == pytest.approx(0.3 + 1.0)  # only a accrued
    pool.replan(15.0, 1100.0)  # b back
    pool.leave("a", 1200.0)
    assert pool.usd_total(1200.0) == pytest.approx(1.3 + 0.1 + 0.2)
    pool.accounts["b"].admitted = 1000
    pool.admitted_left = 1000
    meter = pool.meter(1200.0)
    assert meter["cost/usd_per_1k_rollouts"] == pytest.approx(1.6 / 2)
    assert meter["pool/active"] == 1 and meter["cost/usd_per_hour"] == pytest.approx(7.2)


def test_noisy_rates_do_not_flap_the_active_set():
    """Rates with +-5 % noise and the requirement with +-3 % at every re-plan: a fresh plan each
    time would change the set dozens of times; with the pool's hysteresis it barely moves."""
    import random

    from echo2p2p.activation import PricedWorker, choose_active

    rng = random.Random(3)
    base = {f"w{i}": (0.3 + 0.1 * i, 2.0 + i) for i in range(12)}
    pool = Pool(margin=0.1)
    joined(pool, **base)
    pool.replan(20.0, 0.0)
    changes = fresh_changes = 0
    fresh = set(pool.plan.active)
    for step in range(1, 200):
        for name, (_, rate) in base.items():
            pool.accounts[name].gen_rollouts_per_s = rate * rng.uniform(0.95, 1.05)
        required = 20.0 * rng.uniform(0.97, 1.03)
        activated, standby = pool.replan(required, float(step))
        changes += len(activated) + len(standby)
        assert pool.plan.rollouts_per_s >= required  # never short of the requirement itself
        now = set(choose_active([PricedWorker(n, a.price_per_hour, a.gen_rollouts_per_s)
                                 for n, a in pool.accounts.items()], required, 0.1).active)
        fresh_changes += len(now ^ fresh)
        fresh = now
    assert fresh_changes >= 20
    assert changes <= 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_poisoned_price_or_rate_is_refused_where_it_enters(bad):
    """A non-finite or negative price (join) or rate (measurement) raises ValueError at once,
    so the cost meter and later plans never hold it (the wire refuses them before this)."""
    pool = Pool()
    with pytest.raises(ValueError, match="price_per_hour"):
        pool.join("a", "a", bad, generates=True, now=0.0)
    assert "a" not in pool.accounts
    pool.join("b", "b", 1.0, generates=True, now=0.0)
    with pytest.raises(ValueError, match="busy_s"):
        pool.rate("b", 5, bad, 0.0)
    assert pool.accounts["b"].gen_rollouts_per_s == 0.0
    pool.rate("b", 5, 1.0, 0.0)
    pool.replan(1.0, 1.0)
    assert pool.usd_total(3600.0) == pytest.approx(1.0)


def test_admitted_rates_per_peer_and_overall_over_the_window():
    """Admitted/s: a peer's completions over the last 60 s of admissions (or since it joined),
    and the pool's, which keeps counting a peer that left; generation while busy is another
    number (completions over busy seconds), never mixed with it."""
    pool = Pool()
    pool.join("a", "a", 0.0, generates=True, now=0.0)
    pool.join("b", "b", 0.0, generates=True, now=10.0)
    for t in range(10, 30):  # a: 8 every second; b: 8 every other second
        pool.admitted("a", 8, float(t))
        if t % 2 == 0:
            pool.admitted("b", 8, float(t))
    pool.rate("a", 8, 0.01, 29.0)  # it made 8 in 10 ms: 800/s while busy
    assert pool.per_peer(30.0)["a"]["admitted_per_s"] == pytest.approx(160 / 30, abs=1e-3)
    assert pool.per_peer(30.0)["b"]["admitted_per_s"] == pytest.approx(80 / 20, abs=1e-3)
    assert pool.per_peer(30.0)["a"]["gen_rollouts_per_s"] == pytest.approx(800)
    assert pool.admitted_per_s(30.0) == pytest.approx(240 / 30)
    pool.leave("b", 30.0)
    assert pool.admitted_per_s(30.0) == pytest.approx(240 / 30)
    assert pool.admitted_per_s(75.0) == pytest.approx(8 * (14 + 7) / 60)  # t > 15, b's too
