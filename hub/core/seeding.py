"""The hub's seed watch at work: who may be dealt chunks, the chunk route watched, one deadline.

`Seeding` keeps the core's `echo2p2p.seed_watch.SeedWatch`. The tracker asks it each member's
cap (`Member.max_share`: a probation share, none while benched) and tells it every share it
deals and every manifest a peer reports whole; the hub's chunk route (`hub.overlay.seeding`)
tells it each request a ticket holder makes and how it ended (the ticket names the asker, and
is checked before anything counts). It owns no timer: whenever the watch's next deadline moves
earlier it emits `WakeAt`, and `tick(now)` hands each peer silent by then back to the tracker
and records it. What counts as silent is the core's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from echo2p2p.seed_watch import Key, SeedWatch, Silence, WatchPolicy

from .actions import Outbox, Record
from .overlay_actions import WakeAt

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .peer import Peer

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side


class Seeding:
    """The seed watch, fed by the tracker and the chunk route, woken by the core's ticks."""

    def __init__(self, outbox: Outbox, policy: WatchPolicy | None = None):
        """`outbox`: the core's (its `WakeAt` and `Record`s go there)."""
        self.watch = SeedWatch(policy)
        self.outbox = outbox
        self._wake_at = float("inf")  # the earliest `WakeAt` asked for and not yet ticked

    def cap(self, peer: Peer, now: float) -> int | None:
        """`peer`'s `Member.max_share` now."""
        return self.watch.cap(peer.identity, now)

    def dealt(self, key: Key, shares: dict[str, list[int]], peers: Mapping[str, Peer],
              chunk_bytes: int, hub_bps: float | None, now: float) -> None:
        """`shares` of manifest `key` (largest chunk `chunk_bytes`) were dealt at `now`, with
        the hub sending at `hub_bps` (the grace is a few chunk times at it)."""
        grace_s = self.watch.policy.grace_s(chunk_bytes, hub_bps)
        for peer_id, chunks in shares.items():
            if chunks and (peer := peers.get(peer_id)) is not None:
                self.watch.dealt(key, peer_id, peer.identity, chunks, grace_s, now)
        self._schedule()

    def whole(self, peer: Peer, key: Key, now: float) -> None:
        self.watch.whole(peer.peer_id, key, now)

    def superseded(self, version: int, now: float) -> None:
        self.watch.superseded(version, now)

    def left(self, peer_id: str, now: float) -> None:
        self.watch.left(peer_id, now)

    def asked(self, peer_id: str, key: Key, index: int, now: float) -> None:
        """A ticket holder's request for chunk `index` of `key` reached the hub's chunk route."""
        self.watch.asked(peer_id, key, index, now)

    def answered(self, peer_id: str, key: Key, index: int, fetched: bool, now: float) -> None:
        """That request ended: the chunk sent (`fetched`, a 200) or not."""
        self.watch.answered(peer_id, key, index, fetched, now)
        self._schedule()

    def _schedule(self) -> None:
        """Ask for one tick at the watch's next deadline (an earlier one asked is kept: it
        looks again, and asks anew)."""
        wake = self.watch.wake_at()
        if wake is None or wake >= self._wake_at:
            return
        self._wake_at = wake
        self.outbox.emit(WakeAt(wake))

    def due(self, now: float) -> list[Silence]:
        """Every peer silent at `now` (each found once); the caller records each
        (`silent`) and deals its share."""
        if now >= self._wake_at:
            self._wake_at = float("inf")
        return self.watch.due(now)

    def silent(self, silence: Silence) -> None:
        """Log and record one silent peer."""
        version, base = silence.key
        log.info("%s asked the hub for nothing of v%d%s for %.1f s: its %d unfetched "
                 "chunk(s) dealt to others; no share for %.0f s", silence.peer_id, version,
                 "" if base is None else f" (delta from v{base})", silence.quiet_s,
                 len(silence.chunks), silence.bench_s)
        self.outbox.emit(Record({
            "event": "seeder_silent", "peer": silence.peer_id,
            "identity": silence.identity, "version": version, "base_version": base,
            "chunks": len(silence.chunks), "quiet_s": round(silence.quiet_s, 3),
            "bench_s": silence.bench_s}))

    def rearm(self) -> None:
        """After a tick's re-deals: the next deadline, if any."""
        self._schedule()
