"""The hub's door (`hub.core.door.Door`), driven synchronously with explicit `now`: connections
past an address's limit, or past their network's share of the hub's join budget, are turned
away before the websocket upgrade (`knock`); hellos past a peer key's or a join token's limit
are refused with 4005 and a reason; IPv6 addresses count by their /64, networks by /24 and /48.
(The shell's tarpit and a real hub and peer: tests/hub/serving/test_door.py.)"""

from __future__ import annotations

import pytest

from echo2p2p import messages as m
from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.core.counters import Counters
from echo2p2p.hub.core.door import Door
from echo2p2p.hub.core.peer import address_group, network_of
from echo2p2p.hub.serving.tokens import TokenBook, join_refusal
from echo2p2p.join_limits import REASONS

CFG = HubConfig.from_flat(join_burst=3, joins_per_min=60, join_burst_per_key=2, joins_per_min_per_key=6)


def hello(key: bytes = b"", token: str = "") -> m.Hello:
    return m.Hello("p", "relay", "cpu", token=token, peer_key=key)


def test_an_address_past_its_burst_is_refused_until_its_bucket_refills():
    counters = Counters()
    door = Door(CFG.limits, False, counters)
    answers = [door.knock("10.0.0.1", [], 0.0) for i in range(4)]
    assert answers == [None] * 3 + [REASONS["address"]]
    assert door.knock("10.0.0.2", [], 0.0) is None  # another address
    assert door.knock("10.0.0.1", [], 1.0) is None  # a second later
    assert counters.joins_too_often == 1 and counters.refused == 0


def test_networks_share_the_hubs_join_budget_fairly():
    """32 networks joining as fast as they may take the hub's rate between them, and a 33rd
    network's first peer still gets in at once; one network alone gets the whole rate."""
    cfg = HubConfig.from_flat(join_burst=4, joins_per_min=6000, joins_per_min_total=600,
                              join_burst_total=64, joins_per_min_per_key=0)
    door = Door(cfg.limits, None, Counters())
    joined, now = 0, 0.0
    for second in range(60):  # a minute of churn: each network tries 10 joins a second
        now = float(second)
        for attempt in range(10):
            for net in range(1, 33):
                address = f"10.{net}.0.{attempt + 1}"
                if door.knock(address, [], now) is None and \
                        door.refusal(hello(bytes([net, attempt]) * 16), address, [], now) is None:
                    joined += 1
    assert joined <= 600 + 64 + 32 * 4  # the hub's rate, its burst and each network's burst
    assert door.knock("10.99.0.1", [], now) is None
    assert door.refusal(hello(b"q" * 32), "10.99.0.1", [], now) is None


def test_one_peer_key_past_its_burst_is_refused_from_any_address():
    door = Door(CFG.limits, False, Counters())
    answers = [door.refusal(hello(b"k" * 32), f"10.0.0.{i}", [], 0.0) for i in range(3)]
    assert answers == [None, None, (m.CLOSE_TOO_MANY, REASONS["peer key"])]


def test_a_bad_token_spends_the_address_only_and_a_good_one_is_limited_too(tmp_path):
    """Connections with a wrong token are refused 4004 at their hello (their knocks spent the
    address: 3 tries, then 429); a valid token shared by many addresses is held to its own
    bucket."""
    book = TokenBook(tmp_path / "tokens.json")
    token = book.create("lab")
    counters = Counters()
    door = Door(CFG.limits, True, counters)
    wrong = [door.knock("10.0.0.9", [], 0.0) or door.refusal(
        hello(token=token + "x"), "10.0.0.9", [], 0.0, join_refusal(book, token + "x"))[0]
        for _ in range(4)]
    assert wrong == [m.CLOSE_UNAUTHORIZED] * 3 + [REASONS["address"]]
    good = [door.refusal(hello(token=token), f"10.0.1.{i}", [], 0.0, join_refusal(book, token))
            for i in range(4)]
    assert good == [None] * 3 + [(m.CLOSE_TOO_MANY, REASONS["join token"])]
    assert counters.refused == 3 and counters.joins_too_often == 2


def test_ipv6_counts_by_its_64_and_mapped_ipv4_as_ipv4():
    assert network_of("10.1.2.3") == network_of("10.1.2.200") == "10.1.2.0/24"
    assert network_of("2001:db8:1:2::5") == network_of("2001:db8:1:ffff::1") == "2001:db8:1::/48"
    assert network_of("::ffff:192.0.2.7") == "192.0.2.0/24"
    assert address_group("2001:db8:1:2::5") == address_group("2001:db8:1:2:ffff::1")
    assert address_group("2001:db8:1:2::5") != address_group("2001:db8:1:3::5")
    assert address_group("::ffff:192.0.2.7") == "192.0.2.7" == address_group("192.0.2.7")
    assert address_group(None) is None and address_group("not an ip") == "not an ip"


@pytest.mark.parametrize("field,value", [("joins_per_min", -1.0), ("joins_per_min", float("nan")),
                                         ("join_burst", 0), ("catch_up_builds", 0),
                                         ("joins_per_min_total", -5.0), ("join_burst_total", 0)])
def test_join_limits_are_checked(field, value):
    with pytest.raises(ConfigError) as exc:
        CFG.replace(**{field: value})
    assert exc.value.field == field
