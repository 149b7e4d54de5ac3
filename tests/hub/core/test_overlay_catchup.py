"""Catch-up by one delta, as the core decides it: a peer k versions behind gets one delta from
the version it holds whole to the newest, verified against the target's signed digest; a base
the hub no longer keeps, a delta no smaller than the full version, or a wrong claim of a base
gets (or falls back to) the version in full, once.

The tracker asks for each encode with a `BuildDelta` and hears the outcome in `delta_built`;
here the test runs the encode (a real one: `hub.overlay.catchup.build_catch_up`) where the
shell would, so the order of events is the test's. A real hub and peers over 127.0.0.1 are in
tests/hub/overlay/test_catchup.py.
"""

from __future__ import annotations

import random

import pytest

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.assembler import ChunkAssembler
from echo2p2p.hub.core.catchups import CatchUps
from echo2p2p.hub.core.actions import Outbox
from echo2p2p.hub.core.overlay_actions import BuildDelta

from tests.blob_versions import blob_version
from tests.hub.overlay.core_rig import Rig as CoreRig
from tests.hub.overlay.core_rig import to

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


class Rig(CoreRig):
    """A tracker over relay peers that said hello with a peer key and were welcomed."""

    def join(self, peer_id: str, peer_key: bytes):  # type: ignore[override]
        return super().join(peer_id, peer_key=peer_key, listen_addr="http://127.0.0.1:9000",
                            active=False)

    def publish(self, v) -> None:
        self.tracker.publish(v, self.clock)
        self.drain()

    def held_before(self, peer_key: bytes, v: int) -> None:
        """A peer with `peer_key` reported `v` (the newest) whole on an earlier connection, now
        gone."""
        old = self.join("gone", peer_key)
        self.tracker.transfer_reported(old, m.TransferReport(v, None, 1.0, 0, 0, []), self.clock)
        del self.peers["gone"]
        self.drain()


def announced(actions, peer) -> list[m.VersionAnnouncement]:
    return [x for x in to(actions, peer.peer_id) if isinstance(x, m.VersionAnnouncement)]


def builds(actions) -> list[tuple[int, int]]:
    return [(x.base, x.target.version) for x in actions if isinstance(x, BuildDelta)]


def rebuilt(ann: m.VersionAnnouncement, base: bytes, chunks) -> bytes:
    assembler = ChunkAssembler(ann.manifest, base=base)
    for i, chunk in enumerate(chunks):
        assembler.add(i, chunk)
    return bytes(assembler.stream())


def test_peers_on_one_base_share_one_encode_of_a_signed_delta_that_rebuilds_the_newest():
    """Two peers that held v0 before a disconnect get one delta v0 -> v4 (encoded once), then
    v4 in full as their fallback; the delta is signed, its digest is v4's, and it rebuilds v4
    bit for bit from v0 at a fraction of the full size."""
    streams = chain(5)
    rig = Rig()
    keys = [bytes([i]) * 32 for i in (1, 2)]
    rig.publish(version(streams, 0))
    for key in keys:
        rig.held_before(key, 0)
    for v in range(1, 5):
        rig.publish(version(streams, v))
    peers = [rig.join(f"p{i}", key) for i, key in enumerate(keys)]
    for peer in peers:
        rig.tracker.catch_up(peer, rig.clock)
    asked = rig.drain()
    assert builds(asked) == [(0, 4)] and not any(announced(asked, p) for p in peers)
    assert (rig.tracker.catchups.encodes, rig.tracker.catchups.shared) == (1, 1)
    assert rig.tracker.snapshot(4, 0) is None  # not served before it is built
    actions = rig.built(asked)
    full = rig.tracker.newest.full
    answers = [announced(actions, p) for p in peers]
    for delta, fallback in answers:
        assert (delta.manifest.version, delta.manifest.base_version) == (4, 0)
        assert (fallback.manifest.version, fallback.manifest.base_version) == (4, None)
        assert fallback.plan.sources == []  # pull-only: it relays nothing it may never fetch
        assert delta.manifest.digest == full.manifest.digest
        signing.verify_manifest(signing.public_key(KEY), delta.manifest, delta.signature)
    snap = rig.tracker.snapshot(4, 0)  # what chunk lookups serve
    assert rebuilt(answers[0][0], streams[0], snap.chunks) == streams[4]
    assert snap.wire_bytes < full.wire_bytes / 4
    rig.tracker.catch_up(peers[0], rig.clock)  # announced already: nothing more
    assert rig.drain() == []


def test_a_peer_one_behind_gets_the_published_delta_without_an_encode():
    streams = chain(3)
    rig = Rig()
    for v in range(3):
        rig.publish(version(streams, v))
        if v == 1:
            rig.held_before(b"k" * 32, 1)
    peer = rig.join("p", b"k" * 32)
    rig.tracker.catch_up(peer, rig.clock)
    actions = rig.drain()
    delta, full = announced(actions, peer)
    assert delta.manifest == rig.tracker.newest.delta.manifest
    assert full.manifest.base_version is None
    assert builds(actions) == [] and rig.tracker.catchups.encodes == 0


@pytest.mark.parametrize("case", ["too far back", "never held", "not smaller", "off"])
def test_the_newest_goes_in_full_when_a_delta_would_not_do(case):
    """A base further back than catch_up_versions, no base known, a target that shares nothing
    with its base, or catch-up turned off: one announcement, in full, as a relay."""
    streams = chain(5)
    if case == "not smaller":
        streams[4] = random.Random(9).randbytes(len(streams[4]))
    rig = Rig(catch_up_versions={"too far back": 3, "off": 0}.get(case, 16))
    for v in range(5):
        rig.publish(version(streams, v))
        if v == 0 and case != "never held":
            rig.held_before(b"k" * 32, 0)
    peer = rig.join("p", b"k" * 32)
    rig.tracker.catch_up(peer, rig.clock)
    asked = rig.drain()
    assert builds(asked) == ([(0, 4)] if case == "not smaller" else [])
    (ann,) = announced(asked + rig.built(asked), peer)
    assert ann.manifest.base_version is None and ann.plan.sources  # it relays the full one
    assert rig.tracker.catchups.encodes == (1 if case == "not smaller" else 0)


def test_a_failed_encode_sends_the_full_version():
    """An encode that fails (the shell logs it and reports None) falls back to the full version,
    as a relay; a later peer on that base is not encoded for again."""
    streams = chain(3)
    rig = Rig()
    for v in range(3):
        rig.publish(version(streams, v))
        if v == 0:
            rig.held_before(b"k" * 32, 0)
    peer = rig.join("p", b"k" * 32)
    rig.tracker.catch_up(peer, rig.clock)
    (key,) = builds(rig.drain())
    rig.tracker.delta_built(key, None, rig.clock)
    (ann,) = announced(rig.drain(), peer)
    assert ann.manifest.base_version is None and ann.plan.sources
    again = rig.join("q", b"k" * 32)
    rig.tracker.catch_up(again, rig.clock)
    actions = rig.drain()
    assert builds(actions) == []
    assert [a.manifest.base_version for a in announced(actions, again)] == [None]


def test_a_cold_standby_peer_catches_up_from_what_it_reported_on_this_connection():
    streams = chain(4)
    rig = Rig(standby="cold")
    rig.publish(version(streams, 0))
    peer = rig.join("p", b"")  # no key: only this connection's reports count
    rig.tracker.catch_up(peer, rig.clock)
    rig.tracker.transfer_reported(peer, m.TransferReport(0, None, 1.0, 0, 0, []), rig.clock)
    rig.drain()
    rig.pool.leave("p", 0.0)  # on cold standby (no longer active) while three versions go out
    for v in range(1, 4):
        rig.tracker.publish(version(streams, v), rig.clock)
        assert announced(rig.drain(), peer) == []
    rig.pool.join("p", "p", 0.0, generates=True, now=0.0)  # put to work
    rig.tracker.catch_up(peer, rig.clock)
    delta, _ = announced(rig.built(rig.drain()), peer)
    assert (delta.manifest.version, delta.manifest.base_version) == (3, 0)


def test_the_cache_is_bounded_and_a_version_published_meanwhile_wins():
    """Beyond max_entries distinct bases for the newest, a peer gets the full version; an encode
    that finishes after a newer version went out announces nothing."""
    streams = chain(8)
    rig = Rig()
    rig.tracker.catchups = CatchUps(rig.outbox, 16, max_entries=2)
    for v in range(6):
        rig.publish(version(streams, v))
        if v < 3:
            rig.held_before(bytes([v + 1]) * 32, v)
    peers = [rig.join(f"p{b}", bytes([b + 1]) * 32) for b in range(3)]
    for peer in peers:
        rig.tracker.catch_up(peer, rig.clock)
    asked = rig.drain()
    assert builds(asked) == [(0, 5), (1, 5)]
    rig.tracker.publish(version(streams, 6), rig.clock)  # while the two encodes run
    actions = asked + rig.drain()
    actions += rig.built(asked)
    for peer in peers[:2]:
        assert [a.manifest.version for a in announced(actions, peer)] == [6]
    assert [(a.manifest.version, a.manifest.base_version) for a in announced(actions, peers[2])] == [
        (5, None), (6, None)]  # no room in the cache: v5 in full, then v6 as published
    assert rig.tracker.catchups.encodes == 2


def test_encodes_run_at_most_catch_up_builds_at_once_and_others_get_the_full_version():
    """With one encode running (catch_up_builds 1), a peer on another base gets the newest in
    full at once, not a second encode; one on the running encode's base shares it."""
    streams = chain(5)
    rig = Rig(catch_up_builds=1)
    for v in range(5):
        rig.publish(version(streams, v))
        if v < 2:
            rig.held_before(bytes([v + 1]) * 32, v)
    first, other, same = (rig.join(f"p{i}", bytes([b + 1]) * 32) for i, b in enumerate((0, 1, 0)))
    for peer in (first, other, same):
        rig.tracker.catch_up(peer, rig.clock)
    assert rig.tracker.catchups.building == 1
    asked = rig.drain()
    assert builds(asked) == [(0, 4)]
    assert [(a.manifest.version, a.manifest.base_version) for a in announced(asked, other)] == [(4, None)]
    actions = rig.built(asked)
    for peer in (first, same):
        assert [a.manifest.base_version for a in announced(actions, peer)] == [0, None]
    catchups = rig.tracker.catchups
    assert (catchups.encodes, catchups.shared, catchups.building) == (1, 1, 0)


def test_remembered_bases_are_bounded_and_need_a_real_key():
    catchups = CatchUps(Outbox(), 16)
    catchups.remember(b"short", 3)
    assert catchups._whole == {}
    catchups.remember(b"k" * 32, 5)
    catchups.remember(b"k" * 32, 3)  # a late report of an older one: it still holds v5
    assert catchups._whole == {b"k" * 32: 5}
    for i in range(5000):
        catchups.remember(i.to_bytes(32, "big"), 1)
    assert len(catchups._whole) == 4096 and (4999).to_bytes(32, "big") in catchups._whole
