"""The gossip links' bookkeeping: `RankedSlots` lets the lowest rank in first, and a waiter
that is cancelled never leaks a slot; `Links.serve_rank` puts a NAT'd asker first, then the
chunk fewest links hold; `Links.begin` keeps the newest manifests, full and delta alike."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from echo2p2p.gossip import pack_bits
from echo2p2p.overlay.links import Links
from echo2p2p.overlay.serving import RankedSlots, UploadMeter
from echo2p2p.overlay.store import key_order


async def test_waiters_enter_lowest_rank_first_and_equal_ranks_in_order():
    slots, entered, release = RankedSlots(2), [], asyncio.Event()

    async def user(rank, name):
        async with slots.hold(rank):
            entered.append(name)
            await release.wait()

    first = [asyncio.create_task(user((0,), f"held{i}")) for i in range(2)]
    await asyncio.sleep(0)
    queued = [((3, True), "c"), ((1, True), "a2"), ((1, False), "a1"), ((3, True), "c2"),
              ((2, False), "b")]
    tasks = [asyncio.create_task(user(r, n)) for r, n in queued]
    await asyncio.sleep(0)
    assert entered == ["held0", "held1"]
    release.set()
    await asyncio.gather(*first, *tasks)
    assert entered[2:] == ["a1", "a2", "b", "c", "c2"]
    assert slots.free == 2


async def test_a_cancelled_waiter_leaks_no_slot():
    slots, gate = RankedSlots(1), asyncio.Event()

    async def hold():
        async with slots.hold((0,)):
            await gate.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(hold())  # queued, then cancelled while it waits
    await asyncio.sleep(0)
    waiter.cancel()
    gate.set()
    await holder
    assert waiter.cancelled() and slots.free == 1
    # handed the slot, then cancelled before it ran: the slot passes on
    held = slots.hold((0,))
    await held.__aenter__()
    gate.clear()
    handed, last = asyncio.create_task(hold()), asyncio.create_task(hold())
    await asyncio.sleep(0)
    await held.__aexit__(None, None, None)  # hands the slot to `handed`, which has not run yet
    handed.cancel()
    gate.set()
    await asyncio.gather(handed, last, return_exceptions=True)
    assert handed.cancelled() and last.done() and not last.cancelled() and slots.free == 1


def test_serve_rank_puts_a_natted_asker_first_then_the_rarest_chunk():
    links, key = Links(lambda: ("p0", None), UploadMeter()), (1, None)
    held = {"p1": [0, 1], "p2": [0], "p3": [0, 1]}  # chunk 0 at three links, 1 at two, 2 at none
    links.links = {p: SimpleNamespace(bits={key: bytearray(pack_bits(c, 20))}, natted=False)
                   for p, c in held.items()}
    public, natted = links.links["p1"], SimpleNamespace(bits={}, natted=True)
    assert links.serve_rank(public, key, 0) == (True, 3)
    assert links.serve_rank(public, key, 1) == (True, 2)
    assert links.serve_rank(public, key, 2) == (True, 0)
    assert links.serve_rank(natted, key, 0) == (False, 3) < links.serve_rank(public, key, 2)
    assert links.serve_rank(public, (2, 1), 0) == (True, 0)  # a manifest nobody spoke of
    assert links.serve_rank(public, key, 19) == (True, 0)


def test_links_keep_the_newest_manifests_full_and_delta_alike():
    """A peer may hold a version both in full and as a delta (caught up, then announced): the
    links keep the KEEP_KEYS newest keys, a version's full form older than its deltas, and
    never compare None with a base."""
    links = Links(lambda: ("p0", None), UploadMeter())
    for key in [(1, None), (2, None), (2, 1), (3, 2), (3, None)]:
        links.begin(SimpleNamespace(key=key, wires=[]), SimpleNamespace())
    assert sorted(links.advertised, key=key_order) == [(2, 1), (3, None), (3, 2)]
    assert list(links.listeners) == list(links.advertised)
