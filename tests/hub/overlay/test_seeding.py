"""The hub deals chunks only to peers it has seen fetch what they are dealt (issue 42, item 1),
over real sockets: a hand-made peer that fetches its share from the hub's chunk route with its
ticket, one that never does (its chunk server answers the hub's probe, so it may be dealt), and
one with no chunk server. The silent one's share goes to the other within its grace, on the
hub's own evidence, and it is dealt nothing more for a while; the one without a server is
never dealt a share. The same decisions, event by event on a fake clock:
tests/hub/core/test_overlay_seeding.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import Credentials
from echo2p2p.relay import owners_of
from echo2p2p.session import Session, Side

from tests.blob_versions import blob_version
from tests.conftest import serving, tracker
from tests.hub.overlay.waiting import Frames, until
from tests.peer.test_overlay import Peers, holds
from echo2p2p.hub.core.events import VersionPublished

CHUNK = 16 << 10  # as tests/peer/test_overlay.py
V0 = b"\0" * 1024


@contextlib.asynccontextmanager
async def answers_503() -> AsyncIterator[str]:
    """A chunk server that answers every request at once with 503 ("not yet"): alive, so the
    hub's probe passes, holding nothing."""
    async def handle(request: web.Request) -> web.Response:
        return web.Response(status=503)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}"


@dataclass
class Seeder:
    """A hand-made peer: its welcome, what the hub sent it, and its chunk credentials."""

    welcome: m.Welcome
    credentials: Credentials
    frames: Frames = field(default_factory=Frames)

    @property
    def peer_id(self) -> str:
        return self.welcome.peer_id

    def seeds(self, version: int) -> list[list[int]]:
        """The seed lists the hub sent it for `version` (the announcement's, then re-deals')."""
        plans = [f.plan if isinstance(f, m.VersionAnnouncement) else f for f in self.frames
                 if isinstance(f, (m.VersionAnnouncement, m.RelayPlan))]
        return [m.unpack_ids(p.gossip.seed) for p in plans
                if p.version == version and p.gossip is not None]

    def plans(self, version: int) -> list[m.RelayPlan]:
        return [f.plan if isinstance(f, m.VersionAnnouncement) else f for f in self.frames
                if isinstance(f, (m.VersionAnnouncement, m.RelayPlan)) and
                (f.manifest.version if isinstance(f, m.VersionAnnouncement) else f.version) == version]


@contextlib.asynccontextmanager
async def seeder(url: str, name: str, listen_addr: str | None) -> AsyncIterator[Seeder]:
    key = signing.new_private_key()
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        session = Session(Side.PEER, 0.0)
        await ws.send_bytes(session.send(m.Hello(name, "relay", "cpu", 0.0, listen_addr, "",
                                                 os.urandom(16), signing.public_key(key))))
        welcome = session.receive((await ws.receive()).data, 0.0)
        peer = Seeder(welcome, Credentials(welcome.run_id, welcome.peer_id, key, welcome.ticket))

        async def read() -> None:
            async for frame in ws:
                if frame.type is aiohttp.WSMsgType.BINARY:
                    peer.frames.add(m.decode(frame.data))

        reader = asyncio.create_task(read())
        try:
            yield peer
        finally:
            reader.cancel()


async def fetch(hub_url: str, peer: Seeder, version: int, indices: list[int]) -> None:
    """`peer` fetches chunks `indices` of `version` (in full) from the hub's chunk route."""
    base = hub_url.replace("ws://", "http://").removesuffix("/ws")
    async with aiohttp.ClientSession() as http:
        for i in indices:
            async with http.get(base + chunk_path(version, None, i), params={"wait": "0"},
                                headers=peer.credentials.header("hub")) as resp:
                assert resp.status == 200
                await resp.read()


async def probed(hub, n: int) -> None:
    await until(hub, lambda: len(hub.peer_views()) == n and all(
        p.server_url is None or p.relay == "ok" for p in hub.peer_views().values()))


def silences(records) -> list[dict]:
    return [r for r in records if r.get("event") == "seeder_silent"]


async def test_a_gossip_seeder_that_fetches_nothing_has_its_seeds_dealt_again_and_is_benched():
    """Two newcomers on probation share v1 (nobody proven: dealt as before); one fetches its
    seeds, one never asks: within the grace its seeds go to the other (one plan revision), and
    v2 deals it none. A peer with no chunk server gets no seed in either."""
    async with tracker(relay="gossip") as (hub, key, url, records), answers_503() as dead, \
            seeder(url, "fetcher", dead) as good, seeder(url, "silent", dead) as idle, \
            seeder(url, "nat", None) as nat:
        hub.feed(VersionPublished(blob_version(key, 0, V0, chunk_bytes=CHUNK)))
        await probed(hub, 3)
        hub.feed(VersionPublished(blob_version(key, 1, os.urandom(8 * CHUNK), chunk_bytes=CHUNK)))
        for peer in (good, idle, nat):
            await peer.frames.until(lambda p=peer: p.seeds(1))
        assert nat.seeds(1) == [[]]
        (mine,), (theirs,) = good.seeds(1), idle.seeds(1)
        assert sorted(mine + theirs) == list(range(8)) and mine and theirs
        await fetch(url, good, 1, mine)
        await good.frames.until(lambda: len(good.seeds(1)) == 2)
        assert sorted(good.seeds(1)[1]) == sorted(theirs)  # re-dealt: only the added seeds
        (silence,) = silences(records)
        assert silence["peer"] == idle.peer_id and silence["chunks"] == len(theirs)
        assert silence["quiet_s"] >= 1.0 and silence["bench_s"] == 60.0  # the floor, by rule
        hub.feed(VersionPublished(blob_version(key, 2, os.urandom(8 * CHUNK), chunk_bytes=CHUNK)))
        for peer in (good, idle, nat):
            await peer.frames.until(lambda p=peer: p.seeds(2))
        assert sorted(good.seeds(2)[0]) == list(range(8)) and idle.seeds(2) == [[]]
        assert nat.seeds(2) == [[]]
    assert all(s["peer"] == idle.peer_id for s in silences(records))


async def test_a_tracker_owner_that_fetches_nothing_is_routed_around_within_its_grace():
    """The tracker (`relay = "pipelined"`): an owner that never fetches the chunks it owns from
    the hub is dropped from v1's plan (a new revision without it), not after a receiver's
    stall deadline and an accusation."""
    async with tracker() as (hub, key, url, records), answers_503() as dead, \
            seeder(url, "fetcher", dead) as good, seeder(url, "silent", dead) as idle:
        hub.feed(VersionPublished(blob_version(key, 0, V0, chunk_bytes=CHUNK)))
        await probed(hub, 2)
        hub.feed(VersionPublished(blob_version(key, 1, os.urandom(8 * CHUNK), chunk_bytes=CHUNK)))
        await good.frames.until(lambda: good.plans(1))
        (plan,) = good.plans(1)
        owners = [plan.sources[o].peer_id if o != m.HUB_OWNER else None for o in owners_of(plan)]
        assert idle.peer_id in owners and good.peer_id in owners
        await fetch(url, good, 1, [i for i, o in enumerate(owners) if o == good.peer_id])
        await good.frames.until(lambda: len(good.plans(1)) == 2)
        later = good.plans(1)[1]
        assert idle.peer_id not in {s.peer_id for s in later.sources}
        (silence,) = silences(records)
        assert silence["peer"] == idle.peer_id and silence["chunks"] == owners.count(idle.peer_id)


async def test_a_tracker_receiver_withdraws_its_wants_of_an_owner_dealt_around():
    """A real peer on the tracker asks the silent owner for its chunks (a 503 server: "not yet",
    again and again); once the hub routes around it, the peer withdraws those wants and takes
    the chunks by the new plan, so it reports no stall of the owner (its stall deadline, 10 s,
    was never reached) and holds v1."""
    data = os.urandom(16 * CHUNK)
    async with tracker() as (hub, key, url, records), answers_503() as dead, \
            Peers(url, 1, relay_stall_s=10.0) as (honest,), seeder(url, "silent", dead) as idle:
        hub.feed(VersionPublished(blob_version(key, 0, V0, chunk_bytes=CHUNK)))
        await probed(hub, 2)
        await until(hub, lambda: holds(honest, 0))
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await until(hub, lambda: holds(honest, 1))
        assert bytes(honest.fetcher.store.stream(1)) == data
        assert [s["peer"] for s in silences(records)] == [idle.peer_id]
        assert hub.statistics().relay_reports_by == {}
