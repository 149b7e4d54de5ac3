"""Catch-up deltas: one delta from the version a lagging peer holds whole to the newest.

Theory of operation. A peer k versions behind (back from a disconnect, a cold standby peer put
to work) holds some version b whole: its raw stream, verified against b's signed digest, which
its chunk store keeps as a delta base. Rather than the newest version n in full, or the k
published deltas one after the other, it gets one delta b -> n. The hub computes it directly
from the raw streams of b and n, which the publisher keeps for the newest `catch_up_versions`
+ 1 versions (`hub.overlay.versions.Bases`; mapped files, no RAM): same chunk layout as n's
full snapshot, each chunk `echo2p2p.delta.encode` of n's range against b's, the manifest's
digest n's stream digest, signed like every manifest (`hub.overlay.catchup.build_catch_up`).
(Folding the k published deltas would need no old stream, but k decodes per chunk and the
same encode at the end: the hub holds the streams anyway.) A peer verifies it like any delta:
chunk digests, then the rebuilt stream against the digest.

Which b: what this connection reported whole (`Peer.stream_version`, a cold standby peer),
else what the same peer key (a process: its chunk store lives and dies with its key) reported
whole on an earlier connection to this hub (`remember`). Both are the peer's own reports, so
nothing is believed beyond this: a wrong b costs that peer only its own download. The tracker
announces the delta and then the version in full; a peer that holds b takes the delta and
ignores the full announcement (one for that version is under way, `echo2p2p.peer_protocol`),
one that does not hold b skips the delta and takes the full one. Never a loop: nothing is
announced again.

`CatchUps` caches one encode per (base, target) for every peer on the same base. It encodes
nothing itself: it emits `BuildDelta`, which the shell runs off the event loop, and hears the
outcome in `built`. At most `max_building` encodes run at once, and at most `max_entries`
deltas are kept, dropping those for older targets first; a new base when all are for the
newest, or while `max_building` encodes run, gets the full version, as does a base not kept
(never published, or dropped), one too far back, and a delta no smaller than the full one.
So however many peers claim bases, however fast, the hub encodes at most `max_entries` deltas a
published version, `max_building` at a time.
"""

from __future__ import annotations

from typing import Any

from .events import Published, Snapshot
from .actions import Outbox
from .overlay_actions import BuildDelta

# What the publisher made (`hub.overlay.versions`): the core reads their fields, never builds one.

MAX_ENTRIES = 4  # catch-up deltas cached at once (each is its wire bytes, in RAM)
MAX_PEER_KEYS = 4096  # peer keys whose newest whole version is remembered across reconnects
PEER_KEY_BYTES = 32

Key = tuple[int, int]  # (base version, target version)
BUILDING = object()  # a cache entry whose encode has not come back yet
MISSING = object()


class CatchUps:
    """The catch-up deltas built and being built, and the bases peers reported, for one hub."""

    def __init__(self, outbox: Outbox, max_versions: int, max_entries: int = MAX_ENTRIES,
                 max_building: int | None = None):
        """`outbox`: the core's (its `BuildDelta`s go there); `max_versions`: the furthest back
        a base may be (`OverlayConfig.catch_up_versions`); `max_building`: encodes at once
        (`OverlayConfig.catch_up_builds`; None: `max_entries`)."""
        self.outbox = outbox
        self.max_versions = max_versions
        self.max_entries = max_entries
        self.max_building = max_entries if max_building is None else max_building
        self._cache: dict[Key, Any] = {}  # -> Snapshot | None | BUILDING, least recently used first
        self._waiting: dict[Key, list[Any]] = {}  # who waits for each encode under way
        self._whole: dict[bytes, int] = {}  # peer key -> newest version it reported whole
        self.building = 0  # encodes running (those of dropped entries too)
        self.encodes = 0  # catch-up deltas encoded so far (the cache's misses)
        self.shared = 0  # catch-up deltas taken from the cache (the cache's hits)

    def remember(self, peer_key: bytes, version: int) -> None:
        """The peer with `peer_key` reported `version` whole (of a manifest the hub keeps)."""
        if len(peer_key) != PEER_KEY_BYTES:
            return  # an older peer without a key: nothing to know it by
        self._whole[peer_key] = max(version, self._whole.pop(peer_key, version))
        while len(self._whole) > MAX_PEER_KEYS:
            del self._whole[next(iter(self._whole))]

    def base_for(self, newest: Published, whole: int | None, peer_key: bytes) -> int | None:
        """The version to send `newest` as a delta from, to a peer that reported `whole` on
        this connection (None: nothing) and has `peer_key`; None: send it in full."""
        base = whole if whole is not None else self._whole.get(peer_key)
        if (base is None or newest.bases is None or base not in newest.bases.streams
                or not 0 < newest.version - base <= self.max_versions):
            return None
        return base

    def delta(self, target: Published, base: int, waiter: Any) -> tuple[bool, Snapshot | None]:
        """The delta from `base` to `target`: (True, it) at once if it is the published delta
        or cached, (True, None) for the full version, or (False, None) when `waiter` is to
        wait for an encode (its outcome comes with `waiter` from `built`)."""
        if target.delta is not None and target.delta.manifest.base_version == base:
            return True, target.delta
        key = (base, target.version)
        entry = self._cache.pop(key, MISSING)
        if entry is MISSING and key in self._waiting:
            entry = BUILDING  # dropped while its encode runs: it still comes back
        if entry is MISSING:
            for old in [k for k in self._cache if k[1] != target.version]:
                del self._cache[old]  # for an older target: no peer is sent those any more
            if len(self._cache) >= self.max_entries or self.building >= self.max_building:
                return True, None
            entry = BUILDING
            self.building += 1
            self.encodes += 1
            self.outbox.emit(BuildDelta(target, base))
        else:
            self.shared += 1
        self._cache[key] = entry  # the most recently used, last
        if entry is not BUILDING:
            return True, entry
        self._waiting.setdefault(key, []).append(waiter)
        return False, None

    def built(self, key: Key, snap: Snapshot | None) -> list[Any]:
        """The encode of `key` came back (None: it failed, or would not be smaller): kept if
        its entry still is; who waited for it."""
        self.building -= 1
        if self._cache.get(key) is BUILDING:
            self._cache[key] = snap
        return self._waiting.pop(key, [])

    def snapshot(self, version: int, base: int) -> Snapshot | None:
        """The catch-up delta (base -> version) if built and still cached: chunks are served
        from it."""
        entry = self._cache.get((base, version))
        return None if entry is BUILDING else entry
