"""Join limits: a burst gets straight in, then the rate holds; a refused hello spends nothing of
the other buckets; the buckets kept are bounded. Synchronous, with explicit `now`."""

from __future__ import annotations

from echo2p2p.join_limits import REASONS, Buckets, JoinLimits, Rate


def limits(**rates: Rate) -> JoinLimits:
    return JoinLimits(rates.get("address", Rate(60, 3)), rates.get("key", Rate(6, 2)),
                      rates.get("token", Rate(60, 3)))


def test_a_burst_gets_in_at_once_then_one_join_per_refill():
    """Three joins at t=0 (the burst), the fourth refused; one more a second later (60 a
    minute), not two."""
    gate = limits()
    assert [gate.refusal(0.0, address="a") for _ in range(4)] == [None] * 3 + [REASONS["address"]]
    assert gate.refusal(0.5, address="a") == REASONS["address"]
    assert gate.refusal(1.0, address="a") is None
    assert gate.refusal(1.0, address="a") == REASONS["address"]


def test_addresses_keys_and_tokens_are_counted_apart():
    gate = limits()
    for _ in range(3):
        assert gate.refusal(0.0, address="a") is None
    assert gate.refusal(0.0, address="b") is None  # another address: its own bucket
    assert gate.refusal(0.0, peer_key=b"k1") is None
    assert gate.refusal(0.0, peer_key=b"k1") is None
    assert gate.refusal(0.0, peer_key=b"k1") == REASONS["peer key"]
    assert gate.refusal(0.0, peer_key=b"k2", join_token="t") is None


def test_a_refused_hello_spends_none_of_the_other_buckets():
    """With the key's bucket empty, a hello naming it and a token spends nothing of the token's:
    three more joins with that token still get in."""
    gate = limits()
    gate.refusal(0.0, peer_key=b"k")
    gate.refusal(0.0, peer_key=b"k")
    for _ in range(5):
        assert gate.refusal(0.0, peer_key=b"k", join_token="t") == REASONS["peer key"]
    assert [gate.refusal(0.0, join_token="t") for _ in range(4)] == [None] * 3 + [
        REASONS["join token"]]


def test_empty_keys_and_unlimited_kinds_are_passed_over():
    """No peer key (an older peer), no token (a hub without tokens), or a rate of 0: no limit."""
    gate = limits(address=Rate(0, 1))
    for _ in range(100):
        assert gate.refusal(0.0, address="a", peer_key=b"", join_token=None) is None
    assert len(gate.kinds["address"]) == 0


def test_a_bucket_refills_to_its_burst_and_no_further():
    bucket = Buckets(Rate(60, 3))
    bucket.take("a", 0.0)
    assert bucket.level("a", 0.0) == 2
    assert bucket.level("a", 0.5) == 2.5
    assert bucket.level("a", 3600.0) == 3
    assert bucket.level("never seen", 7.0) == 3
    assert bucket.level("a", -5.0) == 2  # a clock that went back refills nothing


def test_the_buckets_kept_are_bounded_least_recently_used_first():
    bucket = Buckets(Rate(1, 4), max_keys=3)
    for key in ("a", "b", "c"):
        bucket.take(key, 0.0)
    bucket.take("a", 0.0)  # used again: "b" is now the least recently used
    bucket.take("d", 0.0)
    assert len(bucket) == 3
    assert bucket.level("a", 0.0) == 2 and bucket.level("b", 0.0) == 4  # "b" was forgotten
