"""A download times each chunk from a relay against the rate its plan gives (echo2p2p.pace): a
chunk that came far slower is kept, the relay is reported "slow" once, and its other chunks come
from the hub. Real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os

import aiohttp
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.overlay.download import Download
from echo2p2p.overlay.store import ChunkStore

from tests.blob_versions import blob_version
from tests.conftest import serving
from tests.peer.test_overlay import CHUNK

STALL_S = 4.0  # the download's: it long-polls STALL_S / 2 and allows STALL_S of silence


async def fetch_through(relay_delay_s: float) -> tuple[list[m.RelayReport], int, int]:
    """Download a 4-chunk version whose plan deals every chunk to one relay at 100 Mbit/s per
    receiver, the relay waiting `relay_delay_s` before its headers and again between the two
    halves of each body; the reports sent, the chunks the relay served and the hub's."""
    key = signing.new_private_key()
    pub = blob_version(key, 0, os.urandom(4 * CHUNK), chunk_bytes=CHUNK)
    chunks = pub.full.chunks
    served = {"relay": 0, "hub": 0}

    async def from_hub(request: web.Request) -> web.Response:
        served["hub"] += 1
        return web.Response(body=chunks[int(request.match_info["index"])])

    async def from_relay(request: web.Request) -> web.StreamResponse:
        data = chunks[int(request.match_info["index"])]
        resp = web.StreamResponse()
        resp.content_length = len(data)
        await asyncio.sleep(relay_delay_s)  # the relay's pace, not a synchronisation
        await resp.prepare(request)
        await resp.write(data[:len(data) // 2])
        await asyncio.sleep(relay_delay_s / 4)
        await resp.write(data[len(data) // 2:])
        await resp.write_eof()
        served["relay"] += 1
        return resp

    hub_app, relay_app = web.Application(), web.Application()
    hub_app.router.add_get("/chunk/{version}/{base}/{index}", from_hub)
    relay_app.router.add_get("/chunk/{version}/{base}/{index}", from_relay)
    reports: list[m.RelayReport] = []

    async def report(msg: m.RelayReport) -> None:
        reports.append(msg)

    store = ChunkStore()
    held = store.begin(pub.full.manifest)
    async with serving(hub_app) as hub_port, serving(relay_app) as relay_port, \
            aiohttp.ClientSession() as http:
        download = Download(store, held, http=http, me="p1", stall_s=STALL_S,
                            replan_wait_s=0.1, hub_base_url=f"http://127.0.0.1:{hub_port}",
                            report=report)
        download.set_plan(m.RelayPlan(0, None, 1, [m.RelaySource(
            "p7", f"http://127.0.0.1:{relay_port}", rate_bps=100e6)], b"\0\0\0\0" * len(chunks)))
        await download.run()
    assert held.assembler.complete
    return reports, served["relay"], served["hub"]


async def test_a_relay_far_slower_than_its_rate_is_reported_and_left():
    """Headers after 0.9 x the stall time: no deadline passes, but the first chunks are slow;
    they are kept, the relay is reported once, and the rest come from the hub."""
    reports, by_relay, by_hub = await fetch_through(0.9 * STALL_S)
    assert [(r.peer_id, r.reason) for r in reports] == [("p7", "slow")]
    assert by_relay <= 2 and by_hub == 4 - by_relay  # the window's two, no more


async def test_a_relay_at_its_rate_is_not_reported():
    """The same relay without its delays serves every chunk, unreported."""
    reports, by_relay, by_hub = await fetch_through(0.0)
    assert reports == [] and (by_relay, by_hub) == (4, 0)
