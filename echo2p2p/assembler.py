"""Assembling a version: its chunks in, in any order, verified, rebuilt into one raw stream.

`ChunkAssembler` checks each chunk against the manifest (size, then blake2b-256 of the wire
bytes), inflates it (or rebuilds a delta chunk against the base stream) into its slice of one
buffer of `total_bytes`, and checks the whole stream against the manifest digest at the end.
It knows no threads, files or clocks: whoever owns it keeps its claims; the heavy steps
(`verify`, `write`) are safe to run in worker threads, one per claimed chunk. The layout rules
live in `echo2p2p.snapshot`; this module never builds a version.
"""

from __future__ import annotations

import zstandard

from . import delta
from .errors import LocalProtocolError, SnapshotError
from .messages import Manifest
from .snapshot import CODEC_DELTA, chunk_digest, validate_manifest


class ChunkAssembler:
    """Rebuilds one version from its chunks, in any order, verifying each one.

    A delta manifest needs `base`, the raw stream of its base version; each chunk is rebuilt
    against it as it arrives.

    The bookkeeping (which chunks are in, which are being written) is plain state of whoever
    owns the assembler, with no lock. `add` does everything in the caller's thread. A shell
    that verifies and writes in worker threads keeps the bookkeeping on its own thread:
    `verify` (any thread), then `claim` (owner), `write` (any thread, one per claimed index:
    chunks own disjoint slices of the buffer), then `commit` or, if `write` raised, `release`
    (owner). See `echo2p2p.overlay.store.ChunkStore.add`.
    """

    def __init__(self, manifest: Manifest, *, base: bytes | memoryview | None = None,
                 max_total_bytes: int | None = None) -> None:
        validate_manifest(manifest)
        if max_total_bytes is not None and manifest.total_bytes > max_total_bytes:
            raise SnapshotError(
                f"snapshot of {manifest.total_bytes} bytes exceeds the {max_total_bytes} allowed")
        if (manifest.codec == CODEC_DELTA) != (base is not None):
            raise SnapshotError("a delta needs its base stream, a full snapshot takes none")
        if base is not None and memoryview(base).nbytes != manifest.total_bytes:
            raise SnapshotError(f"base stream has {memoryview(base).nbytes} bytes, "
                                f"the manifest {manifest.total_bytes}")
        self.manifest = manifest
        self._base = memoryview(base).cast("B") if base is not None else None
        self._buffer = bytearray(manifest.total_bytes)
        self._have: set[int] = set()
        self._claimed: set[int] = set()  # claimed, being written, neither committed nor released
        self._received_bytes = 0
        self._stream_verified = False

    @property
    def missing(self) -> list[int]:
        """Indices of the chunks not yet in, ascending."""
        return [i for i in range(len(self.manifest.chunks)) if i not in self._have]

    @property
    def complete(self) -> bool:
        return len(self._have) == len(self.manifest.chunks)

    @property
    def received_bytes(self) -> int:
        """Wire bytes of the verified chunks taken so far (duplicates not counted)."""
        return self._received_bytes

    def add(self, index: int, data: bytes | memoryview) -> bool:
        """Verify chunk `index` and write it in; True once every chunk is in.

        Raises SnapshotError for a bad index, size, hash or payload; the assembler is unchanged
        then and still takes the right bytes later. A chunk already in (or claimed) is checked
        against its digest, then ignored: so whoever gets no error holds verified bytes, and
        may serve them.
        """
        self.verify(index, data)
        if not self.claim(index):
            return self.complete
        try:
            self.write(index, data)
        except BaseException:
            self.release(index)
            raise
        return self.commit(index)

    def verify(self, index: int, data: bytes | memoryview) -> None:
        """Raise SnapshotError unless `data` is chunk `index` by size and digest. Reads only the
        manifest: safe from any thread."""
        chunks = self.manifest.chunks
        if type(index) is not int or not 0 <= index < len(chunks):
            raise SnapshotError(f"chunk index {str(index)[:20]} out of range 0..{len(chunks) - 1}")
        entry = chunks[index]
        nbytes = memoryview(data).nbytes
        if nbytes != entry.wire_bytes:
            raise SnapshotError(f"chunk {index}: {nbytes} bytes, manifest says {entry.wire_bytes}")
        if chunk_digest(data) != entry.digest:
            raise SnapshotError(f"chunk {index}: digest mismatch")

    def claim(self, index: int) -> bool:
        """Take verified chunk `index` to write; False if it is in or claimed already (then the
        copy at hand is a duplicate, to ignore)."""
        if index in self._have or index in self._claimed:
            return False
        self._claimed.add(index)
        return True

    def write(self, index: int, data: bytes | memoryview) -> None:
        """Decode claimed chunk `index` and copy it into its slice of the stream. Touches only
        that slice: safe from any thread, one call per claimed index. Raises SnapshotError for
        a payload that does not inflate to its raw size."""
        if index not in self._claimed:
            raise LocalProtocolError(f"chunk {index} written without a claim")
        entry = self.manifest.chunks[index]
        start = index * self.manifest.chunk_bytes
        if self._base is None:
            raw = _decompress_exactly(data, entry.raw_bytes, index)
        else:
            raw = delta.decode(data, self._base[start:start + entry.raw_bytes])
        self._buffer[start:start + entry.raw_bytes] = raw

    def commit(self, index: int) -> bool:
        """Chunk `index`, claimed and written, is in; True once every chunk is."""
        if index not in self._claimed:
            raise LocalProtocolError(f"chunk {index} committed without a claim")
        self._claimed.discard(index)
        self._have.add(index)
        self._received_bytes += self.manifest.chunks[index].wire_bytes
        return self.complete

    def release(self, index: int) -> None:
        """Give up the claim on chunk `index` (its write failed): a later copy may take it."""
        self._claimed.discard(index)

    def tensors(self) -> list[tuple[str, str, list[int], memoryview]]:
        """(name, dtype, shape, raw bytes) per tensor, views into the assembled stream.

        Raises SnapshotError if chunks are missing or the stream fails the manifest digest.
        """
        view = self.stream()
        return [(t.name, t.dtype, list(t.shape), view[t.offset:t.offset + t.nbytes])
                for t in self.manifest.tensors]

    def stream(self) -> memoryview:
        """The whole verified raw stream (a base for the next delta).

        Raises SnapshotError if chunks are missing or the stream fails the manifest digest.
        """
        if not self.complete:
            raise SnapshotError(f"{len(self.missing)} chunks still missing")
        if not self._stream_verified:
            if chunk_digest(self._buffer) != self.manifest.digest:
                raise SnapshotError("assembled stream does not match the manifest digest")
            self._stream_verified = True
            self._base = None  # no longer needed: let the base version go
        return memoryview(self._buffer)


def _decompress_exactly(data: bytes | memoryview, raw_bytes: int, index: int) -> bytes:
    """One zstd frame that must inflate to exactly `raw_bytes`.

    python-zstandard trusts a frame's declared content size over `max_output_size`, so the
    header is checked first: a forged header cannot make us allocate more than the manifest says.
    """
    try:
        declared = zstandard.frame_content_size(data)
        if declared not in (-1, raw_bytes):  # -1: size not written in the header
            raise SnapshotError(f"chunk {index}: frame declares {declared} bytes, not {raw_bytes}")
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_bytes)
    except zstandard.ZstdError:
        raise SnapshotError(f"chunk {index}: not a valid zstd frame") from None
    if len(raw) != raw_bytes:
        raise SnapshotError(f"chunk {index}: inflates to {len(raw)} bytes, not {raw_bytes}")
    return raw
