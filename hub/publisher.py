"""Versions as the hub publishes them: the learner's weights -> signed full and delta snapshots.

`Publisher.build(version, weights)` turns the weights peers will load (exported in
`weights_dtype`) into a `versions.Published`: the snapshot in full and, unless the version is an
anchor (every `anchor_every`-th publication), a delta against the previous one. Chunks are coded
on one thread per CPU (zstd releases the GIL); every manifest is signed with the hub's Ed25519 key,
which `load_or_make_key` keeps in `<run_dir>/hub_key`. If a spot-checker is given, it keeps
each version exactly as published (the weights are not exported twice).

Runs in a worker thread (`asyncio.to_thread`); knows nothing of peers, the event loop, the
broadcast or the learner's optimiser. `build` is called once per publication, in order.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2p2p import signing
from echo2p2p import snapshot as snap

from .config import HubConfig
from .versions import Published, Snapshot

if TYPE_CHECKING:
    from .spotcheck import SpotChecker


class Publisher:
    """Builds and signs each published version; remembers the last one, the base of a delta."""

    def __init__(self, cfg: HubConfig, signing_key: bytes, spot: SpotChecker | None = None):
        self.cfg = cfg
        self._signing_key = signing_key
        self._spot = spot
        self._last_stream: tuple[int, bytes] | None = None  # the base of the next delta
        self.published = 0  # versions built so far by this process

    def build(self, version: int, weights: Mapping[str, Any]) -> Published:
        """`version` in full, and as a delta against the last one unless it is an anchor.
        `weights`: HF state-dict names -> CPU tensors in `cfg.weights_dtype`, not modified."""
        import torch

        from echo2p2p.policy.weights import state_to_tensors

        dtype = getattr(torch, self.cfg.weights_dtype)
        tensors = state_to_tensors(weights, dtype)
        if self._spot is not None:
            self._spot.keep(version, weights)  # exactly what peers load
        chunk_bytes = self.cfg.chunk_bytes or snap.auto_chunk_bytes(sum(len(t[3]) for t in tensors))
        # Chunks are independent and zstd releases the GIL: code them on one thread per CPU.
        with ThreadPoolExecutor(os.cpu_count()) as coder:
            full = self._sign(*snap.build_snapshot(version, tensors, chunk_bytes=chunk_bytes,
                                                   zstd_level=self.cfg.zstd_level,
                                                   map_chunks=coder.map))
            delta = None
            if self._last_stream is not None and self.published % self.cfg.anchor_every:
                delta = self._sign(*snap.build_snapshot(
                    version, tensors, chunk_bytes=chunk_bytes, zstd_level=self.cfg.zstd_level,
                    base=self._last_stream, map_chunks=coder.map))
        self._last_stream = (version, b"".join(raw for _, _, _, raw in tensors))
        self.published += 1
        return Published(full, delta)

    def _sign(self, manifest: Any, chunks: list[bytes]) -> Snapshot:
        return Snapshot(manifest, chunks, signing.sign_manifest(self._signing_key, manifest))


def load_or_make_key(path: Path) -> bytes:
    """The hub's Ed25519 signing key: read from `path`, or made at first start and kept there."""
    if path.exists():
        key = path.read_bytes()
        if len(key) != signing.KEY_BYTES:
            raise ValueError(f"{path}: not a raw 32-byte Ed25519 key")
        return key
    key = signing.new_private_key()
    path.touch(mode=0o600)
    path.write_bytes(key)
    return key
