"""Catch-up by one delta over real sockets: a real hub and relay peers over 127.0.0.1, where a
peer is cut off while the hub publishes k versions, then reconnects and catches up with one
delta (or, when its base will not do, the newest in full, once). What the hub decides, event
by event, is tested synchronously in tests/hub/core/test_overlay_catchup.py.
"""

from __future__ import annotations

import pytest

from echo2p2p.hub.serving.counters import PeerView
from echo2p2p.overlay.store import ChunkStore

from tests.conftest import running_peers, tracker
from tests.hub.core.test_overlay_catchup import chain, version
from tests.hub.overlay.waiting import until
from echo2p2p.hub.core.events import SentAway, VersionPublished


async def cut_off_and_publish(hub, key: bytes, peers, streams: list[bytes], versions: range
                              ) -> None:
    """Close the hub's connections to `peers`, then publish `versions` before they can return
    (they wait out a backoff of at least 0.25 s; the hub announces nothing to a closed one)."""
    conns = [c for c in hub.peer_views().values() if c.name in {p.cfg.name for p in peers}]
    for conn in conns:
        hub.feed(SentAway(conn.peer_id, "test: cut off"))
    for v in versions:
        hub.feed(VersionPublished(version(streams, v, key)))


def conn_of(hub, peer) -> PeerView | None:
    return next((c for c in hub.peer_views().values() if c.name == peer.cfg.name), None)


async def test_peers_back_from_a_disconnect_catch_up_with_one_delta():
    """Two peers holding v0 are cut off while the hub publishes v1..v4; back, each fetches one
    manifest, the delta v0 -> v4 (encoded once for both), a fraction of v4 in full, and holds
    v4 bit for bit."""
    streams = chain(5)
    async with tracker() as (hub, key, url, records), \
            running_peers(url, 2, engine="relay", listen="127.0.0.1:0") as peers:
        hub.feed(VersionPublished(version(streams, 0, key)))
        await until(hub, lambda: all(p.fetcher.store.newest_stream() == 0 for p in peers)
                         and all(c.stream_version == 0 for c in hub.peer_views().values()))
        fetched = [(p.fetcher.versions_fetched, p.fetcher.downloaded_bytes) for p in peers]
        await cut_off_and_publish(hub, key, peers, streams, range(1, 5))
        await until(hub, lambda: all(p.fetcher.store.newest_stream() == 4 for p in peers)
                         and all((c := conn_of(hub, p)) and c.stream_version == 4 for p in peers))
        delta = hub.core.tracker.snapshot(4, 0)
        assert delta is not None and hub.statistics().catch_up_builds == 1
        assert delta.wire_bytes < hub.core.tracker.snapshot().wire_bytes / 4
        for peer, (n, nbytes) in zip(peers, fetched):
            assert peer.fetcher.versions_fetched == n + 1  # one manifest, not four
            assert peer.fetcher.downloaded_bytes - nbytes == delta.wire_bytes
            assert bytes(peer.fetcher.store.stream(4)) == streams[4]
            assert set(hub.core.tracker.broadcasts[(4, 0)].members) >= {conn_of(hub, peer).peer_id}


@pytest.mark.parametrize("case", ["base not kept", "lying about its base"])
async def test_a_peer_whose_base_will_not_do_gets_the_newest_in_full_once(case):
    """A peer whose base is past catch_up_versions is sent v4 in full; one that reported v0 but
    no longer holds it (a wrong claim) skips the delta, takes the full version, and goes on
    with the next one as usual: no loop."""
    streams = chain(6)
    overrides = {"catch_up_versions": 2} if case == "base not kept" else {}
    async with tracker(**overrides) as (hub, key, url, records), \
            running_peers(url, 1, engine="relay", listen="127.0.0.1:0") as (peer,):
        hub.feed(VersionPublished(version(streams, 0, key)))
        await until(hub, lambda: peer.fetcher.store.newest_stream() == 0
                         and all(c.stream_version == 0 for c in hub.peer_views().values()))
        if case == "lying about its base":
            peer.fetcher.store = ChunkStore(peer.cfg.keep_versions)  # claims v0, holds nothing
        n, nbytes = peer.fetcher.versions_fetched, peer.fetcher.downloaded_bytes
        await cut_off_and_publish(hub, key, [peer], streams, range(1, 5))
        await until(hub, lambda: peer.fetcher.store.newest_stream() == 4
                         and (c := conn_of(hub, peer)) is not None and c.stream_version == 4)
        assert peer.fetcher.versions_fetched == n + 1
        assert peer.fetcher.downloaded_bytes - nbytes == hub.core.tracker.snapshot().wire_bytes
        assert bytes(peer.fetcher.store.stream(4)) == streams[4]
        assert hub.statistics().catch_up_builds == (1 if case == "lying about its base" else 0)
        hub.feed(VersionPublished(version(streams, 5, key)))
        await until(hub, lambda: peer.fetcher.store.newest_stream() == 5)
        assert peer.fetcher.versions_fetched == n + 2
        assert bytes(peer.fetcher.store.stream(5)) == streams[5]
