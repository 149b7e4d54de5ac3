"""What the hub publishes: a version as signed snapshots (full, and a delta against the previous
version), each made by `signed_snapshot`; `VersionFiles`, which keeps them on disk, memory-mapped,
rather than in RAM. How a version spreads is recorded by `echo2p2p.propagation`."""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo2p2p import messages as m
from echo2p2p.snapshot import MapChunks, TensorBytes, build_snapshot


@dataclass(frozen=True)
class Snapshot:
    manifest: m.Manifest
    chunks: Sequence[bytes | memoryview]  # in RAM, or views of a mapped file (VersionFiles)
    signature: bytes = b""

    @property
    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.manifest.chunks)


@dataclass(frozen=True)
class Bases:
    """What the hub keeps to build catch-up deltas to one version (`hub.overlay.catchup`): the raw
    streams of it and of the versions before it still kept (version -> stream), and how its
    manifests are signed."""

    streams: Mapping[int, bytes | memoryview]
    sign: Callable[[m.Manifest], bytes]
    zstd_level: int = 3


@dataclass(frozen=True)
class Published:
    """One version: always in full, and as a delta against the previous version unless an anchor;
    `bases`, if kept, for deltas against older versions (a peer catching up)."""

    full: Snapshot
    delta: Snapshot | None = None
    bases: Bases | None = field(default=None, compare=False, repr=False)

    @property
    def version(self) -> int:
        return self.full.manifest.version


def signed_snapshot(version: int, tensors: Sequence[TensorBytes], *, chunk_bytes: int,
                    zstd_level: int, sign: Callable[[m.Manifest], bytes],
                    base: tuple[int, bytes | memoryview] | None = None,
                    map_chunks: MapChunks = map,
                    files: VersionFiles | None = None) -> Snapshot:
    """`tensors` as one snapshot of `version`, a delta against `base` if given, its manifest
    signed by `sign` (the publisher's versions, catch-up deltas, the tests' blobs: every signed
    snapshot is made here). `map_chunks` codes the chunks (a pool's `map`: in parallel); with
    `files`, each is written to the version's file as it is coded and mapped back."""
    kind = "full" if base is None else "delta"
    if files is not None:
        map_chunks = files.chunk_writer(version, kind, map_chunks)
    manifest, chunks = build_snapshot(version, tensors, chunk_bytes=chunk_bytes,
                                      zstd_level=zstd_level, base=base, map_chunks=map_chunks)
    if files is not None:
        chunks = files.chunks(version, kind, manifest)
    return Snapshot(manifest, chunks, sign(manifest))


# --- retention on disk --------------------------------------------------------------------
#
# A hub keeps, per published version, its raw stream (the base of the next delta and the
# spot-checker's copy) and its full and delta chunks (served to peers). In RAM that is
# (S + 1) x 2P bytes of streams plus keep_versions x (full + delta wire bytes), ~84 GB for a 7B
# model at S = 2; `VersionFiles` writes them to files and maps them back (`mmap`, copy on
# write), so they live in the page cache: pages the kernel reads back on demand and may drop,
# not memory the hub holds. The publisher also keeps views of the newest catch_up_versions + 1
# streams (`Bases`), which `start_hub` keeps as files too (keep_streams).


class VersionFiles:
    """Published versions as files in `directory`: `v<N>.stream` (the raw stream) and
    `v<N>-full.chunks` / `v<N>-delta.chunks` (the wire chunks back to back), memory-mapped.

    Files beyond the newest `keep_streams` streams and `keep_chunks` chunk files are unlinked
    as newer ones are written; a mapping still in use (a peer being served, a check under way)
    stays valid until its last view goes, as unlinked files do on POSIX."""

    def __init__(self, directory: Path, *, keep_streams: int, keep_chunks: int):
        self.directory = directory
        self.keep_streams, self.keep_chunks = max(keep_streams, 1), max(keep_chunks, 1)
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, version: int, kind: str) -> Path:
        """kind: "stream", "full" or "delta"."""
        return self.directory / (f"v{version}.stream" if kind == "stream" else f"v{version}-{kind}.chunks")

    def write_stream(self, version: int, pieces: Iterable[bytes | memoryview]) -> memoryview:
        """`pieces` (the tensors' raw bytes, in manifest order) written as one file, mapped."""
        with _fresh(self.path(version, "stream")) as out:
            for piece in pieces:
                out.write(piece)
        return _mapped(self.path(version, "stream"))

    def chunk_writer(self, version: int, kind: str, map_chunks: Any) -> Any:
        """A `map_chunks` for `snapshot.build_snapshot` that writes each coded chunk to the
        version's `kind` file as it comes out of `map_chunks` (in order) and hands back an empty
        placeholder: the chunks never pile up in RAM. `chunks` then maps them back."""

        def write(fn: Any, *iterables: Any) -> Iterator[tuple[Any, bytes]]:
            with _fresh(self.path(version, kind)) as out:
                for entry, wire in map_chunks(fn, *iterables):
                    out.write(wire)
                    yield entry, b""
        return write

    def chunks(self, version: int, kind: str, manifest: m.Manifest) -> list[memoryview]:
        """The chunks `chunk_writer` wrote, as views of the mapped file."""
        if not manifest.chunks:
            return []
        view, out, pos = _mapped(self.path(version, kind)), [], 0
        for c in manifest.chunks:
            out.append(view[pos:pos + c.wire_bytes])
            pos += c.wire_bytes
        return out

    def forget_before(self, version: int) -> None:
        """Unlink what is past the retention window once `version` is the newest."""
        for path in self.directory.glob("v*"):
            number = path.name[1:].split(".")[0].split("-")[0]
            if not number.isdigit():
                continue
            keep = self.keep_streams if path.suffix == ".stream" else self.keep_chunks
            if int(number) <= version - keep:
                path.unlink(missing_ok=True)


def mapped_state(stream: memoryview, tensors: Iterable[m.TensorEntry]) -> dict[str, Any]:
    """Tensors viewing `stream` (no copy): file-backed when `stream` is a mapped file."""
    import warnings

    import torch

    from echo2p2p.policy.weights import torch_dtype

    state = {}
    with warnings.catch_warnings():  # a copy-on-write map is writable; torch warns regardless
        warnings.simplefilter("ignore", UserWarning)
        for t in tensors:
            dtype = torch_dtype(t.dtype)
            flat = (torch.frombuffer(stream, dtype=dtype, count=math.prod(t.shape), offset=t.offset)
                    if t.nbytes else torch.empty(0, dtype=dtype))
            state[t.name] = flat.view(t.shape)
    return state


def _fresh(path: Path) -> Any:
    """`path` opened for writing as a new file: a mapping of the old one stays intact."""
    path.unlink(missing_ok=True)
    return path.open("wb")


def _mapped(path: Path) -> memoryview:
    """The file at `path`, mapped copy-on-write (writes to a view never reach the file)."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
