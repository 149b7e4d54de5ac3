"""Versions as the hub publishes them: the learner's weights -> signed full and delta snapshots.

`Publisher.build(version, weights)` turns the weights peers will load (exported in
`weights_dtype`) into a `versions.Published`: the snapshot in full and, unless the version is an
anchor (every `anchor_every`-th publication), a delta against the previous one. Chunks are coded
on one thread per CPU (zstd releases the GIL); every manifest is signed with the hub's Ed25519 key,
which `load_or_make_key` keeps in `<run_dir>/hub_key`. If a spot-checker is given, it keeps
each version exactly as published (the weights are not exported twice).

With `files` (`versions.VersionFiles`, what `start_hub` gives it: `<run_dir>/versions`) the raw
stream is written to a file first and everything after reads it from the mapping: chunks go to
their file as they are coded, the delta base and the spot-checker's copy are views of the
mapped streams; each `Published` carries views of the newest `catch_up_versions` + 1 streams
(`versions.Bases`), from which `hub.overlay.catchup` builds a laggard's delta. Given the learner's
`iter_weights` (what `start_hub` passes), each tensor is gathered from the shards, cast and
written to the stream before the next is gathered, so the hub's RAM never holds a whole
version: the model plus one tensor. Given a dict, the dict is the copy (2P bytes for P
parameters in bf16). Without `files`, all of it stays in RAM (tests, benchmarks).
Not streaming: the signed manifest names every chunk's digest, so nothing can be announced
before the last chunk is coded (bench/realsize.py measures what that costs).

Runs in a worker thread (`asyncio.to_thread`); knows nothing of peers, the event loop, the
broadcast or the learner's optimiser. `build` is called once per publication, in order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p import snapshot as snap

from ..config_sections import OverlayConfig
from .versions import Bases, Published, VersionFiles, mapped_state, signed_snapshot

if TYPE_CHECKING:
    from ..learning.spotcheck import SpotChecker


class Publisher:
    """Builds and signs each published version; remembers the last one, the base of a delta."""

    def __init__(self, overlay: OverlayConfig, signing_key: bytes, spot: SpotChecker | None = None,
                 files: VersionFiles | None = None):
        self.overlay = overlay
        self._signing_key = signing_key
        self.spot = spot
        self._files = files
        self._last_stream: tuple[int, bytes | memoryview] | None = None  # the next delta's base
        self._streams: dict[int, bytes | memoryview] = {}  # catch-up bases, the newest last
        self.published = 0  # versions built so far by this process
        self.timings: dict[str, float] = {}  # seconds per stage of the last build

    def build(self, version: int, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]
              ) -> Published:
        """`version` in full, and as a delta against the last one unless it is an anchor.
        `weights`: HF state-dict names -> CPU tensors in `overlay.weights_dtype`, not modified (with
        `files`, not even read once `build` returns); or (name, tensor) pairs, tied names
        already removed, which with `files` are written to the stream one by one as they come
        (`Learner.iter_weights`: the version is never whole in RAM)."""
        import torch

        from echo2p2p.policy.weights import state_to_tensors, tensor_entry

        start = time.perf_counter()
        dtype = getattr(torch, self.overlay.weights_dtype)
        if self._files is not None:  # from here on, read the stream from its file
            entries = (state_to_tensors(weights, dtype) if isinstance(weights, Mapping)
                       else (tensor_entry(name, t, dtype) for name, t in weights))
            layout: list[tuple[str, str, list[int], int]] = []
            stream = self._files.write_stream(version, _laid_out(entries, layout))
            tensors = [(name, dt, shape, stream[at:at + size])
                       for (name, dt, shape, size), at in zip(layout, _offsets(layout))]
        else:
            weights = weights if isinstance(weights, Mapping) else dict(weights)
            tensors = state_to_tensors(weights, dtype)
            stream = b"".join(raw for *_, raw in tensors)
        written = time.perf_counter()
        chunk_bytes = self.overlay.chunk_bytes or snap.auto_chunk_bytes(len(stream))
        # Chunks are independent and zstd releases the GIL: code them on one thread per CPU.
        with ThreadPoolExecutor(os.cpu_count()) as coder:
            snapshot = partial(signed_snapshot, version, tensors, chunk_bytes=chunk_bytes,
                               zstd_level=self.overlay.zstd_level, sign=self._sign,
                               map_chunks=coder.map, files=self._files)
            full = snapshot()
            coded = time.perf_counter()
            delta = None
            if self._last_stream is not None and self.published % self.overlay.anchor_every:
                delta = snapshot(base=self._last_stream)
        if self.spot is not None:  # exactly what peers load
            self.spot.keep(version, weights if self._files is None
                            else mapped_state(stream, full.manifest.tensors))
        self._last_stream = (version, stream)
        self._streams[version] = stream
        for old in list(self._streams)[:-(self.overlay.catch_up_versions + 1)]:
            del self._streams[old]
        self.published += 1
        if self._files is not None:
            self._files.forget_before(version)
        end = time.perf_counter()
        self.timings = {"stream_s": written - start, "full_s": coded - written,
                        "delta_s": end - coded, "build_s": end - start}
        return Published(full, delta, Bases(dict(self._streams), self._sign, self.overlay.zstd_level))

    def _sign(self, manifest: m.Manifest) -> bytes:
        return signing.sign_manifest(self._signing_key, manifest)


def _laid_out(entries: Iterable[tuple], layout: list) -> Iterator[memoryview]:
    """The raw bytes of each entry, in turn, noting (name, dtype, shape, size) in `layout`."""
    for name, dt, shape, raw in entries:
        layout.append((name, dt, shape, len(raw)))
        yield raw


def _offsets(layout: list) -> list[int]:
    """Where each tensor's bytes start in the stream they are laid into back to back."""
    out, pos = [], 0
    for *_, size in layout:
        out.append(pos)
        pos += size
    return out


def load_or_make_key(path: Path) -> bytes:
    """The hub's Ed25519 signing key: read from `path`, or made at first start and kept there;
    either way readable by its owner only (mode 0600)."""
    if path.exists():
        key = path.read_bytes()
        if len(key) != signing.KEY_BYTES:
            raise ValueError(f"{path}: not a raw 32-byte Ed25519 key")
        if path.stat().st_mode & 0o077:  # readable by others (made by hand, or copied)
            path.chmod(0o600)
        return key
    key = signing.new_private_key()
    path.touch(mode=0o600)
    path.write_bytes(key)
    return key
