"""The chunk store: the versions a process holds or is assembling, and their verified chunks.

`ChunkStore` keeps the manifests being assembled or held (the newest `keep` versions), their
verified wire chunks (to serve), and the raw streams of complete versions (the bases of deltas).
A lookup of a chunk not here yet waits for it (`chunk(..., wait_s)`), so a relay forwards a
chunk the moment it is verified. Owned by one event loop; verification runs in a thread.
Knows nothing of HTTP, plans or tickets.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from echo2p2p import messages as m
from echo2p2p.assembler import ChunkAssembler

Key = tuple[int, int | None]  # (version, base version or None for a full snapshot)
GONE = b""  # what a lookup answers for a version this host no longer keeps


def key_order(key: Key) -> tuple[int, int]:
    """A sort key for manifest keys, oldest first: a version's full form (base None) before
    its deltas, never None compared with an int."""
    version, base = key
    return version, -1 if base is None else base


def chunk_path(version: int, base: int | None, index: int) -> str:
    """The URL path of one chunk on any chunk server."""
    return f"/chunk/{version}/{'full' if base is None else base}/{index}"


@dataclass
class Held:
    """One manifest this peer assembles or holds."""

    manifest: m.Manifest
    assembler: ChunkAssembler
    wires: list[bytes | None]

    @property
    def key(self) -> Key:
        return self.manifest.version, self.manifest.base_version


class ChunkStore:
    """The versions this peer holds or is assembling; owned by one event loop."""

    def __init__(self, keep: int = 3):
        self.keep = keep
        self._held: dict[Key, Held] = {}
        self._streams: dict[int, memoryview] = {}  # version -> verified raw stream
        self._pulse = asyncio.Event()  # set and replaced whenever anything arrives

    def begin(self, manifest: m.Manifest) -> Held | None:
        """Start (or resume) assembling `manifest`; None for a delta whose base is not here.
        Another manifest under a key being assembled replaces it: a hub resumed from a
        checkpoint redoes its versions under their numbers (both are signed by the hub)."""
        key = (manifest.version, manifest.base_version)
        if key in self._held and self._held[key].manifest == manifest:
            return self._held[key]
        base = None
        if manifest.base_version is not None:
            base = self._streams.get(manifest.base_version)
            if base is None:
                return None
        held = Held(manifest, ChunkAssembler(manifest, base=base), [None] * len(manifest.chunks))
        self._held[key] = held
        for old in sorted({v for v, _ in self._held})[:-self.keep]:
            for k in [k for k in self._held if k[0] == old]:
                del self._held[k]
        self._notify()
        return held

    async def add(self, held: Held, index: int, data: bytes) -> bool:
        """Verify chunk `index` and keep it to serve; True once all are in.
        Raises SnapshotError if it fails verification.

        Hashing and inflating run in threads; the assembler's claims stay on this loop, so a
        copy that arrives while another is being written is verified, then ignored.
        """
        assembler = held.assembler
        await asyncio.to_thread(assembler.verify, index, data)
        if assembler.claim(index):
            try:
                await asyncio.to_thread(assembler.write, index, data)
            except BaseException:
                assembler.release(index)
                raise
            complete = assembler.commit(index)
        else:
            complete = assembler.complete
        if held.wires[index] is None:
            held.wires[index] = data
            self._notify()
        return complete

    def finish(self, held: Held) -> memoryview:
        """The complete, digest-checked stream of `held`, kept as a base for later deltas.
        Blocking (hashes the stream): call it in a thread. Raises SnapshotError."""
        stream = held.assembler.stream()
        self._streams[held.manifest.version] = stream
        for old in sorted(self._streams)[:-self.keep]:
            del self._streams[old]
        return stream

    def newest_stream(self) -> int | None:
        """The newest version whose whole stream is here."""
        return max(self._streams, default=None)

    def stream(self, version: int) -> memoryview | None:
        """The verified raw stream of `version`, if this store still keeps it whole."""
        return self._streams.get(version)

    async def chunk(self, version: int, base: int | None, index: int, wait_s: float) -> bytes | None:
        """Chunk `index` of manifest (version, base): its bytes, None if it did not arrive within
        `wait_s`, GONE if this peer no longer keeps that version."""
        deadline = time.monotonic() + wait_s
        while True:
            pulse = self._pulse
            held = self._held.get((version, base))
            if held is not None and 0 <= index < len(held.wires) and held.wires[index] is not None:
                return held.wires[index]
            if held is None and self._held and version < min(v for v, _ in self._held):
                return GONE
            if held is not None and not 0 <= index < len(held.wires):
                return GONE
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pulse.wait(), remaining)

    def _notify(self) -> None:
        self._pulse.set()
        self._pulse = asyncio.Event()

