"""Relay pace (echo2p2p.pace): the rate a receiver may expect of a relay, when a chunk came far
slower than that, and the rate each plan's sources carry."""

from __future__ import annotations

import math
import struct

from echo2p2p.pace import (GRACE_S, SLACK, measured_bps, per_request_bps, share_rate_bps,
                           slow_after_s, too_slow)
from echo2p2p.relay import Broadcast, Member

MBIT = 1e6


def test_a_relays_upload_is_shared_among_those_that_pull_from_it():
    """Each of 4 receivers may expect a quarter of the relay's measured upload."""
    assert share_rate_bps(100 * MBIT, 4) == 25 * MBIT
    assert share_rate_bps(100 * MBIT, 0) == 100 * MBIT  # nobody else pulls: all of it


def test_requests_in_flight_to_one_source_share_its_rate():
    """A striped chain's 32 requests to its parent each wait their turn: 1/32 of the rate."""
    assert per_request_bps(64 * MBIT, 32) == 2 * MBIT
    assert per_request_bps(64 * MBIT, 0) == 64 * MBIT


def test_an_unmeasured_or_absurd_upload_promises_nothing():
    """No rate (0.0) from an upload that is not a positive finite number."""
    for upload in (0.0, -5.0, math.inf, math.nan):
        assert share_rate_bps(upload, 3) == 0.0


def test_a_chunk_far_slower_than_its_rate_is_slow():
    """1 MiB at 8 Mbit/s takes ~1 s: past wait + grace + SLACK transfer times it is slow."""
    nbytes, rate = 1 << 20, 8 * MBIT
    limit = slow_after_s(nbytes, rate, wait_s=5.0)
    assert limit == 5.0 + GRACE_S + SLACK * 8 * nbytes / rate
    assert not too_slow(nbytes, limit - 0.01, rate, wait_s=5.0)
    assert too_slow(nbytes, limit + 0.01, rate, wait_s=5.0)


def test_the_slow_relay_of_issue_28_is_slow_and_an_honest_one_is_not():
    """A 100 KB chunk of a relay measured at 800 Mbit/s (one receiver): headers after 9 s and
    the body 3 s later is slow; the same chunk in 50 ms, or after a 5 s long poll for the
    relay's own copy, is not."""
    rate = share_rate_bps(800 * MBIT, 1)
    assert too_slow(100_000, 12.0, rate, wait_s=5.0)
    assert not too_slow(100_000, 0.05, rate, wait_s=5.0)
    assert not too_slow(100_000, 5.5, rate, wait_s=5.0)


def test_without_a_rate_nothing_is_slow():
    """No usable rate, no judgement: the download's deadlines still apply."""
    assert slow_after_s(1 << 20, 0.0) == math.inf
    assert not too_slow(1 << 20, 1e9, 0.0)
    assert not too_slow(1 << 20, math.nan, 8 * MBIT)


def test_measured_rate():
    assert measured_bps(1_000_000, 2.0) == 4 * MBIT
    assert measured_bps(0, 2.0) is None and measured_bps(10, 0.0) is None


def test_plan_sources_carry_each_receivers_share_of_the_relays_upload():
    """Pipelined: every member but the owner pulls its chunks, so with 3 members each receiver
    is told half the owner's measured upload; an unmeasured owner carries 0."""
    b = Broadcast(1, None, 8)
    plan = b.start([Member("a", "http://a:1", 100 * MBIT), Member("b", "http://b:1", 0.0),
                    Member("c", None, 0.0)])
    rates = {s.peer_id: s.rate_bps for s in plan.sources}
    assert rates["a"] == 50 * MBIT
    assert rates.get("b", 0.0) == 0.0


def test_a_striped_chain_parent_feeds_one_child_at_its_whole_upload():
    """In the ring each member pulls from its predecessor alone: the parent's whole upload."""
    b = Broadcast(1, None, 8, strategy="striped-chain")
    b.start([Member(p, f"http://{p}:1", 100 * MBIT) for p in "abc"])
    plan = b.plan("b")
    owners = struct.unpack(f"<{len(plan.owners) // 4}I", plan.owners)
    assert {s.peer_id: s.rate_bps for s in plan.sources} == {"b": 100 * MBIT, "a": 100 * MBIT}
    assert set(owners) <= {0, 1}
