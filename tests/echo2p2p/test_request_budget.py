"""Request budgets: a burst is served at once, then requests wait their turn, then they are
refused (and held a moment), and past the open bound dropped; addresses and route classes are
counted apart. Synchronous, with explicit `now`."""

from __future__ import annotations

import pytest

from echo2p2p.join_limits import Rate
from echo2p2p.request_budget import (CHUNKS, DROP, FILES, PAGES, REFUSE, REFUSED_AFTER_S, SERVE,
                                     STREAMS, RequestBudget, RouteLimit, hub_limits)


def budget(per_min: float = 60, burst: int = 2, max_wait_s: float = 2.0, max_open: int = 10,
           **kwargs) -> RequestBudget:
    return RequestBudget({PAGES: RouteLimit(Rate(per_min, burst), max_wait_s, max_open)}, **kwargs)


def test_a_burst_is_served_at_once_then_each_waits_its_turn_then_refused():
    """Burst 2 at 1/s: two at once, the next two after 1 s and 2 s (within the 2 s wait), the
    fifth refused, answered after REFUSED_AFTER_S, with Retry-After for its turn, no token spent."""
    b = budget()
    verdicts = [b.admit(PAGES, "a", 0.0) for _ in range(5)]
    assert [(v.action, v.delay_s) for v in verdicts[:4]] == [
        (SERVE, 0.0), (SERVE, 0.0), (SERVE, pytest.approx(1.0)), (SERVE, pytest.approx(2.0))]
    assert verdicts[4].action == REFUSE and verdicts[4].delay_s == REFUSED_AFTER_S
    assert verdicts[4].retry_after_s == 3
    for _ in range(5):
        b.done(PAGES, "a")
    # the refusal spent nothing: at t=1 the debt is 1 token, so the next one waits 2 s again
    assert b.admit(PAGES, "a", 1.0).delay_s == pytest.approx(2.0)
    stats = b.statistics()
    assert stats.served == {PAGES: 5}
    assert stats.limited == {(PAGES, "delayed"): 3, (PAGES, "refused"): 1}


def test_a_paced_client_is_never_delayed():
    """One request a second at 1/s after the burst is spent: served at once every time."""
    b = budget(burst=1)
    for t in range(20):
        v = b.admit(PAGES, "a", float(t))
        assert (v.action, v.delay_s) == (SERVE, 0.0)
        b.done(PAGES, "a")


def test_addresses_and_route_classes_have_buckets_of_their_own():
    b = RequestBudget({PAGES: RouteLimit(Rate(60, 1), 0.0, 10),
                       FILES: RouteLimit(Rate(60, 1), 0.0, 10)})
    assert b.admit(PAGES, "a", 0.0).action == SERVE
    assert b.admit(PAGES, "a", 0.0).action == REFUSE  # no wait allowed: refused at once
    assert b.admit(PAGES, "b", 0.0).action == SERVE
    assert b.admit(FILES, "a", 0.0).action == SERVE


def test_open_requests_are_bounded_per_address_and_in_all():
    """Past max_open open requests of one address, or MAX_OPEN of all, a request is dropped
    (not counted as open); one answered makes room again."""
    b = RequestBudget({PAGES: RouteLimit(Rate(0, 1), 2.0, 3)}, max_open=5)
    assert [b.admit(PAGES, "a", 0.0).action for _ in range(4)] == [SERVE] * 3 + [DROP]
    assert b.open_requests(PAGES, "a") == 3
    assert [b.admit(PAGES, "b", 0.0).action for _ in range(3)] == [SERVE, SERVE, DROP]  # 5 in all
    b.done(PAGES, "a")
    assert b.admit(PAGES, "b", 0.0).action == SERVE
    assert b.statistics().open == 5
    assert b.statistics().limited == {(PAGES, "dropped"): 2}


def test_held_refusals_count_as_open():
    """A refused request is held before its answer: it counts against the open bound."""
    b = RequestBudget({PAGES: RouteLimit(Rate(60, 1), 0.0, 2)})
    assert [b.admit(PAGES, "a", 0.0).action for _ in range(3)] == [SERVE, REFUSE, DROP]


def test_the_open_counts_forget_addresses_with_nothing_open():
    b = budget(per_min=0)
    for n in range(1000):
        b.admit(PAGES, n, 0.0)
        b.done(PAGES, n)
    assert b._open == {} and b.statistics().open == 0


def test_the_hubs_classes_serve_a_nat_of_peers_without_a_wait():
    """A lab of 16 peers behind one address joining at once (8 model files each), 1000 chunk
    requests in ten seconds, and 20 viewers loading the page at once, are never delayed."""
    b = RequestBudget(hub_limits(600, 120))
    assert all(b.admit(FILES, "nat", 0.0).delay_s == 0 for _ in range(16 * 8))
    assert all(b.admit(CHUNKS, "nat", i / 100).delay_s == 0 for i in range(1000))
    assert all(b.admit(PAGES, "nat", 0.0).delay_s == 0 for _ in range(20 * 6))
    assert all(b.admit(STREAMS, "nat", 0.0).delay_s == 0 for _ in range(20))
