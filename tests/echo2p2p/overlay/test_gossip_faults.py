"""What a gossip download holds against a link, over real links on 127.0.0.1: a link closed
honestly (here a duplicate, when two peers dial each other at once) takes its wants with it and
is no stall: the link is not avoided, nobody is reported, and the chunk comes over the link that
replaced it. The holder's uplink is held shut by taking its upload slots, the fault a busy peer
shows, so the want is still out when the duplicate arrives."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.overlay.gossip_download import GossipDownload
from echo2p2p.overlay.link import LINK_PATH
from echo2p2p.overlay.links import Links, link_handler
from echo2p2p.overlay.serving import UPLOAD_SLOTS, UploadMeter
from echo2p2p.overlay.store import ChunkStore, Held
from echo2p2p.overlay.tickets import Tickets

from tests.blob_versions import blob_version
from tests.conftest import serving, until

DEAD_HUB = "http://127.0.0.1:9"  # the hub's chunk route: nothing listens there


@contextlib.asynccontextmanager
async def peer_links(peer_id: str) -> AsyncIterator[tuple[Links, str]]:
    """A peer's `Links` (a rig without tickets) with its /gossip served on 127.0.0.1; yields
    them and the chunk server's URL. Closed on exit."""
    links = Links(lambda: (peer_id, None), UploadMeter(), tickets=Tickets(b""))
    app = web.Application()
    app.router.add_get(LINK_PATH, link_handler(links, Tickets(b"")))
    async with serving(app) as port:
        links.url = f"http://127.0.0.1:{port}"
        try:
            yield links, links.url
        finally:
            await links.close()


async def holding(version_bytes: int = 64 << 10) -> tuple[ChunkStore, Held, m.Manifest]:
    """A store holding a 4-chunk blob version whole; its manifest."""
    snap = blob_version(signing.new_private_key(), 1, os.urandom(version_bytes),
                        chunk_bytes=16 << 10).full
    store = ChunkStore()
    held = store.begin(snap.manifest)
    for i, chunk in enumerate(snap.chunks):
        await store.add(held, i, bytes(chunk))
    return store, held, snap.manifest


@contextlib.asynccontextmanager
async def shut_uplink(links: Links) -> AsyncIterator[None]:
    """Every upload slot of `links` taken until exit: wants to it wait in its queue."""
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(UPLOAD_SLOTS):
            await stack.enter_async_context(links._sending.hold((False, 0)))
        yield


async def test_a_want_cut_by_a_duplicate_link_is_no_stall():
    """p2 downloads v1 from p1 over the link it dialled; while its wants wait in p1's queue, p1
    dials p2 too and p1's dial wins (the lower id), so p2 closes its own link as a duplicate.
    Those wants are not stalls: p2 reports nothing, keeps p1 and takes v1 over the new link
    (before: a stall report, p1 avoided, and with the hub away v1 never came)."""
    _, held_b, manifest = await holding()
    reports: list[m.RelayReport] = []

    async def report(msg: m.RelayReport) -> None:
        reports.append(msg)

    async with peer_links("p1") as (links_b, url_b), peer_links("p2") as (links_a, url_a), \
            aiohttp.ClientSession() as http:
        links_b.advertised[held_b.key] = held_b
        links_b.http = http
        store_a = ChunkStore()
        download = GossipDownload(
            store_a, store_a.begin(manifest), http=http, hub_base_url=DEAD_HUB, me="p2",
            report=report, stall_s=60.0, links=links_a,
            gossip=m.GossipPlan(1, None, b"", [m.RelaySource("p1", url_b)]))
        async with shut_uplink(links_b):
            task = asyncio.create_task(download.run())
            await until(links_b, lambda: "p2" in links_b.links
                        and bool(links_b.links["p2"]._serving))
            first = links_a.links["p1"]
            links_b.spawn(links_b._dial("p2", url_a))  # p1 dials p2 as well: a second link
            await until(links_a, lambda: first.reason is not None)
            assert first.reason == "duplicate link"
        async with asyncio.timeout(30):
            await task
        assert not reports, reports
        assert download.swarm.complete
        assert links_a.links["p1"] is not first and "p1" not in links_a.banned
