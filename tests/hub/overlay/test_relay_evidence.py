"""The hub believes no relay report without its own evidence: probes before dealing chunks,
contested chunks fetched and hashed by the hub, asked for as any receiver asks, transfer
reports bounded by what a manifest could carry; peers build chunk URLs from host and port
only."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.pace import DEFAULT_WINDOW, share_rate_bps
from echo2p2p.relay import Broadcast, Member, owners_of
from echo2p2p.session import Session, Side
from echo2p2p.hub.overlay import relay_checks as hub_relays
from echo2p2p.hub.core.accusations import newest_share
from echo2p2p.overlay.download import Download
from echo2p2p.overlay.store import ChunkStore
from echo2p2p.overlay.tickets import TICKET_HEADER, Credentials, Tickets, server_base

from tests.blob_versions import blob_version
from tests.conftest import serving, tracker
from tests.hub.overlay.waiting import Frames, until
from tests.peer.test_overlay import CHUNK, Peers, joined
from echo2p2p.hub.core.events import VersionPublished

V0 = b"\0" * 1024


@pytest.fixture
def quick_checks(monkeypatch):
    """The hub's own checks on shorter deadlines: a probe 1 s (not 5 s) an attempt, 0.2 s
    apart, and a contested chunk asked as a receiver of relay_stall_s 1 s (not 10 s) asks. A
    server that never answers is then judged in 3.4 s, not 19; an honest one on 127.0.0.1
    answers in milliseconds."""
    monkeypatch.setattr(hub_relays, "PROBE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(hub_relays, "PROBE_RETRY_S", 0.2)
    monkeypatch.setattr(hub_relays, "RECEIVER_STALL_S", 1.0)


@contextlib.asynccontextmanager
async def raw_peer(url: str, listen_addr: str | None = None, name: str = "raw"):
    """A hand-made peer connection: hello, welcome, then whatever the test sends. Yields
    (send, welcome, frames received so far)."""
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        session = Session(Side.PEER, 0.0)
        await ws.send_bytes(session.send(m.Hello(name, "relay", "cpu", 0.0, listen_addr, "",
                                                 os.urandom(16), b"")))
        welcome = session.receive((await ws.receive()).data, 0.0)
        frames = Frames()

        async def read() -> None:
            async for frame in ws:
                if frame.type is aiohttp.WSMsgType.BINARY:
                    frames.add(m.decode(frame.data))

        reader = asyncio.create_task(read())
        try:
            yield (lambda msg: ws.send_bytes(m.encode(msg))), welcome, frames
        finally:
            reader.cancel()


async def v0_held(hub, key: bytes, n: int):
    """Publish v0 and wait until the `n` relays hold it and the hub probed them; the first."""
    hub.feed(VersionPublished(blob_version(key, 0, V0, chunk_bytes=CHUNK)))
    await joined(hub, n)
    return next(iter(hub.peer_views().values()))


def publish_owned(hub, key: bytes, peer_id: str) -> int:
    """Publish v1 (16 chunks) and return a chunk `peer_id` relays in its plan."""
    hub.feed(VersionPublished(blob_version(key, 1, os.urandom(16 * CHUNK), chunk_bytes=CHUNK)))
    broadcast = hub.core.tracker.broadcasts[(1, None)]
    return next(i for i in range(broadcast.n_chunks) if broadcast.owner(i) == peer_id)


async def test_accusations_about_chunks_the_accused_was_not_dealt_are_not_checked():
    """An accuser that was not told to fetch the chunk from the accused (another chunk, a
    manifest it was not sent, a version long gone) gets no check: the hub never asks, so the
    accused is never judged on it."""
    async with tracker() as (hub, key, url, records), Peers(url, 2):
        target = await v0_held(hub, key, 2)
        async with raw_peer(url) as (send, welcome, _):
            index = publish_owned(hub, key, target.peer_id)
            other = next(i for i in range(16) if hub.core.tracker.broadcasts[(1, None)].owner(i) != target.peer_id)
            for report in (m.RelayReport(1, target.peer_id, "stall", other, None),
                           m.RelayReport(1, target.peer_id, "stall", index, 0),
                           m.RelayReport(7, target.peer_id, "stall", index, None)):
                await send(report)
            await until(hub, lambda: sum(hub.statistics().relay_reports_by.values()) == 3)
        assert not any(r.get("event") == "relay_check" for r in records)
        assert hub.peer_views()[target.peer_id].relay == "ok"


async def test_a_false_corrupt_accusation_costs_the_accuser_not_the_accused():
    """Three throwaway connections accuse an honest relay of a corrupt chunk: the hub fetches
    that chunk from the relay itself, finds it intact, and each accuser (not the relay) takes a
    false_report; the relay keeps relaying and is never quarantined."""
    async with tracker() as (hub, key, url, records), Peers(url, 2) as relays:
        target = await v0_held(hub, key, 2)
        async with contextlib.AsyncExitStack() as stack:
            accusers = [await stack.enter_async_context(raw_peer(url, name=f"liar-{i}"))
                        for i in range(3)]
            index = publish_owned(hub, key, target.peer_id)
            for send, _, _ in accusers:
                await send(m.RelayReport(1, target.peer_id, "corrupt", index, None))
            await until(hub, lambda: sum(r.get("event") == "relay_check" for r in records) == 3)
            liars = [hub.peer_views()[w.peer_id].identity for _, w, _ in accusers]
        checks = [r for r in records if r.get("event") == "relay_check"]
        assert {r["verdict"] for r in checks} == {"intact"}
        assert all(hub.statistics().trust_events[liar]["false_report"] == 1 for liar in liars)
        stats = hub.statistics()
        assert target.identity not in stats.quarantined and target.identity not in stats.trust_events
        assert hub.peer_views()[target.peer_id].relay == "ok"
        assert target.identity not in hub.statistics().relays_failed
        assert relays  # the relays ran throughout


async def test_one_accuser_is_heard_once_per_manifest():
    """The same accusation repeated on one connection is checked once: a peer cannot make the
    hub fetch a chunk over and over."""
    async with tracker() as (hub, key, url, records), Peers(url, 1):
        target = await v0_held(hub, key, 1)
        async with raw_peer(url) as (send, welcome, _):
            index = publish_owned(hub, key, target.peer_id)
            for _ in range(20):
                await send(m.RelayReport(1, target.peer_id, "corrupt", index, None))
            await until(
                hub, lambda: hub.statistics().relay_reports_by.get((target.peer_id, "corrupt")) == 20)
            await until(hub, lambda: any(r.get("event") == "relay_check" for r in records))
            accuser = hub.peer_views()[welcome.peer_id].identity
            assert hub.statistics().trust_events[accuser]["false_report"] == 1
        assert sum(r.get("event") == "relay_check" for r in records) == 1


async def test_a_relay_address_that_never_answers_is_never_dealt_chunks(quick_checks):
    """A peer advertising a chunk server that accepts connections and never answers fails the
    hub's probe: no relay plan ever names it as an owner, and every honest peer completes each
    version without reporting a stall."""
    dead = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, says nothing
    port = dead.sockets[0].getsockname()[1]
    async with dead, tracker() as (hub, key, url, records), Peers(url, 2) as relays:
        async with raw_peer(url, f"http://127.0.0.1:{port}", "dead") as (_, welcome, frames):
            hub.feed(VersionPublished(blob_version(key, 0, V0, chunk_bytes=CHUNK)))
            await until(hub, lambda: hub.peer_views()[welcome.peer_id].relay != "unprobed", 30)
            assert hub.peer_views()[welcome.peer_id].relay == "failed"
            await until(hub, lambda: sum(p.relay == "ok" and p.stream_version == 0
                                         for p in hub.peer_views().values()) == 2)
            for v in (1, 2):
                hub.feed(VersionPublished(blob_version(key, v, os.urandom(256 << 10), chunk_bytes=CHUNK)))
                await until(hub, lambda v=v: all(c.fetcher.store.newest_stream() == v for c in relays))
            plans = [f.plan if isinstance(f, m.VersionAnnouncement) else f for f in frames
                     if isinstance(f, (m.RelayPlan, m.VersionAnnouncement))]
            assert plans and all(welcome.peer_id not in {s.peer_id for s in p.sources}
                                 for p in plans)
    assert not hub.statistics().relay_reports_by


async def test_a_relay_that_fails_the_hubs_check_stays_out_of_later_versions(quick_checks):
    """A relay the hub itself finds stalled on a contested chunk is routed around at once and
    owns no chunk of any later version."""
    async with tracker() as (hub, key, url, records), Peers(url, 3) as relays:
        hub.feed(VersionPublished(blob_version(key, 0, V0, chunk_bytes=CHUNK)))
        await joined(hub, 3)
        stalling, others = relays[0], relays[1:]

        async def never(version, base, index, wait_s):  # alive, but never has the chunk
            await asyncio.sleep(wait_s)  # the long poll a real server makes, then "not yet"
            return None

        stalling.fetcher.store.chunk = never
        victim = next(p for p in hub.peer_views().values() if p.name == stalling.cfg.name)
        async with raw_peer(url) as (send, _, _):
            index = publish_owned(hub, key, victim.peer_id)
            await send(m.RelayReport(1, victim.peer_id, "stall", index, None))
            await until(hub, lambda: hub.peer_views()[victim.peer_id].relay == "failed", 60)
        stats = hub.statistics()
        assert victim.identity in stats.relays_failed and victim.identity not in stats.trust_events
        await until(hub, lambda: all(c.fetcher.store.newest_stream() == 1 for c in others), 60)
        hub.feed(VersionPublished(blob_version(key, 2, os.urandom(256 << 10), chunk_bytes=CHUNK)))
        await until(hub, lambda: all(c.fetcher.store.newest_stream() == 2 for c in others), 60)
        plan = hub.core.tracker.broadcasts[(2, None)].plan()
        owners = {plan.sources[o].peer_id for o in owners_of(plan) if o != m.HUB_OWNER}
        assert owners and victim.peer_id not in owners


async def test_an_impossible_transfer_report_is_not_believed():
    """A transfer report naming an honest source at more bytes than the manifest holds, or
    faster than any link, moves no upload estimate: every rate stays finite and the next
    version is planned and delivered."""
    async with tracker() as (hub, key, url, records), Peers(url, 2) as relays:
        async with raw_peer(url) as (send, welcome, frames):
            hub.feed(VersionPublished(blob_version(key, 0, V0, chunk_bytes=CHUNK)))
            await until(hub, lambda: sum(p.relay == "ok" and p.stream_version == 0
                                         for p in hub.peer_views().values()) == 2)
            honest = [p.peer_id for p in hub.peer_views().values() if p.peer_id != welcome.peer_id]
            hub.feed(VersionPublished(blob_version(key, 1, os.urandom(512 << 10), chunk_bytes=CHUNK)))
            await frames.until(lambda: any(isinstance(f, m.VersionAnnouncement)
                                         and f.manifest.version == 1 for f in frames))
            size = hub.core.tracker.snapshot(1).wire_bytes
            lies = [m.SourceRate(honest[0], size * 1000, 1.0), m.SourceRate(honest[1], size, 1e-12)]
            await send(m.TransferReport(1, None, 0.001, 0, size, lies))
            # It also says it serves v1, as a peer does: v1 has then spread once the relays
            # serve it, and its rates (the lies with them) are estimated at once, not after
            # the hub cuts the silent liar off (peer_timeout_s).
            await send(m.VersionHeld(1))
            await until(hub, lambda: all(c.fetcher.store.newest_stream() == 1 for c in relays))
            await until(hub, lambda: 1 not in hub.statistics().propagating)
            assert all(math.isfinite(p.upload_bps) and p.upload_bps < 1e12
                       for p in hub.peer_views().values())
            hub.feed(VersionPublished(blob_version(key, 2, os.urandom(256 << 10), chunk_bytes=CHUNK)))
            await until(hub, lambda: all(c.fetcher.store.newest_stream() == 2 for c in relays))


@pytest.mark.parametrize("url, base", [
    ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
    ("http://127.0.0.1:9/anything?x=/chunk/120/full/1&wait=5.0", "http://127.0.0.1:9"),
    ("https://u:pw@relay.example:443/p#frag", "https://relay.example:443"),
    ("http://[::1]:80/", "http://[::1]:80"),
    ("http://host-without-port/", None), ("ftp://h:1", None), ("http://h:99999", None),
    ("not a url", None), ("http://" + "a" * 300 + ":1", None),
])
def test_server_base_keeps_scheme_host_and_port_only(url, base):
    """Chunk requests are built from an advertised URL's scheme, host and port; a URL without
    them is unusable."""
    assert server_base(url) == base


async def test_a_download_never_requests_a_path_or_query_the_source_chose():
    """A relay source whose URL carries its own path and query is asked only for
    /chunk/{version}/{base}/{index}?wait=..., with a request signature naming that source."""
    seen: list[tuple[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path_qs, request.headers.get("X-Echo2-Ticket", "")))
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", record)
    key = signing.new_private_key()
    pub = blob_version(key, 0, os.urandom(64 << 10), chunk_bytes=CHUNK)
    hub_app = web.Application()

    async def from_hub(request: web.Request) -> web.Response:
        return web.Response(body=pub.full.chunks[int(request.match_info["index"])])

    hub_app.router.add_get("/chunk/{version}/{base}/{index}", from_hub)
    me = signing.new_private_key()
    creds = Credentials("run", "p1", me, signing.sign_ticket(key, "run", "p1", signing.public_key(me)))
    store = ChunkStore()
    held = store.begin(pub.full.manifest)
    n = len(pub.full.chunks)
    async with serving(app) as port, serving(hub_app) as hub_port, aiohttp.ClientSession() as http:
        download = Download(store, held, http=http, me="p1", stall_s=2.0, replan_wait_s=0.1,
                            hub_base_url=f"http://127.0.0.1:{hub_port}",
                            report=lambda msg: asyncio.sleep(0), credentials=creds)
        download.set_plan(m.RelayPlan(0, None, 1, [m.RelaySource(
            "p7", f"http://127.0.0.1:{port}/anything?x=/chunk/120/full/1&wait=5.0")],
            b"\0\0\0\0" * n))
        await download.run()
    assert seen, "the source was never asked"
    for path, ticket in seen:
        assert path.startswith("/chunk/0/full/") and "anything" not in path, path
        sig = bytes.fromhex(ticket.rsplit(".", 1)[1])
        assert signing.verify_chunk_auth(signing.public_key(me), "run", "p7", sig)
        assert not signing.verify_chunk_auth(signing.public_key(me), "run", "hub", sig)


async def test_the_hubs_check_asks_as_a_receiver_asks():
    """A chunk the hub checks is asked for as a receiver's download asks for it (path, query,
    every header in order but the ticket), under a ticket of this run for an id of the hub's
    own, never the same twice, with a key of its own and on a connection of its own: only its
    probe at a join carries the hub's ticket, so a relay cannot serve the checks alone well."""
    seen: list[tuple[str, list[tuple[str, str]], str, object]] = []
    key = signing.new_private_key()
    pub = blob_version(key, 0, os.urandom(64 << 10), chunk_bytes=CHUNK)

    async def relay(request: web.Request) -> web.Response:
        seen.append((request.path_qs, [(k, v) for k, v in request.headers.items()
                                       if k != TICKET_HEADER],
                     request.headers.get(TICKET_HEADER, ""),
                     request.transport.get_extra_info("peername")))
        return web.Response(body=pub.full.chunks[int(request.match_info["index"])])

    app = web.Application()
    app.router.add_get("/chunk/{version}/{base}/{index}", relay)
    me = signing.new_private_key()
    receiver = Credentials("run", "p1", me, signing.sign_ticket(key, "run", "p1",
                                                                signing.public_key(me)))
    ids = iter(["p8", "p9"])
    hub = Credentials("run", "hub", key, signing.sign_ticket(key, "run", "hub",
                                                             signing.public_key(key)))
    check = hub_relays.RelayCheck(hub, lambda: Credentials.issued(key, "run", next(ids)))
    store = ChunkStore()
    n = len(pub.full.chunks)
    async with serving(app) as port, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{port}"
        download = Download(store, store.begin(pub.full.manifest), http=http, me="p1",
                            hub_base_url=base, report=lambda msg: asyncio.sleep(0),
                            credentials=receiver)  # the peers' default relay_stall_s
        download.set_plan(m.RelayPlan(0, None, 1, [m.RelaySource("p7", base)], b"\0" * 4 * n))
        await download.run()
        asked = len(seen)
        assert await check.probe(base, "p7", 0)
        verdicts = [await check.fetch(base, "p7", pub.full.manifest, i) for i in (0, 1)]
        await check.close()
    by_receiver = {path: headers for path, headers, _, _ in seen[:asked]}
    probe, *checks = seen[asked:]
    assert [v for v, _ in verdicts] == ["intact", "intact"]
    assert probe[2].startswith("hub.") and probe[0].endswith("?wait=0")
    tickets = Tickets(signing.public_key(key), "run", "p7")
    for i, (path, headers, ticket, connection) in enumerate(checks):
        assert path == f"/chunk/0/full/{i}?wait=5.0" and headers == by_receiver[path]
        peer_id, peer_key = ticket.split(".")[:2]
        assert peer_id == f"p{8 + i}" and peer_key != signing.public_key(key).hex()
        assert tickets(SimpleNamespace(headers={TICKET_HEADER: ticket}))
        assert connection != probe[3]
    assert checks[0][2].split(".")[1] != checks[1][2].split(".")[1]
    assert checks[0][3] != checks[1][3]


def test_a_pace_check_asks_for_the_newest_share_the_relay_serves():
    """The share a "slow" check times is the accused's in the newest manifest where it owns
    chunks (the full one before a delta), at the rate each request of a receiver joining now
    is told to expect; a manifest it was routed out of does not count."""
    key = signing.new_private_key()
    data = {v: os.urandom(8 * CHUNK) for v in (1, 2, 3)}
    pubs = {1: blob_version(key, 1, data[1], chunk_bytes=CHUNK),
            2: blob_version(key, 2, data[2], (1, data[1]), chunk_bytes=CHUNK),
            3: blob_version(key, 3, data[3], chunk_bytes=CHUNK)}
    snaps = {(1, None): pubs[1].full, (2, None): pubs[2].full, (2, 1): pubs[2].delta,
             (3, None): pubs[3].full}
    members = [Member("p1", "http://a:1", 8e6), Member("p2", "http://b:1", 16e6),
               Member("p3", None)]
    broadcasts = {}
    for key_ in snaps:
        broadcasts[key_] = Broadcast(*key_, len(snaps[key_].chunks))
        broadcasts[key_].start(members)
    broadcasts[(3, None)].drop("p1")
    share = newest_share("p1", broadcasts, lambda v, b: snaps.get((v, b)))
    assert share is not None and share.manifest == pubs[2].full.manifest
    assert share.chunks == [i for i in range(8) if broadcasts[(2, None)].owner(i) == "p1"]
    assert share.chunks and share.rate_bps == share_rate_bps(8e6, 2) / DEFAULT_WINDOW
    assert newest_share("p3", broadcasts, lambda v, b: snaps.get((v, b))) is None
