"""Catch-up by one delta: a peer k versions behind gets one delta from the version it holds whole
to the newest, verified against the target's signed digest; a base the hub no longer keeps, a
delta no smaller than the full version, or a wrong claim of a base gets (or falls back to) the
version in full, once.

The first tests drive the tracker synchronously with real `PeerConn`s (no sockets; what it
sends is read back from their outboxes); the last ones run a real hub and relay peers over
127.0.0.1, where a peer is cut off while the hub publishes k versions, then reconnects.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.assembler import ChunkAssembler
from echo2p2p.hub.overlay.catchup import CatchUps
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.serving.counters import PeerView
from echo2p2p.hub.serving.peers import PeerConn
from echo2p2p.hub.overlay.tracker import VersionTracker
from echo2p2p.hub_protocol import HubProtocol
from echo2p2p.overlay.store import ChunkStore
from echo2p2p.pool import Pool

from tests.blob_versions import blob_version
from tests.conftest import running_peers, tracker, wait_until

KEY = signing.new_private_key()
CHUNK = 16 << 10


def chain(n: int, size: int = 256 << 10, moved: float = 0.005, seed: int = 0) -> list[bytes]:
    """`n` versions of a blob, each with `moved` of the previous one's bytes changed."""
    rng = random.Random(seed)
    data = bytearray(rng.randbytes(size))
    out = [bytes(data)]
    for _ in range(n - 1):
        for i in rng.sample(range(size), int(size * moved)):
            data[i] ^= 1 + rng.randrange(255)
        out.append(bytes(data))
    return out


def version(streams: list[bytes], v: int, key: bytes = KEY):
    """Version `v` of `streams` as the hub publishes it: in full, a delta against v - 1, and
    every older stream kept as a catch-up base."""
    return blob_version(key, v, streams[v], (v - 1, streams[v - 1]) if v else None,
                        chunk_bytes=CHUNK, kept=dict(enumerate(streams[:v])))


class Rig:
    """A tracker over peers that said hello (with a peer key) and were welcomed."""

    def __init__(self, **cfg):
        self.cfg = HubConfig.from_flat(**{"relay": "pipelined", **cfg})  # the tracker unless told
        self.peers: dict[str, PeerConn] = {}
        self.pool = Pool("all", 0.0)
        self.tracker = VersionTracker(self.cfg.overlay, self.peers, self.pool, quarantined=lambda c: False,
                                      on_event=lambda record: None, now=lambda: 0.0)

    def join(self, peer_id: str, peer_key: bytes) -> PeerConn:
        proto = HubProtocol(0.0, 1 << 20)
        hello = m.Hello(peer_id, "relay", "cpu", listen_addr="http://127.0.0.1:9000",
                        peer_key=peer_key)
        proto.receive_frame(m.encode(hello), 0.0)
        conn = PeerConn(peer_id, hello, None, proto, None)  # type: ignore[arg-type]
        conn.post(m.Welcome(peer_id, "run", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7))
        conn.relay = "ok"
        self.peers[peer_id] = conn
        self.pool.join(peer_id, peer_id, 0.0, False, 0.0)
        sent(conn)
        return conn

    def held_before(self, peer_key: bytes, v: int) -> None:
        """A peer with `peer_key` reported `v` (the newest) whole on an earlier connection, now
        gone."""
        old = self.join("gone", peer_key)
        self.tracker.transfer_reported(old, m.TransferReport(v, None, 1.0, 0, 0, []))
        del self.peers["gone"]


def sent(conn: PeerConn) -> list[m.VersionAnnouncement]:
    out = []
    while not conn.outbox.empty():
        out.append(m.decode(conn.outbox.get_nowait()))
        conn.outbox.task_done()
    return [msg for msg in out if isinstance(msg, m.VersionAnnouncement)]


async def settled(rig: Rig, conn: PeerConn) -> list[m.VersionAnnouncement]:
    """What `conn` was announced once every catch-up encode under way has finished."""
    # The tracker's callbacks were added to these futures before gather's own: they have run
    # by the time gather returns.
    await asyncio.gather(*rig.tracker.catchups._cache.values())
    return sent(conn)


def rebuilt(ann: m.VersionAnnouncement, base: bytes, chunks) -> bytes:
    assembler = ChunkAssembler(ann.manifest, base=base)
    for i, chunk in enumerate(chunks):
        assembler.add(i, chunk)
    return bytes(assembler.stream())


async def test_peers_on_one_base_share_one_encode_of_a_signed_delta_that_rebuilds_the_newest():
    """Two peers that held v0 before a disconnect get one delta v0 -> v4 (encoded once), then
    v4 in full as their fallback; the delta is signed, its digest is v4's, and it rebuilds v4
    bit for bit from v0 at a fraction of the full size."""
    streams = chain(5)
    rig = Rig()
    keys = [bytes([i]) * 32 for i in (1, 2)]
    rig.tracker.publish(version(streams, 0))
    for key in keys:
        rig.held_before(key, 0)
    for v in range(1, 5):
        rig.tracker.publish(version(streams, v))
    conns = [rig.join(f"p{i}", key) for i, key in enumerate(keys)]
    for conn in conns:
        rig.tracker.catch_up(conn)
    answers = [await settled(rig, conn) for conn in conns]
    assert (rig.tracker.catchups.encodes, rig.tracker.catchups.shared) == (1, 1)
    full = rig.tracker.newest.full
    for delta, fallback in answers:
        assert (delta.manifest.version, delta.manifest.base_version) == (4, 0)
        assert (fallback.manifest.version, fallback.manifest.base_version) == (4, None)
        assert fallback.plan.sources == []  # pull-only: it relays nothing it may never fetch
        assert delta.manifest.digest == full.manifest.digest
        signing.verify_manifest(signing.public_key(KEY), delta.manifest, delta.signature)
    snap = rig.tracker.snapshot(4, 0)  # what chunk lookups serve
    assert rebuilt(answers[0][0], streams[0], snap.chunks) == streams[4]
    assert snap.wire_bytes < full.wire_bytes / 4
    rig.tracker.catch_up(conns[0])  # announced already: nothing more
    assert sent(conns[0]) == []


async def test_a_peer_one_behind_gets_the_published_delta_without_an_encode():
    streams = chain(3)
    rig = Rig()
    for v in range(3):
        rig.tracker.publish(version(streams, v))
        if v == 1:
            rig.held_before(b"k" * 32, 1)
    conn = rig.join("p", b"k" * 32)
    rig.tracker.catch_up(conn)
    delta, full = sent(conn)
    assert delta.manifest == rig.tracker.newest.delta.manifest and full.manifest.base_version is None
    assert rig.tracker.catchups.encodes == 0


@pytest.mark.parametrize("case", ["too far back", "never held", "not smaller", "off"])
async def test_the_newest_goes_in_full_when_a_delta_would_not_do(case):
    """A base further back than catch_up_versions, no base known, a target that shares nothing
    with its base, or catch-up turned off: one announcement, in full, as a relay."""
    streams = chain(5)
    if case == "not smaller":
        streams[4] = random.Random(9).randbytes(len(streams[4]))
    rig = Rig(catch_up_versions={"too far back": 3, "off": 0}.get(case, 16))
    for v in range(5):
        rig.tracker.publish(version(streams, v))
        if v == 0 and case != "never held":
            rig.held_before(b"k" * 32, 0)
    conn = rig.join("p", b"k" * 32)
    rig.tracker.catch_up(conn)
    (ann,) = await settled(rig, conn)
    assert ann.manifest.base_version is None and ann.plan.sources  # it relays the full one
    assert rig.tracker.catchups.encodes == (1 if case == "not smaller" else 0)


async def test_a_cold_standby_peer_catches_up_from_what_it_reported_on_this_connection():
    streams = chain(4)
    rig = Rig(standby="cold")
    rig.tracker.publish(version(streams, 0))
    conn = rig.join("p", b"")  # no key: only this connection's reports count
    rig.tracker.catch_up(conn)
    rig.tracker.transfer_reported(conn, m.TransferReport(0, None, 1.0, 0, 0, []))
    sent(conn)
    rig.pool.leave("p", 0.0)  # on cold standby (no longer active) while three versions go out
    for v in range(1, 4):
        rig.tracker.publish(version(streams, v))
    assert sent(conn) == []
    rig.pool.join("p", "p", 0.0, True, 0.0)  # put to work
    rig.tracker.catch_up(conn)
    delta, _ = await settled(rig, conn)
    assert (delta.manifest.version, delta.manifest.base_version) == (3, 0)


async def test_the_cache_is_bounded_and_a_version_published_meanwhile_wins():
    """Beyond max_entries distinct bases for the newest, a peer gets the full version; an encode
    that finishes after a newer version went out announces nothing."""
    streams = chain(8)
    rig = Rig()
    rig.tracker.catchups = CatchUps(16, max_entries=2)
    for v in range(6):
        rig.tracker.publish(version(streams, v))
        if v < 3:
            rig.held_before(bytes([v + 1]) * 32, v)
    conns = [rig.join(f"p{b}", bytes([b + 1]) * 32) for b in range(3)]
    for conn in conns:
        rig.tracker.catch_up(conn)
    rig.tracker.publish(version(streams, 6))  # while the two encodes run
    for conn in conns[:2]:
        assert [a.manifest.version for a in await settled(rig, conn)] == [6]
    assert [(a.manifest.version, a.manifest.base_version) for a in sent(conns[2])] == [
        (5, None), (6, None)]  # no room in the cache: v5 in full, then v6 as published
    assert rig.tracker.catchups.encodes == 2


async def test_encodes_run_at_most_catch_up_builds_at_once_and_others_get_the_full_version():
    """With one encode running (catch_up_builds 1), a peer on another base gets the newest in
    full at once, not a second encode; one on the running encode's base shares it."""
    streams = chain(5)
    rig = Rig(catch_up_builds=1)
    for v in range(5):
        rig.tracker.publish(version(streams, v))
        if v < 2:
            rig.held_before(bytes([v + 1]) * 32, v)
    first, other, same = (rig.join(f"p{i}", bytes([b + 1]) * 32) for i, b in enumerate((0, 1, 0)))
    for conn in (first, other, same):
        rig.tracker.catch_up(conn)
    assert rig.tracker.catchups.building == 1
    assert [(a.manifest.version, a.manifest.base_version) for a in sent(other)] == [(4, None)]
    for conn in (first, same):
        assert [a.manifest.base_version for a in await settled(rig, conn)] == [0, None]
    catchups = rig.tracker.catchups
    assert (catchups.encodes, catchups.shared, catchups.building) == (1, 1, 0)


def test_remembered_bases_are_bounded_and_need_a_real_key():
    catchups = CatchUps(16)
    catchups.remember(b"short", 3)
    assert catchups._whole == {}
    catchups.remember(b"k" * 32, 5)
    catchups.remember(b"k" * 32, 3)  # a late report of an older one: it still holds v5
    assert catchups._whole == {b"k" * 32: 5}
    for i in range(5000):
        catchups.remember(i.to_bytes(32, "big"), 1)
    assert len(catchups._whole) == 4096 and (4999).to_bytes(32, "big") in catchups._whole


# --- a real hub and peers over 127.0.0.1 ----------------------------------------------------


async def cut_off_and_publish(hub, key: bytes, peers, streams: list[bytes], versions: range
                              ) -> None:
    """Close the hub's connections to `peers`, then publish `versions` before they can return
    (they wait out a backoff of at least 0.25 s; the hub announces nothing to a closed one)."""
    conns = [c for c in hub.peer_views().values() if c.name in {p.cfg.name for p in peers}]
    for conn in conns:
        await hub.disconnect(conn.peer_id, "test: cut off")
    for v in versions:
        hub.publish(version(streams, v, key))


def conn_of(hub, peer) -> PeerView | None:
    return next((c for c in hub.peer_views().values() if c.name == peer.cfg.name), None)


async def test_peers_back_from_a_disconnect_catch_up_with_one_delta():
    """Two peers holding v0 are cut off while the hub publishes v1..v4; back, each fetches one
    manifest, the delta v0 -> v4 (encoded once for both), a fraction of v4 in full, and holds
    v4 bit for bit."""
    streams = chain(5)
    async with tracker() as (hub, key, url, records), \
            running_peers(url, 2, engine="relay", listen="127.0.0.1:0") as peers:
        hub.publish(version(streams, 0, key))
        await wait_until(lambda: all(p.fetcher.store.newest_stream() == 0 for p in peers)
                         and all(c.stream_version == 0 for c in hub.peer_views().values()))
        fetched = [(p.fetcher.versions_fetched, p.fetcher.downloaded_bytes) for p in peers]
        await cut_off_and_publish(hub, key, peers, streams, range(1, 5))
        await wait_until(lambda: all(p.fetcher.store.newest_stream() == 4 for p in peers)
                         and all((c := conn_of(hub, p)) and c.stream_version == 4 for p in peers))
        delta = hub.snapshot(4, 0)
        assert delta is not None and hub.statistics().catch_up_builds == 1
        assert delta.wire_bytes < hub.snapshot().wire_bytes / 4
        for peer, (n, nbytes) in zip(peers, fetched):
            assert peer.fetcher.versions_fetched == n + 1  # one manifest, not four
            assert peer.fetcher.downloaded_bytes - nbytes == delta.wire_bytes
            assert bytes(peer.fetcher.store.stream(4)) == streams[4]
            assert set(hub.broadcasts()[(4, 0)].members) >= {conn_of(hub, peer).peer_id}


@pytest.mark.parametrize("case", ["base not kept", "lying about its base"])
async def test_a_peer_whose_base_will_not_do_gets_the_newest_in_full_once(case):
    """A peer whose base is past catch_up_versions is sent v4 in full; one that reported v0 but
    no longer holds it (a wrong claim) skips the delta, takes the full version, and goes on
    with the next one as usual: no loop."""
    streams = chain(6)
    overrides = {"catch_up_versions": 2} if case == "base not kept" else {}
    async with tracker(**overrides) as (hub, key, url, records), \
            running_peers(url, 1, engine="relay", listen="127.0.0.1:0") as (peer,):
        hub.publish(version(streams, 0, key))
        await wait_until(lambda: peer.fetcher.store.newest_stream() == 0
                         and all(c.stream_version == 0 for c in hub.peer_views().values()))
        if case == "lying about its base":
            peer.fetcher.store = ChunkStore(peer.cfg.keep_versions)  # claims v0, holds nothing
        n, nbytes = peer.fetcher.versions_fetched, peer.fetcher.downloaded_bytes
        await cut_off_and_publish(hub, key, [peer], streams, range(1, 5))
        await wait_until(lambda: peer.fetcher.store.newest_stream() == 4
                         and (c := conn_of(hub, peer)) is not None and c.stream_version == 4)
        assert peer.fetcher.versions_fetched == n + 1
        assert peer.fetcher.downloaded_bytes - nbytes == hub.snapshot().wire_bytes
        assert bytes(peer.fetcher.store.stream(4)) == streams[4]
        assert hub.statistics().catch_up_builds == (1 if case == "lying about its base" else 0)
        hub.publish(version(streams, 5, key))
        await wait_until(lambda: peer.fetcher.store.newest_stream() == 5)
        assert peer.fetcher.versions_fetched == n + 2
        assert bytes(peer.fetcher.store.stream(5)) == streams[5]
