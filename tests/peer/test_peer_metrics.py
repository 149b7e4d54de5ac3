"""A peer's own /metrics over HTTP: relay peers fetching and passing on a version from a hub as
tracker, read back by prometheus_client's parser; the bound on the hub's reject reasons; the
setting that turns it on. (A generating peer's /metrics is read in tests/hub/view/test_metrics.py.)"""

from __future__ import annotations

import os
import re

import aiohttp
import pytest

from echo2p2p.errors import ConfigError
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.metrics import MAX_REASONS, metrics_server, rejected_by_reason

from tests.blob_versions import blob_version
from tests.conftest import running_peers, tracker, until
from tests.hub.view.test_metrics import families, naming_faults, scrape, value
from echo2p2p.hub.core.events import VersionPublished

CHUNK = 16 << 10


async def test_relay_peers_say_what_they_fetched_and_passed_on():
    """3 relay peers take a 1 MiB version: each one's /metrics shows the version it holds, the
    versions it fetched, its bytes by source and the bytes it relayed, as its counters have
    them; between them, the peers passed some of the version on."""
    data = os.urandom(1 << 20)
    async with tracker() as (hub, key, url, records), \
            running_peers(url, 3, engine="relay", listen="127.0.0.1:0", metrics_port=0) as peers, \
            aiohttp.ClientSession() as http:
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await until(hub, lambda: len(hub.peer_views()) == 3 and all(
            p.stream_version == 0 and p.relay != "unprobed" for p in hub.peer_views().values()))
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await records.wait_for("propagation", version=1)
        scraped = [families(await scrape(http, p.metrics_url)) for p in peers]
    for peer, fams in zip(peers, scraped):
        fetcher = peer.fetcher
        assert naming_faults(fams) == []
        assert value(fams, "echo2_peer_info", engine="relay", peer=peer.welcome.peer_id) == 1
        assert value(fams, "echo2_peer_held_version") == peer.version == 1
        assert value(fams, "echo2_peer_versions_fetched_total") == fetcher.versions_fetched == 2
        from_hub = value(fams, "echo2_peer_fetched_bytes_total", source="hub")
        from_peers = value(fams, "echo2_peer_fetched_bytes_total", source="peers")
        assert (from_hub, from_peers) == (fetcher.bytes_from_hub, fetcher.bytes_from_peers)
        assert from_hub + from_peers >= len(data)
        assert value(fams, "echo2_peer_relayed_bytes_total") == peer.meter.served_bytes
        assert value(fams, "echo2_peer_outbox_groups") == 0
    assert sum(value(f, "echo2_peer_relayed_bytes_total") for f in scraped) > 0


def test_reject_reasons_from_the_hub_are_bounded_and_safe():
    """40 distinct reasons, one hostile: at most MAX_REASONS + 1 series, each a safe label, and
    no rejection lost from the total."""
    reasons = {f"reason-{i}": i + 1 for i in range(39)} | {'x"}\n<b>' * 20: 100}
    family = rejected_by_reason(reasons)
    labels = [s.labels["reason"] for s in family.samples]
    assert len(labels) == MAX_REASONS + 1 and "other" in labels
    assert all(re.fullmatch(r"[A-Za-z0-9._-]{1,32}", label) for label in labels)
    assert sum(s.value for s in family.samples) == sum(reasons.values())


async def test_no_metrics_unless_asked_and_a_bad_port_is_refused():
    """The default serves nothing; a port out of range is refused naming the setting."""
    async with metrics_server(PeerClient(PeerConfig())) as url:
        assert url is None
    with pytest.raises(ConfigError, match="metrics_port"):
        PeerConfig(metrics_port=70000)
