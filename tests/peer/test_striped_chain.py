"""The striped chain over real loopback sockets: a ring of relays, each feeding one child."""

from __future__ import annotations

import os

from echo2p2p.hub.serving.server import Hub

from tests.blob_versions import blob_version
from tests.conftest import tracker
from tests.peer.test_overlay import (CHUNK, Peers, holds, joined, kill_a_relay_mid_version,
                                     propagation)
from echo2p2p.hub.core.events import VersionPublished


async def test_a_version_goes_round_the_ring_with_the_hub_sending_it_once():
    """4 ring members and a leaf get v1 bit for bit; the hub uploads about one copy for the
    ring (the leaf pulls from first hops); a member uploads to its one child, about 3/4 of
    the version, plus what the leaf pulls from it."""
    data = os.urandom(1 << 20)
    async with tracker(relay="striped-chain") as (hub, key, url, records), \
            Peers(url, 4) as ring, Peers(url, 1, listen="") as (leaf,):
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 5)
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await records.wait_for("propagation", version=1)
        assert all(holds(c, 1) and bytes(c.fetcher.store.stream(1)) == data for c in [*ring, leaf])
        broadcast = hub.core.tracker.broadcasts[(1, None)]
        assert len(broadcast.ring()) == 4  # the leaf is not in it
        assert all(hub.peer_views()[p].server_url for p in broadcast.ring())
        served = [c.meter.served_bytes for c in ring]
    record = propagation(records, 1)
    assert record["complete"] and record["hub_upload_copies"] <= 1.3
    assert all(0.6 * len(data) <= s <= 1.2 * len(data) for s in served), served


async def test_a_ring_member_killed_mid_version_is_spliced_out():
    """On capped uplinks, a member that has begun relaying is taken down: the hub splices
    the ring (its child fetches from its parent, its stripes get new first hops) and the
    others complete the version."""
    def spliced(hub: Hub) -> None:
        broadcast = hub.core.tracker.broadcasts[(1, None)]
        assert len(broadcast.ring()) == 3 and len(broadcast.excluded) == 1

    _, records = await kill_a_relay_mid_version(4, spliced, relay="striped-chain")
    record = propagation(records, 1)
    assert record["complete"]
    assert record["hub_upload_copies"] <= 1.5  # the spliced child is not fed by the hub
