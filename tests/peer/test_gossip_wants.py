"""A gossip want given up (its task cancelled: a copy came from another link, or the download
was superseded) sends its own `cancel`, over real links on 127.0.0.1: the holder stops serving
it and its serve window is free for the next wants, so the link is not dropped for wanting
past the window."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings
from collections.abc import AsyncIterator

import aiohttp

from echo2p2p import messages as m
from echo2p2p.overlay.link import SERVE_WINDOW, Link
from echo2p2p.overlay.links import Links
from echo2p2p.overlay.serving import UploadMeter

from tests.conftest import until, wait_first
from tests.echo2p2p.overlay.test_had_frames import Wire
from tests.echo2p2p.overlay.test_gossip_faults import holding, peer_links, shut_uplink


@contextlib.asynccontextmanager
async def linked() -> AsyncIterator[tuple]:
    """p2 linked to p1 over real websockets, both advertising one manifest (p2's `have` names
    the manifest p1 serves): (held, manifest, p2's link to p1, p1's Links)."""
    _, held, manifest = await holding()
    async with peer_links("p1") as (links_b, url_b), peer_links("p2") as (links_a, _), \
            aiohttp.ClientSession() as http:
        links_b.advertised[held.key] = links_a.advertised[held.key] = held
        links_a.http = http
        links_a.heard_of([m.RelaySource("p1", url_b)])
        await until(links_a, lambda: "p1" in links_a.links)
        await until(links_b, lambda: "p2" in links_b.links and links_b.links["p2"].same(held))
        assert "p1" in links_a.links
        yield held, manifest, links_a.links["p1"], links_b


async def test_a_want_given_up_cancels_itself_and_frees_the_holders_window():
    """p2 wants 2 chunks of p1 (its whole window) while p1's uplink is shut, then gives both
    up: p1 stops serving them; p2 wants 2 others and gets them over the same link (before: p1
    kept both queued and closed the link on the third want, banning p2)."""
    async with linked() as (held, manifest, link, links_b):
        served, size = links_b.links["p2"], manifest.chunks[0].wire_bytes
        async with shut_uplink(links_b):
            wants = [asyncio.create_task(link.want(held.key, i, size)) for i in range(SERVE_WINDOW)]
            await until(links_b, lambda: len(served._serving) == SERVE_WINDOW)
            for task in wants:
                task.cancel()
            await until(links_b, lambda: not served._serving, 10.0)
        got = await asyncio.gather(*(link.want(held.key, i, manifest.chunks[i].wire_bytes)
                                     for i in range(SERVE_WINDOW, 2 * SERVE_WINDOW)))
        assert got == [bytes(held.wires[i]) for i in range(SERVE_WINDOW, 2 * SERVE_WINDOW)]
        assert link.reason is None and "p2" not in links_b.banned


async def test_a_want_sent_after_a_give_up_follows_its_cancel():
    """As a download does it: one want of a full window given up and another made in the same
    turn. The holder hears the cancel first, so the new want is within its window and the link
    stays (before: the new want overtook the cancel, one past the window, the holder dropped the
    link and the asker reported an honest peer for a stall: 8-9 reports per 8-peer race)."""
    async with linked() as (held, manifest, link, links_b):
        served, size, links = links_b.links["p2"], manifest.chunks[0].wire_bytes, link.links
        async with shut_uplink(links_b):
            wants = [asyncio.create_task(link.want(held.key, i, size)) for i in range(SERVE_WINDOW)]
            await until(links_b, lambda: len(served._serving) == SERVE_WINDOW)
            wants[0].cancel()
            late = asyncio.create_task(link.want(held.key, SERVE_WINDOW, size))
            await wait_first(*(side.until(lambda: (held.key, SERVE_WINDOW) in served._serving
                                          or link.reason is not None) for side in (links, links_b)))
        assert await late == bytes(held.wires[SERVE_WINDOW])
        assert await wants[1] == bytes(held.wires[1])
        assert link.reason is None and "p2" not in links_b.banned


async def test_a_peer_stopping_leaves_no_link_send_never_awaited():
    """A `had` queued to a link as the peer stops (its task cancelled before it ran) is never
    made, so nothing warns "coroutine 'Link.send' was never awaited" (a SIGTERM'd peer did)."""
    links = Links(lambda: ("p0", None), UploadMeter())
    links.links["p1"] = Link(links, "p1", Wire(), dialled=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        links.had((3, None), [0, 1])
        await links.close()
        for _ in range(3):  # the loop lets go of the cancelled tasks in its next turns
            await asyncio.sleep(0)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], caught
