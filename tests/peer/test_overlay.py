"""The overlay over real loopback sockets: a hub as tracker, relay peers with chunk servers."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest

from echo2p2p.hub.serving.server import Hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.overlay.store import GONE

from tests.blob_versions import blob_version
from tests.conftest import tracker, until, wait_until, wait_versions
from echo2p2p.hub.core.events import VersionPublished

CHUNK = 16 << 10


class Peers:
    """Relay peers, each with its own stop switch, so one can be taken down alone."""

    def __init__(self, url: str, n: int, **overrides):
        cfg = PeerConfig(hub_url=url, engine="relay", listen="127.0.0.1:0", relay_stall_s=3.0)
        self.clients = [PeerClient(replace(cfg, name=f"relay-{i}", **overrides)) for i in range(n)]
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> list[PeerClient]:
        self.tasks = [asyncio.create_task(c.run(asyncio.Event())) for c in self.clients]
        return self.clients

    async def __aexit__(self, *exc) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def kill(self, client: PeerClient) -> None:
        """Take a peer down at once: its sockets and its chunk server go away mid-transfer."""
        self.tasks[self.clients.index(client)].cancel()


def propagation(records: list[dict], version: int) -> dict | None:
    """The hub's propagation record of `version`, once logged."""
    return next((r for r in records if r.get("event") == "propagation"
                 and r["version"] == version), None)


def holds(client: PeerClient, version: int) -> bool:
    return client.fetcher.store.newest_stream() == version


async def joined(hub: Hub, n: int) -> None:
    """`n` peers hold v0 and the hub has probed every chunk server advertised."""
    await until(hub, lambda: len(hub.peer_views()) == n and all(
        p.stream_version == 0 and (p.server_url is None or p.relay != "unprobed")
        for p in hub.peer_views().values()))


async def test_version_reaches_every_peer_with_the_hub_uploading_it_about_once():
    """4 relaying peers and a leaf: every one gets v1, bit for bit; the hub sends the version
    about once (a star would send it 5 times); peers send the rest."""
    data = os.urandom(1 << 20)
    async with tracker() as (hub, key, url, records), Peers(url, 4) as relays, \
            Peers(url, 1, listen="") as (leaf,):
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 5)
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await records.wait_for("propagation", version=1)
        assert all(holds(c, 1) for c in [*relays, leaf])
        assert all(bytes(c.fetcher.store.stream(1)) == data for c in [*relays, leaf])
        assert leaf.served_url is None and leaf.meter.served_bytes == 0
    record = propagation(records, 1)
    assert record["complete"] and record["peers"] == 5 and record["t100_s"] is not None
    assert record["hub_upload_copies"] <= 1.3
    assert record["bytes_from_peers"] >= 3 * len(data)


async def test_star_sends_everything_from_the_hub():
    """relay=star: the hub uploads one copy per peer and peers relay nothing."""
    async with tracker(relay="star") as (hub, key, url, records), Peers(url, 3) as relays:
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 3)
        hub.feed(VersionPublished(blob_version(key, 1, os.urandom(256 << 10), chunk_bytes=CHUNK)))
        await records.wait_for("propagation", version=1)
    record = propagation(records, 1)
    assert record["hub_upload_copies"] == pytest.approx(3.0, abs=0.01)
    assert record["bytes_from_peers"] == 0 and all(c.meter.served_bytes == 0 for c in relays)


async def kill_a_relay_mid_version(n: int, check=None, **hub_overrides
                                   ) -> tuple[Hub, list[dict]]:
    """`n` peers on capped uplinks; one relay that has begun serving v1 is taken down; the
    others must still complete it, bit for bit. `check(hub)` runs then, before the peers
    leave; returns the hub and its run log."""
    data = os.urandom(1 << 20)
    async with tracker(upload_limit_mbps=16, **hub_overrides) as (hub, key, url, records):
        peers = Peers(url, n, upload_limit_mbps=16)
        async with peers as relays:
            hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
            await joined(hub, n)
            hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
            # polled: a byte counter that the peers' chunk servers (HTTP) also add to
            await wait_until(lambda: any(c.meter.served_bytes > 0 for c in relays))
            victim = next(c for c in relays if c.meter.served_bytes > 0)
            assert not all(holds(c, 1) for c in relays), "the transfer was over before the kill"
            peers.kill(victim)
            survivors = [c for c in relays if c is not victim]
            await records.wait_for("propagation", version=1)
            assert all(holds(c, 1) and bytes(c.fetcher.store.stream(1)) == data for c in survivors)
            if check is not None:
                check(hub)
    return hub, records


async def test_a_relay_killed_mid_transfer_does_not_stop_the_others():
    """5 peers on capped uplinks; one relay that has begun serving is taken down; the four
    others still complete the version (its chunks re-dealt by the hub)."""
    hub, records = await kill_a_relay_mid_version(5)
    assert propagation(records, 1)["complete"]
    assert sum(b.revision for k, b in hub.core.tracker.broadcasts.items() if k[0] == 1) >= 2  # re-dealt


async def test_a_corrupting_relay_is_reported_and_its_chunks_fetched_elsewhere():
    """A relay that flips a byte in every chunk it serves: receivers reject each bad chunk by
    its digest and report the relay with the chunk's index; the hub fetches that chunk from it
    itself, finds the wrong digest, counts it against the relay's trust once per chunk checked
    and stops routing through it; receivers complete from other sources."""
    data = os.urandom(512 << 10)
    async with tracker() as (hub, key, url, records), Peers(url, 4) as relays:
        bad = relays[0]
        honest = bad.fetcher.store.chunk

        async def corrupt(*args):
            chunk = await honest(*args)
            return chunk if not chunk else bytes([chunk[0] ^ 1]) + chunk[1:]

        bad.fetcher.store.chunk = corrupt
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 4)
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await records.wait_for("propagation", version=1)
        assert all(holds(c, 1) and bytes(c.fetcher.store.stream(1)) == data for c in relays[1:])
    reports = hub.statistics().relay_reports_by
    bad_id = next(pid for pid, n in reports if n == "corrupt")
    assert reports[(bad_id, "corrupt")] >= 1 and {pid for pid, _ in reports} == {bad_id}
    assert bad_id in hub.core.tracker.broadcasts[(1, None)].excluded
    checks = [r for r in records if r.get("event") == "relay_check"]
    assert checks and all(r["accused"] == bad_id and r["verdict"] == "corrupt" for r in checks)
    convicted = {r["chunk"] for r in checks}
    assert hub.statistics().trust_events[bad_id]["bad_chunk"] == len(convicted)
    assert bad_id in hub.statistics().relays_failed  # kept out of the next versions' plans too


async def test_peers_holding_the_base_take_the_delta_and_rebuild_it_exactly():
    """v2 goes out as a delta against v1 to the peers that hold v1, through the overlay, and
    every peer rebuilds v2 bit for bit; a peer that joins later gets v2 in full."""
    v1 = bytearray(os.urandom(256 << 10))
    v2 = bytearray(v1)
    for i in range(0, len(v2), 50):  # 2 % of the bytes move
        v2[i] ^= 0x5A
    async with tracker() as (hub, key, url, records), Peers(url, 3) as relays:
        hub.feed(VersionPublished(blob_version(key, 1, bytes(v1), chunk_bytes=CHUNK)))
        await until(hub, lambda: len(hub.peer_views()) == 3 and all(
            p.stream_version == 1 for p in hub.peer_views().values()))
        hub.feed(VersionPublished(blob_version(key, 2, bytes(v2), base=(1, bytes(v1)), chunk_bytes=CHUNK)))
        await records.wait_for("propagation", version=2)
        assert all(bytes(c.fetcher.store.stream(2)) == v2 for c in relays)
        async with Peers(url, 1) as (late,):
            await wait_versions([late], 2)
            assert bytes(late.fetcher.store.stream(2)) == v2
    record = propagation(records, 2)
    assert record["peers_on_delta"] == 3 and record["complete"]
    assert record["delta_wire_bytes"] < record["full_wire_bytes"] / 5
    assert record["bytes_from_hub"] + record["bytes_from_peers"] <= 3 * record["delta_wire_bytes"] * 1.01


async def test_a_failing_hub_request_is_retried_not_fatal():
    """The hub is the last resort: when it fails a request (here: the first one for each chunk
    answers 404), the peer asks again and still completes the version."""
    data = os.urandom(128 << 10)
    refused: set[int] = set()

    def make_flaky(hub: Hub) -> None:
        honest = hub.chunk_lookup

        async def flaky(version, base, index, wait_s):
            if version == 1 and index not in refused:
                refused.add(index)
                return GONE
            return await honest(version, base, index, wait_s)

        hub.chunk_lookup = flaky

    async with tracker(make_flaky, relay="star") as (hub, key, url, records):
        async with Peers(url, 1) as (peer,):
            hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
            await joined(hub, 1)
            hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
            await wait_versions([peer], 1)
            assert bytes(peer.fetcher.store.stream(1)) == data
    assert len(refused) == len(data) // CHUNK
