"""Catch-up deltas: one delta from the version a lagging peer holds whole to the newest.

Theory of operation. A peer k versions behind (back from a disconnect, a cold standby peer put
to work) holds some version b whole: its raw stream, verified against b's signed digest, which
its chunk store keeps as a delta base. Rather than the newest version n in full, or the k
published deltas one after the other, it gets one delta b -> n. The hub computes it directly
from the raw streams of b and n, which the publisher keeps for the newest `catch_up_versions`
+ 1 versions (`versions.Bases`; mapped files, no RAM): same chunk layout as n's full snapshot,
each chunk `echo2p2p.delta.encode` of n's range against b's, the manifest's digest n's stream
digest, signed like every manifest. (Folding the k published deltas would need no old stream,
but k decodes per chunk and the same encode at the end: the hub holds the streams anyway.)
A peer verifies it like any delta: chunk digests, then the rebuilt stream against the digest.

Which b: what this connection reported whole (`PeerConn.stream_version`, a cold standby peer),
else what the same peer key (a process: its chunk store lives and dies with its key) reported
whole on an earlier connection to this hub (`remember`). Both are the peer's own reports, so
nothing is believed beyond this: a wrong b costs that peer only its own download. The tracker
announces the delta and then the version in full; a peer that holds b takes the delta and
ignores the full announcement (one for that version is under way, `echo2p2p.peer_protocol`),
one that does not hold b skips the delta and takes the full one. Never a loop: nothing is
announced again.

`CatchUps` caches one encode per (base, target) for every peer on the same base, encodes in the
event loop's default executor (never on the loop), at most `max_building` at once, and keeps at
most `max_entries` deltas, dropping those for older targets first; a new base when all are for
the newest, or while `max_building` encodes run, gets the full version, as does a base not
kept (never published, or dropped), one too far back, and a delta no smaller than the full one.
So however many peers claim bases, however fast, the hub encodes at most `max_entries` deltas a
published version, `max_building` at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from echo2p2p.errors import LocalProtocolError

from .versions import Published, Snapshot, signed_snapshot

log = logging.getLogger(__name__)

MAX_ENTRIES = 4  # catch-up deltas cached at once (each is its wire bytes, in RAM)
MAX_PEER_KEYS = 4096  # peer keys whose newest whole version is remembered across reconnects
PEER_KEY_BYTES = 32

Key = tuple[int, int]  # (base version, target version)


def build_catch_up(target: Published, base: int) -> Snapshot | None:
    """The signed delta from `base` to `target` (both streams kept in `target.bases`), or None
    when it would not be smaller than `target` in full. Blocking: run it in a thread."""
    bases = target.bases
    assert bases is not None, "only a version with kept bases has catch-up deltas"
    full = target.full.manifest
    stream = memoryview(bases.streams[target.version]).cast("B")
    tensors = [(t.name, t.dtype, t.shape, stream[t.offset:t.offset + t.nbytes]) for t in full.tensors]
    with ThreadPoolExecutor(os.cpu_count()) as coder:  # zstd releases the GIL
        snap = signed_snapshot(target.version, tensors, chunk_bytes=full.chunk_bytes,
                               zstd_level=bases.zstd_level, sign=bases.sign,
                               base=(base, bases.streams[base]), map_chunks=coder.map)
    if snap.manifest.digest != full.digest:
        raise LocalProtocolError(f"the kept stream of v{target.version} is not the one published")
    return snap if snap.wire_bytes < target.full.wire_bytes else None


class CatchUps:
    """The catch-up deltas built and being built, and the bases peers reported, for one hub."""

    def __init__(self, max_versions: int, max_entries: int = MAX_ENTRIES,
                 max_building: int | None = None):
        """`max_versions`: the furthest back a base may be (`OverlayConfig.catch_up_versions`);
        `max_building`: encodes at once (`OverlayConfig.catch_up_builds`; None: `max_entries`)."""
        self.max_versions = max_versions
        self.max_entries = max_entries
        self.max_building = max_entries if max_building is None else max_building
        self._cache: dict[Key, asyncio.Future[Snapshot | None]] = {}  # least recently used first
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

    def delta(self, target: Published, base: int,
              ready: Callable[[Snapshot | None], None]) -> None:
        """Call `ready` (on the loop) with the delta from `base` to `target`, or None for the
        full version: at once if it is the published delta or cached, else once encoded."""
        if target.delta is not None and target.delta.manifest.base_version == base:
            ready(target.delta)
            return
        key = (base, target.version)
        future = self._cache.pop(key, None)
        if future is None:
            for old in [k for k in self._cache if k[1] != target.version]:
                del self._cache[old]  # for an older target: no peer is sent those any more
            if len(self._cache) >= self.max_entries or self.building >= self.max_building:
                ready(None)
                return
            future = asyncio.get_running_loop().run_in_executor(None, build_catch_up, target, base)
            self.building += 1
            future.add_done_callback(self._built)
            self.encodes += 1
        else:
            self.shared += 1
        self._cache[key] = future  # the most recently used, last
        if future.done():
            ready(_outcome(future, key))
        else:
            future.add_done_callback(lambda f: ready(_outcome(f, key)))

    def _built(self, future: asyncio.Future[Snapshot | None]) -> None:
        self.building -= 1

    def snapshot(self, version: int, base: int) -> Snapshot | None:
        """The catch-up delta (base -> version) if built and still cached: chunks are served
        from it."""
        future = self._cache.get((base, version))
        if future is None or not future.done() or future.cancelled() or future.exception():
            return None
        return future.result()


def _outcome(future: asyncio.Future[Snapshot | None], key: Key) -> Snapshot | None:
    """What an encode gave; None (the full version instead) if it failed, which is logged."""
    if future.cancelled():
        return None
    if (exc := future.exception()) is not None:
        log.error("catch-up delta v%d -> v%d failed; sending in full", *key, exc_info=exc)
        return None
    return future.result()
