"""The shell's side of the hub's overlay parts: it carries out what they ask for beyond a send.

The tracker, the seed watch, the catch-up cache and the relay judges decide in the hub's core
(`hub.core.tracker`, `hub.core.seeding`, `hub.core.catchups`, `hub.core.accusations`) and emit
actions (`hub.core.overlay_actions`). `OverlayShell.run` carries one out: an encode in the
loop's default executor, a timer for the seed watch's next deadline, a probe or a relay check
as a task (`hub.overlay.relay_checks`, `hub.overlay.gossip_check`); what came of each goes back
to the core as an event (`hub.core.events`: a Tick, DeltaBuilt, RelayProbed, RelayChecked,
GossipChecked), as does the chunk route's evidence for the seed watch (ChunkAsked,
ChunkAnswered, ChunkServed). Every task ends with the hub (`close`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from echo2p2p import signing
from echo2p2p.failover import HUB
from echo2p2p.overlay.store import GONE
from echo2p2p.overlay.tickets import Credentials
from echo2p2p.seed_watch import Key

from ..core import events as ev
from ..core.overlay_actions import BuildDelta, CheckGossip, CheckRelay, ProbeRelay, WakeAt
from ..overlay.catchup import build_catch_up
from ..overlay.gossip_check import GossipCheck
from ..overlay.relay_checks import RelayCheck

log = logging.getLogger(__name__)


class OverlayShell:
    """Runs the overlay parts' actions and hands their outcomes back."""

    def __init__(self, signing_key: bytes, run_id: str, *, new_peer_id: Callable[[], str],
                 feed: Callable[[Any], None], snapshot: Callable[[int, int | None], Any],
                 now: Callable[[], float]):
        """`signing_key`: the hub's, for its own ticket (its probes of a new chunk server) and
        the tickets of its checks (b"": a rig without tickets); `new_peer_id`: an id never
        handed out (and journaled), for each check; `feed`: hands an event to the hub's core;
        `snapshot(version, base)`: the manifest the hub keeps (its chunks are served here);
        `now`: the hub's clock."""
        hub = Credentials(run_id, HUB, signing_key, signing.sign_ticket(
            signing_key, run_id, HUB, signing.public_key(signing_key))) if signing_key else None
        self.relay_check = RelayCheck(hub, lambda: Credentials.issued(
            signing_key, run_id, new_peer_id()) if signing_key else None)
        self.gossip_check = GossipCheck(lambda: Credentials.issued(signing_key, run_id,
                                                                   new_peer_id()))
        self._feed, self._snapshot, self._now = feed, snapshot, now
        self._tasks: set[asyncio.Future] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def run(self, action: Any) -> None:
        """Carry out one action of an overlay part."""
        if isinstance(action, WakeAt):
            self._wake_at(action.when)
        elif isinstance(action, BuildDelta):
            future = asyncio.get_running_loop().run_in_executor(
                None, build_catch_up, action.target, action.base)
            self._track(future, lambda f: self._built(action.key, f))
        elif isinstance(action, ProbeRelay):
            self._spawn(self._probe(action))
        elif isinstance(action, CheckRelay):
            self._spawn(self._check_relay(action))
        elif isinstance(action, CheckGossip):
            self._spawn(self._check_gossip(action))
        else:
            raise TypeError(f"not an overlay action: {action!r}")

    # --- what the chunk route tells the seed watch --------------------------------------

    def asked(self, peer_id: str, key: Key, index: int) -> None:
        self._feed(ev.ChunkAsked(peer_id, key, index))

    def answered(self, peer_id: str, key: Key, index: int, fetched: bool) -> None:
        self._feed(ev.ChunkAnswered(peer_id, key, index, fetched))

    def chunk_served(self, version: int, nbytes: int) -> None:
        self._feed(ev.ChunkServed(version, nbytes))

    async def chunk_lookup(self, version: int, base: int | None, index: int,
                           wait_s: float) -> bytes:
        """The hub's side of GET /chunk/...: it holds every chunk of the versions it keeps."""
        snap = self._snapshot(version, base)
        if snap is None or not 0 <= index < len(snap.chunks):
            return GONE
        return snap.chunks[index]

    # --- outcomes ---------------------------------------------------------------------

    def _built(self, key: tuple[int, int], future: asyncio.Future) -> None:
        """An encode came back: None (the full version instead) if it failed, which is logged."""
        snap = None
        if not future.cancelled():
            if (exc := future.exception()) is not None:
                log.error("catch-up delta v%d -> v%d failed; sending in full", *key, exc_info=exc)
            else:
                snap = future.result()
        self._feed(ev.DeltaBuilt(key, snap))

    def _wake_at(self, when: float) -> None:
        """One timer, at the seed watch's next deadline (an earlier one is kept: it looks
        again)."""
        if when >= self._timer_at:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # driven synchronously: the caller ticks by hand
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_later(max(when - self._now(), 0.0), self._tick)

    def _tick(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        self._feed(ev.Tick())

    async def _probe(self, action: ProbeRelay) -> None:
        check = self.relay_check
        ok = await check.probe(action.server_url, action.peer_id, action.version)
        rate = await check.uplink_bps(action.server_url, action.peer_id) if ok else None
        self._feed(ev.RelayProbed(action.peer_id, ok, rate))

    async def _check_relay(self, action: CheckRelay) -> None:
        verdict, elapsed_s = await self.relay_check.fetch(action.server_url, action.accused_id,
                                                          action.manifest, action.index)
        self._feed(ev.RelayChecked(action.check_id, verdict, elapsed_s))

    async def _check_gossip(self, action: CheckGossip) -> None:
        verdict = await self.gossip_check.check(action.server_url, action.accused_id,
                                                action.manifest, action.index)
        self._feed(ev.GossipChecked(action.check_id, verdict))

    # --- tasks ------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None]) -> None:
        self._track(asyncio.ensure_future(coro), self._done)

    def _track(self, future: asyncio.Future, done: Callable[[asyncio.Future], None]) -> None:
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)
        future.add_done_callback(done)

    def _done(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("relay check failed", exc_info=task.exception())

    async def close(self) -> None:
        """Stop the timer, every probe and check under way, and their HTTP clients (an
        encode under way finishes in its thread; its outcome is dropped)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, float("inf")
        checks = [t for t in self._tasks if isinstance(t, asyncio.Task)]
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
        await self.relay_check.close()
        await self.gossip_check.close()
