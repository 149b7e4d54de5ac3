"""The per-connection read budget: honest traffic never waits, a flood is paused for exactly its
debt, the hub session charges every frame (explicit `now` throughout), and a live hub pauses a
flooding peer while it serves the others."""

from __future__ import annotations

import asyncio

import aiohttp
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import messages as m
from echo2p2p import read_budget as rb
from echo2p2p.read_budget import ReadBudget
from echo2p2p.session import Session, Side

from tests.conftest import tracker, wait_until
from tests.echo2p2p.test_session import WELCOME, sample


def test_honest_rollout_traffic_never_pauses():
    """A peer sending 50 rollout frames of 24 KiB (and a lease request each) a second for a
    minute, all at once each second, is never asked to wait."""
    budget = ReadBudget(0.0)
    for second in range(60):
        for _ in range(50):
            budget.charge(24 << 10, 60, float(second))
            budget.charge(20, 3, float(second))
        assert budget.pause_s(float(second)) == 0.0
    assert budget.statistics().pauses == 0


def test_a_flood_is_paused_for_its_debt_then_reads_on():
    """Past the burst, the pause is the debt over the rate; once that much time has passed the
    connection reads on, and the bucket never holds more than its burst."""
    budget = ReadBudget(0.0, rate_bps=1000.0, burst_bytes=10_000.0)
    for _ in range(3):
        budget.charge(1000, 0, 0.0)  # 3 x (1000 + FRAME_COST_BYTES)
    debt = 3 * (1000 + rb.FRAME_COST_BYTES) - 10_000
    assert budget.pause_s(0.0) == pytest.approx(debt / 1000.0)
    assert budget.pause_s(debt / 1000.0) == 0.0
    budget.charge(0, 0, 1e6)  # a long quiet spell refills the burst, no more
    assert budget.pause_s(1e6) == 0.0
    budget.charge(10_000 - rb.FRAME_COST_BYTES, 0, 1e6)
    assert budget.pause_s(1e6) > 0.0


def test_values_cost_like_bytes():
    """A frame that built many values costs more than its size: VALUE_COST_BYTES each."""
    budget = ReadBudget(0.0, rate_bps=1.0, burst_bytes=1.0)
    budget.charge(10, 1000, 0.0)
    assert budget.statistics().charged_bytes == 10 + rb.FRAME_COST_BYTES + 1000 * rb.VALUE_COST_BYTES


def test_a_clock_stepping_back_refills_nothing():
    """`now` going backwards neither refills the bucket nor breaks the next pause."""
    budget = ReadBudget(100.0, rate_bps=1000.0, burst_bytes=1000.0)
    budget.charge(5000, 0, 100.0)
    wait = budget.pause_s(100.0)
    assert budget.pause_s(50.0) == pytest.approx(wait)
    assert budget.pause_s(100.0 + wait) == 0.0


@settings(max_examples=100, deadline=None)
@given(frames=st.lists(st.tuples(st.integers(0, 1 << 22), st.integers(0, 1 << 14),
                                 st.floats(0, 5)), max_size=40))
def test_what_a_connection_reads_is_bounded_by_its_rate(frames):
    """Whatever a peer sends, if the shell obeys every pause, the cost it is charged by time T
    is at most burst + rate x T plus one frame (the one that went into debt)."""
    budget = ReadBudget(0.0, rate_bps=1 << 20, burst_bytes=1 << 20)
    now, biggest = 0.0, 0
    for nbytes, values, gap in frames:
        now += gap
        budget.charge(nbytes, values, now)
        biggest = max(biggest, nbytes + rb.FRAME_COST_BYTES + rb.VALUE_COST_BYTES * values)
        now += budget.pause_s(now)
        assert budget.statistics().charged_bytes <= (1 << 20) + (1 << 20) * now + biggest + 1


def test_hub_session_charges_every_frame_and_the_peer_side_is_unmetered():
    """The hub's session asks for a pause once a peer's frames pass the budget; a peer's
    session never does."""
    hub = Session(Side.HUB, 0.0, ReadBudget(0.0, rate_bps=1000.0, burst_bytes=20_000.0))
    hub.receive(m.encode(m.Hello("a", "transformers", "cpu")), 0.0)
    hub.send(WELCOME)
    frame = m.encode(m.RolloutSubmission("L0", 0, [sample(), sample()]))
    pauses = []
    for _ in range(5):
        hub.receive(frame, 0.0)
        pauses.append(hub.pause_s(0.0))
    assert pauses[0] == 0.0 and pauses[-1] > 0.0
    assert Session(Side.HUB, 0.0).budget is not None  # metered by default
    peer = Session(Side.PEER, 0.0)
    peer.send(m.Hello("a", "transformers", "cpu"))
    peer.receive(m.encode(WELCOME), 0.0)
    for _ in range(1000):
        peer.receive(m.encode(m.Heartbeat()), 0.0)
    assert peer.pause_s(0.0) == 0.0


async def test_a_flooding_peer_is_paused_and_the_others_are_served():
    """A live hub: a peer that sends 15 MiB of padded heartbeats at once is paused (its
    session says so), while a second peer joins and is welcomed meanwhile."""
    import asyncio

    import aiohttp
    import msgpack

    from tests.conftest import tracker, wait_until

    pad = msgpack.packb({"p": m.BASE_PROTOCOL, "t": "heartbeat", "a": bytes(1 << 20), "b": bytes(1 << 20),
                         "c": bytes(1 << 20)}, use_bin_type=True)
    async with tracker() as (hub, _, url, _records), aiohttp.ClientSession() as http:
        async with http.ws_connect(url) as flood, http.ws_connect(url) as honest:
            await flood.send_bytes(m.encode(m.Hello("flood", "transformers", "cpu")))
            flood_id = m.decode((await flood.receive()).data).peer_id
            sending = asyncio.ensure_future(asyncio.gather(*(flood.send_bytes(pad) for _ in range(5))))
            # polled: a pause is no event of the hub's (its pump sleeps it out, then handles)
            await wait_until(lambda: hub.peer_views()[flood_id].read_budget.pauses >= 1)
            await honest.send_bytes(m.encode(m.Hello("honest", "transformers", "cpu")))
            assert isinstance(m.decode((await honest.receive()).data), m.Welcome)
            await sending
        assert hub.statistics().closed_for_protocol == 0  # paused, not closed: it broke no rule
