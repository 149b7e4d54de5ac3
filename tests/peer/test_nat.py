"""NAT'd peers in network namespaces: half the peers run no chunk server (nobody can dial them),
every uplink is a real `tc tbf`, the hub runs `--relay gossip`. Needs root and tc: skipped
without them. The time against M/B is a bench figure (`bench/broadcast.py --modes nat`), not
asserted here."""

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


def test_half_the_peers_behind_nat_still_upload_and_the_hub_sends_about_one_copy():
    """6 relay processes, 3 with `--listen ''`, in namespaces shaped to 40 Mbit/s: the version
    reaches every peer, the hub uploads at most 1.3 copies, and every peer, the NAT'd ones too,
    uploaded enough to the others for the hub to measure its rate."""
    n, rate = 6, 40_000_000
    args = argparse.Namespace(bytes=4 << 20, chunk_bytes=64 << 10, tcp_congestion="cubic")
    with netns.Testbed(n + 1, rate, prefix="e2nat") as bed:
        record = broadcast.run_ours(bed, n, "gossip", [rate] * (n + 1), args, nat=0.5)
    assert record["complete"] and record["peers"] == n and record["all_s"] is not None
    assert record["hub_upload_copies"] <= 1.3
    assert len(record["peer_upload_mbps"]) == n  # NAT'd peers included: they uploaded
