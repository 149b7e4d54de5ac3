"""A peer on a much slower uplink than the rest, in network namespaces shaped by `tc tbf`: the
hub times every uplink itself at join, so even the first version deals the slow peer no more
than its uplink can pass on while the hub sends. Needs root and tc: skipped without them.
How much sooner the fast peers finish is a bench figure (`bench/broadcast.py`, the slow_peer
mode), not asserted here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import broadcast  # noqa: E402
import netns  # noqa: E402

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.system,  # processes in network namespaces
              pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")]


@pytest.mark.parametrize("relay", ["pipelined", "gossip"])
def test_the_slow_peer_gets_no_more_than_its_uplink_carries_from_the_first_version(relay):
    """5 relay processes at 40 Mbit/s and one at 1 Mbit/s. In the first version, dealt before
    any version was measured, the slow peer relays (tracker) or seeds (gossip) at most what
    1 Mbit/s carries in half the hub's sending (the equal share would be a fifth), the fast
    ones share the rest; the version reaches everyone; the hub saw the slow uplink as slow."""
    n, fast, slow = 6, 40_000_000, 1_000_000
    rates = [fast] * n + [slow]
    args = argparse.Namespace(bytes=4 << 20, chunk_bytes=64 << 10, tcp_congestion="cubic")
    with netns.Testbed(n + 1, rates, prefix="e2slow") as bed:
        record = broadcast.run_ours(bed, n, relay, rates, args)
    first = record["first"]
    assert first["complete"] and record["complete"]
    n_chunks = args.bytes // args.chunk_bytes
    dealt = sorted(first["chunks_dealt"].values())
    copies = n - 1 if relay == "pipelined" else 1
    assert sum(dealt) == n_chunks and len(dealt) == n
    assert dealt[0] <= 0.5 * n_chunks * slow / (copies * fast) + 1 < n_chunks / n
    assert dealt[1] >= n_chunks / n  # the fast ones took the slow one's equal share
    uplinks = sorted(record["peer_upload_mbps"].values())
    assert uplinks[0] < 0.25 * uplinks[1]  # the hub measured the slow one as slow
