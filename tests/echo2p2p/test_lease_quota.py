"""The lease quota (`echo2p2p.lease_quota`): a peer's cap on open leases grows with what it
delivered and shrinks with what it let expire; unproven peers each hold their own probation
leases on top of the budget. Values are worked by hand below."""

from hypothesis import given
from hypothesis import strategies as st

from echo2p2p.lease_quota import (Held, LeaseQuota, QuotaPolicy, Standing, cap, may_grant,
                                  latest_s, paced_cap, proven, queue_wait_s)

POLICY = QuotaPolicy(start=2, max_open=64, expiry_cost=2)
NEW = Standing()
GOOD = Standing(delivered=10)  # cap 12


def held(mine: int = 0, here: int = 0, unproven: int = 0, outstanding: int = 0) -> Held:
    return Held(mine, here, unproven, outstanding)


def test_the_cap_starts_small_grows_with_deliveries_and_shrinks_with_expiries():
    assert cap(NEW, POLICY, 64) == 2
    assert cap(Standing(delivered=5), POLICY, 64) == 7
    assert cap(Standing(delivered=5, expired=2), POLICY, 64) == 3
    assert cap(Standing(delivered=500), POLICY, 64) == 64  # the ceiling
    assert cap(Standing(delivered=500), POLICY, None) == 502  # an address has none
    assert cap(Standing(expired=9), POLICY, 64) == 1  # never below one


def test_proven_means_more_delivered_than_let_expire():
    assert not proven(NEW)
    assert proven(Standing(delivered=1))
    assert not proven(Standing(delivered=3, expired=3))


def test_a_new_peer_gets_its_start_and_no_more():
    assert may_grant(NEW, NEW, held(mine=1, here=1, unproven=1), 8, 4, POLICY)
    assert not may_grant(NEW, NEW, held(mine=2, here=2, unproven=2), 8, 4, POLICY)


def test_hoarders_hold_only_the_probation_never_the_budget():
    """Unproven peers hold a lease of the probation even with the budget full of proven
    work; with the probation (or their address's cap) taken, they get none, and a proven
    peer still gets the whole budget beside them. An address whose peers delivered vouches
    for new peers there (a lab behind one NAT), up to the probation."""
    full_budget = held(outstanding=8)
    assert may_grant(NEW, NEW, full_budget, 8, 4, POLICY)
    assert not may_grant(NEW, NEW, held(unproven=4, outstanding=12), 8, 4, POLICY)
    assert not may_grant(NEW, NEW, held(here=2, unproven=2, outstanding=6), 8, 4, POLICY)
    assert may_grant(NEW, GOOD, held(here=2, unproven=2, outstanding=6), 8, 4, POLICY)
    # Proven: 4 unproven leases held on top, 7 of its own work outstanding: one more fits.
    assert may_grant(GOOD, GOOD, held(mine=3, here=7, unproven=4, outstanding=11), 8, 4,
                     POLICY)
    assert not may_grant(GOOD, GOOD, held(mine=4, here=8, unproven=4, outstanding=12), 8, 4,
                         POLICY)


def test_an_address_that_let_leases_expire_gets_fewer():
    burnt = Standing(expired=3)  # its cap is 1
    assert not may_grant(NEW, burnt, held(here=1, outstanding=1), 8, 4, POLICY)
    assert may_grant(NEW, burnt, held(outstanding=1), 8, 4, POLICY)


def test_the_quota_book_counts_per_key():
    book = LeaseQuota()
    book.delivered("p1", "addr:a")
    book.expired("p2", "addr:a")
    assert book.standing("p1") == Standing(1, 0)
    assert book.standing("addr:a") == Standing(1, 1)
    assert book.standing("nobody") == Standing()


@given(delivered=st.integers(0, 100), expired=st.integers(0, 100), mine=st.integers(0, 100),
       unproven=st.integers(0, 30), outstanding=st.integers(0, 100))
def test_no_grant_past_the_cap_the_budget_or_the_probation(delivered, expired, mine,
                                                           unproven, outstanding):
    """Whatever the counts, a grant never takes a peer past its cap, a proven peer's work past
    the budget (unproven leases aside), nor unproven peers' leases past the probation."""
    s = Standing(delivered, expired)
    h = held(mine, mine, min(unproven, mine) if not proven(s) else unproven,
             max(outstanding, mine))
    if may_grant(s, Standing(delivered=1000), h, 8, 4, POLICY):
        assert h.by_identity < cap(s, POLICY, 64)
        if proven(s):
            assert h.outstanding - min(h.unproven, 4) < 8
        else:
            assert h.unproven < 4


def test_hoarders_that_came_first_take_nothing_of_a_new_peers_start():
    """256 leases held by 128 unproven hoarders (each at its own cap, each at an address of its
    own) and a full budget of proven work: a new peer from another address still gets its
    start, and no more."""
    crowd = held(unproven=256, outstanding=8 + 256)
    assert may_grant(NEW, NEW, crowd, 8, 4096, POLICY)
    assert may_grant(NEW, NEW, held(mine=1, here=1, unproven=257, outstanding=265), 8, 4096, POLICY)
    assert not may_grant(NEW, NEW, held(mine=2, here=2, unproven=258, outstanding=266), 8, 4096,
                         POLICY)
    assert not may_grant(NEW, NEW, held(unproven=4096, outstanding=5000), 8, 4096, POLICY)


def test_without_a_probation_share_unproven_peers_take_leases_inside_the_budget():
    """Probation 0 (the hub's S = 0): a new peer gets leases while the budget has room, under
    its cap, and none past the budget."""
    assert may_grant(NEW, NEW, held(mine=1, here=1, unproven=1, outstanding=3), 4, 0, POLICY)
    assert not may_grant(NEW, NEW, held(unproven=0, outstanding=4), 4, 0, POLICY)
    assert not may_grant(NEW, NEW, held(mine=2, here=2, unproven=2, outstanding=2), 4, 0, POLICY)



def test_a_peer_holds_what_it_finishes_in_one_timeout_at_its_measured_pace():
    assert paced_cap(None, 60.0) is None  # not measured: the standing's cap alone
    assert paced_cap(20.0, 60.0) == 3
    assert paced_cap(25.0, 60.0) == 2
    assert paced_cap(90.0, 60.0) == 1  # slower than the timeout: still one at a time
    assert paced_cap(0.5, 60.0) == 120  # a fast peer: the standing's cap decides


def test_a_queued_lease_waits_for_the_ones_ahead_of_it_at_most_a_timeout_each():
    assert queue_wait_s(0, 20.0, 60.0) == 0.0  # nothing ahead: the timeout runs at once
    assert queue_wait_s(2, 20.0, 60.0) == 40.0
    assert queue_wait_s(2, 90.0, 60.0) == 120.0  # slower than the timeout: a timeout each
    assert queue_wait_s(1, None, 60.0) == 60.0  # not measured: a whole timeout per lease ahead
    assert queue_wait_s(3, None, 60.0) == 180.0
    assert latest_s(0, 60.0) == 60.0 and latest_s(3, 60.0) == 240.0


@given(st.integers(0, 100), st.one_of(st.none(), st.floats(0.001, 1e4)), st.floats(0.1, 1e4))
def test_a_first_deadline_is_never_past_the_latest_renewal(ahead, group_s, timeout_s):
    assert 0.0 <= queue_wait_s(ahead, group_s, timeout_s) + timeout_s <= \
        latest_s(ahead, timeout_s) * (1 + 1e-12)
