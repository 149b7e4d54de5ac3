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


def share(total: Rate = Rate(60, 8), burst: int = 4) -> JoinLimits:
    return JoinLimits(Rate(0, 1), Rate(0, 1), Rate(0, 1), total, network_burst=burst)


def test_a_network_alone_gets_the_hubs_whole_rate_two_share_it():
    """One network churning refills at the hub's 60 a minute (one a second); with a second
    network joining too, each refills at half that."""
    gate = share(Rate(60, 64))
    for _ in range(4):
        assert gate.refusal(0.0, network="n1") is None
    assert gate.refusal(0.0, network="n1") == REASONS["network"]
    assert gate.refusal(1.0, network="n1") is None
    for _ in range(4):
        assert gate.refusal(1.0, network="n2") is None  # a new network: its own burst
    assert gate.refusal(2.0, network="n1") == REASONS["network"]  # half a token a second now
    assert gate.refusal(3.0, network="n1") is None


def test_the_hubs_last_quarter_is_kept_for_quiet_networks():
    """Busy networks stop at the hub's reserve (a quarter of its burst, here 2: each network's
    first join, quiet until then, may dip into it); a network that has not joined in the last
    minute may take what is left."""
    gate = share(Rate(60, 8), burst=8)
    taken = sum(gate.refusal(0.0, network=f"busy{i % 3}") is None for i in range(30))
    assert taken == 7 and gate.refusal(0.0, network="busy0") == REASONS["hub"]
    assert gate.refusal(0.0, network="quiet") is None
    assert gate.share.hub.level("", 0.0) == 0


def test_a_refused_knock_spends_nothing_and_a_penalty_delays_the_next_join():
    gate = JoinLimits(Rate(60, 2), Rate(0, 1), Rate(0, 1), Rate(600, 64), network_burst=2)
    assert gate.knock(0.0, "a", "n") is None and gate.knock(0.0, "a", "n") is None
    assert gate.knock(0.0, "a", "n") == REASONS["address"]
    gate.penalize(0.0, "b", "m", 4)  # b and its network flooded: 4 joins' worth owed
    assert gate.knock(2.0, "b", "m") == REASONS["address"]  # 2 - 4 + 2 refilled: none yet
    assert gate.knock(3.0, "b", "m") is None
    assert gate.share.hub.level("", 3.0) == 64  # the penalty was theirs, not the hub's
