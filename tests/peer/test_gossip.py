"""The gossip overlay over real loopback sockets: a hub on --relay gossip, in-process peers with
links (`echo2p2p.overlay.links`), some of them NAT'd (no chunk server), some hostile."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections import Counter
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.frames import decode_frame, encode_frame
from echo2p2p.hub.serving.peers import PeerConn
from echo2p2p.overlay import link as lk
from echo2p2p.overlay.store import GONE
from echo2p2p.overlay.tickets import Credentials

from tests.blob_versions import blob_version
from tests.conftest import Pulse, serving, tracker, until, wait_versions
from tests.peer.test_overlay import CHUNK, Peers, holds, joined, propagation
from echo2p2p.hub.core.events import SentAway, VersionPublished


@pytest.fixture
def hub_frames(monkeypatch) -> Counter:
    """Every message the hub posts to a peer, counted by (type, version)."""
    sent: Counter = Counter()
    post = PeerConn.post

    def counting(self: PeerConn, msg: m.Message) -> None:
        sent[(msg.TYPE, getattr(msg, "version", None) or getattr(
            getattr(msg, "manifest", None), "version", None))] += 1
        post(self, msg)

    monkeypatch.setattr(PeerConn, "post", counting)
    return sent


async def test_gossip_spreads_a_version_with_one_announcement_per_peer(hub_frames):
    """5 peers on --relay gossip: every one rebuilds v1 bit for bit; the hub sends each peer one
    announcement for it and nothing else about it (no plan revision, nothing per chunk), and
    uploads about one copy: the peers send each other the rest over their links."""
    data = os.urandom(1 << 20)
    async with tracker(relay="gossip") as (hub, key, url, records), Peers(url, 5) as peers:
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 5)
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await records.wait_for("propagation", version=1)
        assert all(holds(c, 1) and bytes(c.fetcher.store.stream(1)) == data for c in peers)
        assert all(c.fetcher.links.links for c in peers)
    assert hub_frames[("version", 1)] == 5
    # A plan revision is sent only where the hub found a dealt seeder silent (a peer too slow
    # on a loaded CPU to ask within the seed watch's 1 s grace): its seeds are dealt again.
    silent = [r for r in records if r.get("event") == "seeder_silent"]
    assert silent or not any(tag == "relay_plan" for tag, _ in hub_frames), hub_frames
    record = propagation(records, 1)
    assert record["complete"] and record["peers"] == 5
    assert record["bytes_from_hub"] <= 1.5 * record["full_wire_bytes"]
    assert record["bytes_from_peers"] >= 3 * len(data)


async def test_a_version_completes_with_the_hubs_control_connection_cut():
    """4 peers on capped uplinks; once the hub has served one copy of every chunk it cuts every
    peer's control connection, refuses new ones and stops serving chunks: every peer still
    completes v1 from its links, bit for bit, and reports it once the hub takes it back."""
    data = os.urandom(2 << 20)
    served: set[int] = set()
    serving_one = Pulse()  # at each chunk of v1 the hub serves
    cut = asyncio.Event()

    def control(hub) -> None:
        honest_lookup, honest_greet = hub.chunk_lookup, hub._conns._greet

        async def lookup(version, base, index, wait_s):
            if cut.is_set():
                return GONE
            if version == 1:
                served.add(index)
                serving_one.fire()
            return await honest_lookup(version, base, index, wait_s)

        async def greet(ws, protocol, hello, request):
            if cut.is_set():
                await ws.close(code=m.CLOSE_GOING_AWAY, message=b"control plane down")
                return None
            return await honest_greet(ws, protocol, hello, request)

        hub.chunk_lookup, hub._conns._greet = lookup, greet

    async with tracker(control, relay="gossip", upload_limit_mbps=64) as (hub, key, url, records), \
            Peers(url, 4, upload_limit_mbps=8, reconnect_max_s=0.5) as peers:
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 4)
        v1 = blob_version(key, 1, data, chunk_bytes=CHUNK)
        hub.feed(VersionPublished(v1))
        await serving_one.until(lambda: len(served) == len(v1.full.chunks))
        cut.set()
        for peer_id in hub.peer_views():
            hub.feed(SentAway(peer_id, "control plane down"))
        assert not all(holds(c, 1) for c in peers), "the version was out before the cut"
        await asyncio.wait_for(hub.until(lambda: len(hub.peer_views()) == 0), 60)
        await wait_versions(peers, 1)
        assert all(bytes(c.fetcher.store.stream(1)) == data for c in peers)
        assert not hub.peer_views()  # completed with no control connection at all
        cut.clear()
        await until(hub, lambda: len(hub.peer_views()) == 4 and all(
            p.stream_version == 1 for p in hub.peer_views().values()))


async def test_nated_peers_seed_nothing_and_pull_over_the_links_they_open(caplog):
    """6 peers, 3 of them with no chunk server (nobody can dial them): only the 3 others are
    dealt seeds (a share the hub could not check is one everyone may wait on: issue 42), the
    NAT'd ones pull over the links they dialled, asked first by rank, and the hub uploads
    about one copy. The NAT'd ones are leaves: each is told so in its welcome and says so
    as it joins; the others are not."""
    caplog.set_level("INFO", logger="echo2p2p.peer.client")
    data = os.urandom(1 << 20)
    async with tracker(relay="gossip") as (hub, key, url, records), Peers(url, 3) as public, \
            Peers(url, 3, listen="") as nated:
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 6)
        v1 = blob_version(key, 1, data, chunk_bytes=CHUNK)
        hub.feed(VersionPublished(v1))
        await records.wait_for("propagation", version=1)
        assert all(bytes(c.fetcher.store.stream(1)) == data for c in [*public, *nated])
        assert all(c.served_url is None for c in nated)
        assert all(c.welcome.leaf for c in nated) and not any(c.welcome.leaf for c in public)
        joins = [r.getMessage() for r in caplog.records if r.getMessage().startswith("joined ")]
        leaves = {line.split()[3].rstrip(",") for line in joins if "a leaf: the hub deals" in line}
        assert leaves == {c.welcome.peer_id for c in nated}
        nated_ids = {c.welcome.peer_id for c in nated}
        accepted = [(p, link) for c in public for p, link in c.fetcher.links.links.items()]
        assert {p for p, link in accepted if link.natted} == nated_ids  # served first by rank
        assert all(not link.natted for p, link in accepted if p not in nated_ids)
    record = propagation(records, 1)
    assert record["complete"] and record["peers"] == 6
    assert all(record["chunks_dealt"][p] == 0 for p in nated_ids)
    assert sum(record["chunks_dealt"].values()) == len(v1.full.chunks)
    assert record["bytes_from_hub"] <= 1.5 * record["full_wire_bytes"]
    assert record["bytes_from_peers"] >= 4 * len(data)


def misbehave(client, kind: str) -> None:
    """Make `client`'s links serve badly: corrupt pieces, pieces a byte short, no answer, or a
    refusal (`cancel`) of what they advertise."""
    links = client.fetcher.links
    honest = links.upload

    async def upload(link, piece, slots):
        if kind == "silent":
            await asyncio.Event().wait()  # never answers: cancelled when the link closes
        if kind == "refuse":
            slots.pop(((piece.version, piece.base), piece.index), None)
            await link.send(lk.Cancel(piece.version, piece.base, piece.index))
            return
        data = bytes([piece.data[0] ^ 1]) + piece.data[1:] if kind == "corrupt" else piece.data[:-1]
        await honest(link, replace(piece, data=data), slots)

    links.upload = upload


async def test_hostile_neighbours_are_dropped_and_the_version_completes_from_others():
    """Of 5 peers, one corrupts every piece it serves, one sends pieces a byte short and one
    never answers a want: the two honest peers drop (and ban) each of them and still rebuild v1
    bit for bit, from each other and the hub."""
    data = os.urandom(512 << 10)
    async with tracker(relay="gossip") as (hub, key, url, records), \
            Peers(url, 5, relay_stall_s=2.0) as peers:
        for client, kind in zip(peers, ("corrupt", "short", "silent")):
            misbehave(client, kind)
        honest = peers[3:]
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 5)
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await wait_versions(honest, 1)
        assert all(bytes(c.fetcher.store.stream(1)) == data for c in honest)
        bad = {c.welcome.peer_id for c in peers[:3]}
        assert bad <= set().union(*(c.fetcher.links.banned for c in honest))
        assert not any(c.welcome.peer_id in c2.fetcher.links.banned
                       for c in honest for c2 in honest)
        assert len(hub.peer_views()) == 5  # nothing crashed


def admitted(hub_key: bytes, peer_id: str) -> Credentials:
    """Credentials the hub signed for a peer that never joined (only a test holds its key)."""
    private = signing.new_private_key()
    ticket = signing.sign_ticket(hub_key, "run", peer_id, signing.public_key(private))
    return Credentials("run", peer_id, private, ticket)


HOSTILE_FRAMES = {
    "garbage": b"\x93not msgpack at all",
    "unknown type": encode_frame("shout", lk.Cancel(1, None, 0)),
    "bitfield of the wrong length": encode_frame("have", lk.Have(1, None, b"\xff" * 4096)),
    "had past the manifest": encode_frame("had", lk.Had(1, None, struct.pack("<I", 10_000))),
    "a piece nobody asked for": encode_frame("piece", lk.Piece(1, None, 0, b"x" * 100)),
    "bad index": encode_frame("want", lk.Want(1, None, -5)),
}


@contextlib.asynccontextmanager
async def two_holding_v1(data: bytes):
    """A gossip hub and two peers that both hold v1 (`data`): yields (hub, key, peer, other,
    the hub's records)."""
    async with tracker(relay="gossip") as (hub, key, url, records), Peers(url, 2) as (peer, other):
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 2)
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await wait_versions([peer, other], 1)
        yield hub, key, peer, other, records


async def test_a_link_that_breaks_a_rule_is_closed_with_a_reason():
    """Frames no honest peer sends, each on a fresh link to a peer that holds v1: the link is
    closed with code 1002 and a reason; the peer carries on (still joined, still serving)."""
    data = os.urandom(256 << 10)
    async with two_holding_v1(data) as (hub, key, peer, other, records):
        target, hostile = peer.welcome.peer_id, admitted(key, "p99")
        async with aiohttp.ClientSession() as http:
            for what, frame in HOSTILE_FRAMES.items():
                links = peer.fetcher.links
                await until(links, lambda: "p99" not in links.links)  # the last one
                peer.fetcher.links.banned.clear()
                async with http.ws_connect(peer.served_url + lk.LINK_PATH, params={"id": "p99"},
                                           headers=hostile.header(target)) as ws:
                    await ws.send_bytes(frame)
                    while (msg := await ws.receive()).type is aiohttp.WSMsgType.BINARY:
                        pass  # its have and peers frames
                    assert msg.type is aiohttp.WSMsgType.CLOSE, what
                    assert ws.close_code == m.CLOSE_PROTOCOL_ERROR and msg.extra, what
        assert len(hub.peer_views()) == 2 and bytes(peer.fetcher.store.stream(1)) == data
        assert await peer.fetcher.store.chunk(1, None, 0, 0) is not None


async def test_another_manifest_under_the_same_number_is_never_served_as_ours():
    """A resumed hub redoes v1 with other weights: a link that says (by the digest on its have)
    it holds another manifest under v1's key gets `cancel` for its wants, not our pieces, and
    stays open (as it does through haves of full and delta keys of one version); once it says
    it holds ours, the same want is served."""
    data = os.urandom(256 << 10)
    async with two_holding_v1(data) as (hub, key, peer, other, records):
        ours = peer.fetcher.links.advertised[(1, None)]
        n = len(ours.wires)
        async with aiohttp.ClientSession() as http, http.ws_connect(
                peer.served_url + lk.LINK_PATH, params={"id": "p99"},
                headers=admitted(key, "p99").header(peer.welcome.peer_id)) as ws:

            async def answer(want: int, digest: bytes, n_chunks: int):
                bits = bytes((n_chunks + 7) // 8)
                await ws.send_bytes(encode_frame("have", lk.Have(1, None, bits, digest)))
                await ws.send_bytes(encode_frame("want", lk.Want(1, None, want)))
                while (msg := await ws.receive()).type is aiohttp.WSMsgType.BINARY:
                    rec, _ = decode_frame(msg.data, lk.LINK_LIMITS, lk.FRAMES)
                    if isinstance(rec, (lk.Cancel, lk.Piece)) and rec.index == want:
                        return rec
                raise AssertionError(f"the link closed: {ws.close_code} {msg.extra}")

            refused = await answer(0, b"\x01" * 32, n + 9)  # another manifest and length: no fault
            assert isinstance(refused, lk.Cancel)
            served = await answer(0, ours.manifest.digest, n)
            assert isinstance(served, lk.Piece) and served.data == ours.wires[0]
            for k in [(2, None), (2, 1), (3, 2), (3, None)]:  # full and delta keys of a version
                await ws.send_bytes(encode_frame("have", lk.Have(*k, b"\xff", b"\x02" * 32)))
            forgotten = await answer(1, ours.manifest.digest, n)  # v1 is the oldest of 5 keys
            assert isinstance(forgotten, lk.Cancel)  # the link kept the 3 newest, and is open
        assert len(hub.peer_views()) == 2


async def test_a_link_needs_a_ticket_naming_the_dialler():
    """No ticket, or another peer's ticket: 403 before any websocket."""
    async with tracker(relay="gossip") as (hub, key, url, records), Peers(url, 2) as (peer, other):
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 2)
        target = peer.welcome.peer_id
        async with aiohttp.ClientSession() as http:
            for params, headers in (({"id": "p99"}, {}),
                                    ({"id": "p99"}, other.credentials.header(target))):
                async with http.get(peer.served_url + lk.LINK_PATH, params=params,
                                    headers=headers) as resp:
                    assert resp.status == 403


async def test_a_dialled_end_that_cannot_prove_its_id_takes_no_slot():
    """A server that accepts a link under any id but shows no ticket of that id's (a liar's, at
    an address it spread under an honest or made-up id) is hung up on, and never linked."""
    accepted: list[str] = []

    async def accept(request: web.Request) -> web.WebSocketResponse:
        accepted.append(request.query["id"])
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:
            pass
        return ws

    app = web.Application()
    app.router.add_get(lk.LINK_PATH, accept)
    async with tracker(relay="gossip") as (hub, key, url, records), Peers(url, 1) as [peer], \
            serving(app) as port:
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 1)
        links = peer.fetcher.links
        await until(links, lambda: links.http is not None)  # its first download ran
        links.heard_of([m.RelaySource("p77", f"http://127.0.0.1:{port}")])
        await until(links, lambda: links.unproven == 1)
        assert accepted and "p77" not in links.links and "p77" not in links.known


async def test_a_false_gossip_accusation_costs_the_accused_nothing():
    """A peer reports its neighbour's (whole) piece corrupt: the hub fetches that piece over a
    gossip link itself, under a fresh peer id, finds it intact and changes nothing: no trust
    event for the accused, which stays a relay."""
    data = os.urandom(256 << 10)
    async with two_holding_v1(data) as (hub, key, peer, other, records):
        accused = peer.welcome.peer_id
        await other.send(m.RelayReport(1, accused, "corrupt", 2, None))
        await records.wait_for("relay_check")
        (check,) = [r for r in records if r.get("event") == "relay_check"]
        assert check["verdict"] == "intact" and check["accused"] == accused
        conn = hub.peer_views()[accused]
        assert conn.relay == "ok" and conn.identity not in hub.statistics().trust_events
        assert not hub.statistics().trust_events.get(hub.peer_views()[other.welcome.peer_id].identity)


@pytest.mark.parametrize("kind", ["silent", "refuse"])
async def test_a_peer_that_never_serves_what_it_advertises_is_taken_out_of_relaying(kind):
    """A neighbour that answers no want, or refuses what its `have` claims, is reported; the
    hub's own want of it fares the same, so it is taken out of relaying (out of every neighbour
    sample) without a trust event: slowness proves no lie."""
    data = os.urandom(256 << 10)
    async with two_holding_v1(data) as (hub, key, peer, other, records):
        misbehave(peer, kind)
        accused = peer.welcome.peer_id
        await other.send(m.RelayReport(1, accused, "stall", 0, None))
        await until(hub, lambda: hub.peer_views()[accused].relay == "failed", 60)
        (check,) = [r for r in records if r.get("event") == "relay_check"]
        assert check["verdict"] == "stall"
        assert hub.peer_views()[accused].relays_for is None
        assert hub.peer_views()[accused].identity not in hub.statistics().quarantined
