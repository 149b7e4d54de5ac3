"""The hub's door as the shell keeps it: a refused connection's 429 is held back (a tarpit),
and over a real hub and a real peer on 127.0.0.1 an honest peer's reconnect gets straight in
after a flood was refused. (The door's decisions, synchronously: tests/hub/core/test_door.py.)"""

from __future__ import annotations

import asyncio

import aiohttp

from echo2p2p import messages as m
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.core.counters import Counters
from echo2p2p.hub.core.door import Door
from echo2p2p.hub.serving.door import Tarpit
from echo2p2p.join_limits import REASONS
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.session import Session, Side

from tests.conftest import tracker
from echo2p2p.hub.core.events import SentAway

CFG = HubConfig.from_flat(join_burst=3, joins_per_min=60, join_burst_per_key=2, joins_per_min_per_key=6)


def hello(key: bytes = b"", token: str = "") -> m.Hello:
    return m.Hello("p", "relay", "cpu", token=token, peer_key=key)


async def test_a_real_peer_gets_back_in_at_once_after_a_flood_was_refused():
    """Past the burst, raw connections from 127.0.0.1 are answered 429 before the websocket
    upgrade (held back a second); a real peer that was already joined and lost its connection
    is welcomed again once the bucket has a token: it retries on its own backoff, nothing special."""
    async with tracker(join_burst=3, joins_per_min=12) as (hub, _, url, _):  # 5 s a token
        stop = asyncio.Event()
        peer = PeerClient(PeerConfig(hub_url=url, engine="relay", listen="", name="honest"))
        async with asyncio.TaskGroup() as tg:
            tg.create_task(peer.run(stop))
            await hub.until(lambda: len(hub.peer_views()) == 1)
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
            hub.feed(SentAway(next(iter(hub.peer_views())), "dropped"))
            await asyncio.wait_for(hub.until(lambda: peer.statistics().connections >= 2), 30)
            await hub.until(lambda: len(hub.peer_views()) == 1)
            stop.set()
        assert hub.statistics().joins_too_often >= 1


async def test_a_refusal_is_held_back_and_past_the_held_ones_answered_at_once(monkeypatch):
    """A refused connection's 429 comes after the hold (a tarpit: a churner asking again at
    once gets one answer a hold); past HELD_REFUSALS held at once, the next is answered first."""
    import echo2p2p.hub.serving.door as door_module

    monkeypatch.setattr(door_module, "HELD_REFUSALS", 2)
    monkeypatch.setattr(door_module, "REFUSAL_HOLD_S", 0.5)
    door, tarpit = Door(CFG.limits, False, Counters()), Tarpit()
    for _ in range(3):
        assert door.knock("10.0.0.1", [], 0.0) is None  # the burst
    answered: list[int] = []

    async def ask(i: int) -> None:
        why = door.knock("10.0.0.1", [], 0.0)
        resp = await tarpit.turn_away(why)
        assert resp.status == 429 and resp.text == REASONS["address"]
        answered.append(i)

    async with asyncio.TaskGroup() as tg:
        for i in range(3):
            tg.create_task(ask(i))
            await asyncio.sleep(0)  # each starts (and is held) in turn: an order, not a wait
    assert answered[0] == 2 and sorted(answered[1:]) == [0, 1]
    assert tarpit.held == 0
