"""The shell's side of the overlay parts (`hub.serving.overlay_shell`): it serves the chunks the
tracker keeps, and runs a catch-up encode off the loop and hands it back as an event."""

from __future__ import annotations

import asyncio

from echo2p2p import messages as m
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.core import events as ev
from echo2p2p.hub.core.actions import Outbox
from echo2p2p.hub.core.tracker import VersionTracker
from echo2p2p.hub.serving.overlay_shell import OverlayShell
from echo2p2p.overlay.store import GONE
from echo2p2p.pool import Pool

from tests.blob_versions import blob_version
from tests.hub.core.test_overlay_catchup import chain, version
from tests.hub.overlay.core_rig import Rig

KEY = bytes(range(32))
BLOB = b"\1" * (1 << 18)


class Shelled:
    """A tracker whose overlay actions a real `OverlayShell` carries out (on a clock that stands
    still), over `peers`; what comes back as an event is handed to the tracker, as the core
    hands it (`hub.core.core.HubCore`)."""

    def __init__(self, peers: dict | None = None, **cfg):
        self.events: list[object] = []
        self.changed = asyncio.Event()
        self.cfg = HubConfig.from_flat(**{"relay": "pipelined", **cfg})
        self.peers = {} if peers is None else peers
        self.outbox = Outbox()
        self.tracker = VersionTracker(self.cfg.overlay, self.peers, Pool("all", 0.0),
                                      self.outbox, quarantined=lambda p: False)
        self.shell = OverlayShell(b"", "run", new_peer_id=lambda: "p9", feed=self._feed,
                                  snapshot=self.tracker.snapshot, now=lambda: 0.0)

    def carry_out(self) -> None:
        """The tracker's overlay actions so far, to the shell."""
        for action in self.outbox.drain():
            self.shell.run(action)

    def _feed(self, event: object) -> None:
        if isinstance(event, ev.DeltaBuilt):
            self.tracker.delta_built(event.key, event.snapshot, 0.0)
        self.events.append(event)
        self.changed.set()


def test_the_hub_serves_the_chunks_of_the_versions_it_keeps():
    """Its chunks while a version is kept, GONE once newer ones have pushed it out."""
    rig = Shelled(keep_versions=2)
    rig.tracker.publish(blob_version(KEY, 0, BLOB), 0.0)
    first = asyncio.run(rig.shell.chunk_lookup(0, None, 0, 0.0))
    assert first == rig.tracker.snapshot(0, None).chunks[0]
    assert asyncio.run(rig.shell.chunk_lookup(0, None, 99, 0.0)) is GONE
    for v in (1, 2):
        rig.tracker.publish(blob_version(KEY, v, BLOB), 0.0)
    assert rig.tracker.snapshot(0, None) is None and sorted(rig.tracker.published) == [1, 2]
    assert asyncio.run(rig.shell.chunk_lookup(0, None, 0, 0.0)) is GONE


async def test_an_encode_runs_off_the_loop_and_its_delta_is_announced_when_it_comes_back():
    """A `BuildDelta` runs in the loop's executor; when it is done the tracker hears it and
    the waiting peer is announced the delta, then the full version (the core is fed DeltaBuilt)."""
    streams = chain(3)
    rig = Rig()  # its peers post their sends to its outbox; the rest goes to the shell
    shelled = Shelled(rig.peers)
    rig.tracker = shelled.tracker
    for v in range(3):
        rig.tracker.publish(version(streams, v), 0.0)
        if v == 0:
            gone = rig.join("gone", peer_key=b"k" * 32, active=False)
            rig.tracker.transfer_reported(gone, m.TransferReport(0, None, 1.0, 0, 0, []), 0.0)
            del rig.peers["gone"]
    peer = rig.join("p", peer_key=b"k" * 32, active=False)
    rig.tracker.catch_up(peer, 0.0)
    assert rig.tracker.catchups.building == 1 and rig.drain() == []  # nothing sent yet
    shelled.carry_out()
    async with asyncio.timeout(60):
        await shelled.changed.wait()
    sends = [a.message for a in rig.drain()]
    assert [(s.manifest.version, s.manifest.base_version) for s in sends] == [(2, 0), (2, None)]
    assert rig.tracker.catchups.building == 0
