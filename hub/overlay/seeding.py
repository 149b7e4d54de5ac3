"""The hub's seed watch at work: who may be dealt chunks, the chunk route watched, one timer.

`Seeding` keeps the core's `echo2p2p.seed_watch.SeedWatch`. The tracker asks it each member's
cap (`Member.max_share`: a probation share, none while benched) and tells it every share it
deals and every manifest a peer reports whole; the hub's chunk route, wrapped by `watched`,
tells it each request a ticket holder makes and how it ended (the ticket names the asker, and
is checked before anything counts); one timer, moved to the core's `wake_at`, hands each silent
peer to `redeal` (the tracker's) and logs it. What counts as silent is the core's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from echo2p2p.overlay.tickets import TICKET_HEADER, Tickets
from echo2p2p.seed_watch import Key, SeedWatch, Silence, WatchPolicy

from ..core.peer import Peer as PeerConn

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Seeding:
    """The seed watch, fed by the tracker and the chunk route, woken by its own timer."""

    def __init__(self, redeal: Callable[[Silence], None], *,
                 on_event: Callable[[dict[str, Any]], None], now: Callable[[], float],
                 hub_bps: Callable[[], float | None], policy: WatchPolicy | None = None):
        """`redeal(silence)`: deal a silent peer's chunks to others; `on_event`: the run log;
        `now`: the hub's clock (the timer's loop must keep the same one); `hub_bps`: the hub's
        send rate as estimated now (the grace is a few chunk times at it)."""
        self.watch = SeedWatch(policy)
        self._redeal, self._on_event, self._now, self._hub_bps = redeal, on_event, now, hub_bps
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def cap(self, conn: PeerConn) -> int | None:
        """`conn`'s `Member.max_share` now."""
        return self.watch.cap(conn.identity, self._now())

    def dealt(self, key: Key, shares: dict[str, list[int]], peers: dict[str, PeerConn],
              chunk_bytes: int) -> None:
        """`shares` of manifest `key` (largest chunk `chunk_bytes`) were dealt just now."""
        now = self._now()
        grace_s = self.watch.policy.grace_s(chunk_bytes, self._hub_bps())
        for peer_id, chunks in shares.items():
            if chunks and (conn := peers.get(peer_id)) is not None:
                self.watch.dealt(key, peer_id, conn.identity, chunks, grace_s, now)
        self._schedule()

    def whole(self, conn: PeerConn, key: Key) -> None:
        self.watch.whole(conn.peer_id, key, self._now())

    def superseded(self, version: int) -> None:
        self.watch.superseded(version, self._now())

    def left(self, peer_id: str) -> None:
        self.watch.left(peer_id, self._now())

    def watched(self, handler: Handler, tickets: Tickets) -> Handler:
        """The hub's chunk route `handler`, telling the watch who asked for which chunk and
        whether it was sent (200). A request without a valid ticket counts for nobody."""
        async def handle(request: web.Request) -> web.StreamResponse:
            asked = asker(request, tickets)
            if asked is None:
                return await handler(request)
            peer_id, key, index = asked
            self.watch.asked(peer_id, key, index, self._now())
            fetched = False
            try:
                response = await handler(request)
                fetched = response.status == 200
                return response
            finally:
                self.watch.answered(peer_id, key, index, fetched, self._now())
                self._schedule()

        return handle

    def _schedule(self) -> None:
        """One timer, at the watch's next deadline (an early one is kept: it looks again)."""
        wake = self.watch.wake_at()
        if wake is None or wake >= self._timer_at:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # driven synchronously (a test rig): `check` is called by hand
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake
        self._timer = loop.call_later(max(wake - self._now(), 0.0), self.check)

    def check(self) -> None:
        """Deal the share of every peer silent now to others, and log each once."""
        self._timer, self._timer_at = None, float("inf")
        for silence in self.watch.due(self._now()):
            version, base = silence.key
            log.info("%s asked the hub for nothing of v%d%s for %.1f s: its %d unfetched "
                     "chunk(s) dealt to others; no share for %.0f s", silence.peer_id, version,
                     "" if base is None else f" (delta from v{base})", silence.quiet_s,
                     len(silence.chunks), silence.bench_s)
            self._on_event({"event": "seeder_silent", "peer": silence.peer_id,
                            "identity": silence.identity, "version": version,
                            "base_version": base, "chunks": len(silence.chunks),
                            "quiet_s": round(silence.quiet_s, 3), "bench_s": silence.bench_s})
            self._redeal(silence)
        self._schedule()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, float("inf")


def asker(request: web.Request, tickets: Tickets) -> tuple[str, Key, int] | None:
    """(peer id, manifest, chunk index) of a chunk request whose ticket verifies, else None."""
    holder = tickets.holder(request.headers.get(TICKET_HEADER, ""))
    if holder is None or not holder[0]:
        return None  # no valid ticket (or a hub that issues none: nobody can be told apart)
    info = request.match_info
    try:
        version, index = int(info["version"]), int(info["index"])
        base = None if info["base"] == "full" else int(info["base"])
    except (KeyError, ValueError):
        return None
    return holder[0], (version, base), index
