"""The hub's door: connections past an address's limit, or past their network's share of the
hub's join budget, are turned away before the websocket upgrade (`knock`: the hub answers 429);
hellos past a peer key's or a join token's limit are refused with 4005 and a reason before the
hub does any work; an honest peer's reconnect gets straight in; IPv6 addresses count by their
/64, networks by /24 and /48.

The first tests drive `Door` synchronously with explicit `now`; the last one runs a real hub
and a real peer over 127.0.0.1."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from echo2p2p import messages as m
from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.serving.counters import Counters
from echo2p2p.hub.serving.door import Door
from echo2p2p.hub.serving.peers import address_group, network_of
from echo2p2p.hub.serving.tokens import TokenBook
from echo2p2p.join_limits import REASONS
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.session import Session, Side

from tests.conftest import tracker, wait_until

CFG = HubConfig.from_flat(join_burst=3, joins_per_min=60, join_burst_per_key=2, joins_per_min_per_key=6)


def hello(key: bytes = b"", token: str = "") -> m.Hello:
    return m.Hello("p", "relay", "cpu", token=token, peer_key=key)


def test_an_address_past_its_burst_is_refused_until_its_bucket_refills():
    counters = Counters()
    door = Door(CFG.limits, None, counters)
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
    door = Door(CFG.limits, None, Counters())
    answers = [door.refusal(hello(b"k" * 32), f"10.0.0.{i}", [], 0.0) for i in range(3)]
    assert answers == [None, None, (m.CLOSE_TOO_MANY, REASONS["peer key"])]


def test_a_bad_token_spends_the_address_only_and_a_good_one_is_limited_too(tmp_path):
    """Connections with a wrong token are refused 4004 at their hello (their knocks spent the
    address: 3 tries, then 429); a valid token shared by many addresses is held to its own
    bucket."""
    book = TokenBook(tmp_path / "tokens.json")
    token = book.create("lab")
    counters = Counters()
    door = Door(CFG.limits, book, counters)
    wrong = [door.knock("10.0.0.9", [], 0.0) or door.refusal(hello(token=token + "x"),
                                                             "10.0.0.9", [], 0.0)[0]
             for _ in range(4)]
    assert wrong == [m.CLOSE_UNAUTHORIZED] * 3 + [REASONS["address"]]
    good = [door.refusal(hello(token=token), f"10.0.1.{i}", [], 0.0) for i in range(4)]
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


async def test_a_real_peer_gets_back_in_at_once_after_a_flood_was_refused():
    """Past the burst, raw connections from 127.0.0.1 are answered 429 before the websocket
    upgrade (held back a second); a real peer that was already joined and lost its connection
    is welcomed again once the bucket has a token: it retries on its own backoff, nothing special."""
    async with tracker(join_burst=3, joins_per_min=12) as (hub, _, url, _):  # 5 s a token
        stop = asyncio.Event()
        peer = PeerClient(PeerConfig(hub_url=url, engine="relay", listen="", name="honest"))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(peer.run(stop))
            await hub.wait_peers(1)
            async with aiohttp.ClientSession() as http:
                answers = []
                for _ in range(3):
                    try:
                        async with http.ws_connect(url) as ws:
                            session = Session(Side.PEER, 0.0)
                            await ws.send_bytes(session.send(m.Hello("flood", "relay", "cpu")))
                            answers.append(session.receive((await ws.receive()).data, 0.0))
                    except aiohttp.WSServerHandshakeError as exc:
                        answers.append(exc.status)
                async with http.get(url.replace("ws://", "http://")) as resp:
                    said = (resp.status, await resp.text(), resp.headers.get("Retry-After"))
            welcomed = [a for a in answers if isinstance(a, m.Welcome)]
            assert len(welcomed) == 2 and answers[2] == 429  # the honest peer took one token
            assert said == (429, REASONS["address"], "5")
            await hub.disconnect(next(iter(hub.peer_views())), "dropped")
            await wait_until(lambda: peer.statistics().connections >= 2, 30)
            await hub.wait_peers(1)
            stop.set()
        assert hub.statistics().joins_too_often >= 1


async def test_a_refusal_is_held_back_and_past_the_held_ones_answered_at_once(monkeypatch):
    """A refused connection's 429 comes after the hold (a tarpit: a churner asking again at
    once gets one answer a hold); past HELD_REFUSALS held at once, the next is answered first."""
    import echo2p2p.hub.serving.door as door_module

    monkeypatch.setattr(door_module, "HELD_REFUSALS", 2)
    monkeypatch.setattr(door_module, "REFUSAL_HOLD_S", 0.5)
    door = Door(CFG.limits, None, Counters())
    for _ in range(3):
        assert await door.turn_away("10.0.0.1", []) is None  # the burst
    answered: list[int] = []

    async def ask(i: int) -> None:
        resp = await door.turn_away("10.0.0.1", [])
        assert resp.status == 429 and resp.text == REASONS["address"]
        answered.append(i)

    async with asyncio.TaskGroup() as tg:
        for i in range(3):
            tg.create_task(ask(i))
            await asyncio.sleep(0)  # each starts (and is held) in turn: an order, not a wait
    assert answered[0] == 2 and sorted(answered[1:]) == [0, 1]
    assert door._held == 0
