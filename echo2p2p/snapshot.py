"""Weight snapshots: one policy version as a manifest plus compressed, hashed chunks.

Theory of operation. The tensors of a version are laid back to back, in the order given, into
one flat byte stream (each `TensorEntry` says where its bytes sit). The stream is cut into
pieces of `chunk_bytes` raw bytes (the last may be shorter); each piece becomes one independent
zstd frame, and the chunk's digest is blake2b-256 of those compressed bytes, so a relay can
check a chunk without decompressing it and forwards it unchanged. `Manifest.digest` is
blake2b-256 over the whole raw stream: the last word once every chunk is in.

A delta manifest (codec "delta", `base_version` set) has the same layout, but each chunk is
`echo2p2p.delta.encode` of its raw range against the same range of the base version's stream.
A receiver holding the base rebuilds every range bit for bit as the chunk arrives, so a delta
relays and pipelines exactly like a full version, and the manifest digest checks the rebuilt
stream.

This module knows no torch, sockets, files, threads or clocks: tensors come in and go out as
(name, dtype name, shape, raw little-endian bytes). Building copies only the raw pieces that
straddle tensor boundaries and codes chunks through the caller's `map_chunks` (a thread pool's
`map`, if the caller wants one). It checks a manifest's layout (`validate_manifest`); the
receiving side, rebuilding a version from its chunks, is `echo2p2p.assembler`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence

import zstandard

from . import delta
from .errors import LocalProtocolError, SnapshotError
from .messages import ChunkEntry, Manifest, TensorEntry

HASH_ALGO = "blake2b-256"
DIGEST_BYTES = 32
CODEC = "zstd"
CODEC_DELTA = "delta"  # echo2p2p.delta per chunk (zstd inside)
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_AUTO_CHUNK_BYTES = 64 << 10
MAX_AUTO_CHUNK_BYTES = 8 << 20
MAX_TENSOR_RANK = 32  # a sanity bound on manifests; real checkpoints stay below 8

# Item size of every dtype a snapshot may carry; names are torch's, without the "torch." prefix.
DTYPE_BYTES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
}

TensorBytes = tuple[str, str, Sequence[int], bytes | memoryview]


def auto_chunk_bytes(total_bytes: int) -> int:
    """The chunk size for a version of `total_bytes`: about a thousandth of it, as a power of
    two within [64 KiB, 8 MiB].

    In the overlay a version finishes about (N - 1) chunk times after the hub's last byte (the
    last chunk still has to fan out), so small chunks keep that tail short: (N - 1) / 1000 of the
    whole for N peers. Measured with `bench/broadcast.py --chunk-kib` (16 peers, 16 MiB, 20
    Mbit/s uplinks): 64 KiB chunks 1.60 x M/B, 128 KiB 1.64, 256 KiB 1.80, 1 MiB 2.64. Models of
    a GB or more get chunks of 1 MiB and up, so two requests in flight per source still cover a
    wide-area round trip.
    """
    target = max(total_bytes // 1000, 1)
    return min(max(1 << (target - 1).bit_length(), MIN_AUTO_CHUNK_BYTES), MAX_AUTO_CHUNK_BYTES)


def chunk_digest(data: bytes | memoryview) -> bytes:
    """blake2b-256 of `data`: the digest of a chunk's wire bytes, or of a whole raw stream."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def _is_count(value: object) -> bool:
    """A non-negative int, and not a bool (True == 1 would slip through otherwise)."""
    return type(value) is int and value >= 0


def _expected_nbytes(dtype: object, shape: object) -> int | None:
    """prod(shape) * itemsize, or None if the dtype or shape is not acceptable."""
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return None
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_TENSOR_RANK:
        return None
    if not all(_is_count(d) for d in shape):
        return None
    return math.prod(shape) * DTYPE_BYTES[dtype]


def _raw_chunk_sizes(total_bytes: int, chunk_bytes: int) -> list[int]:
    full, rest = divmod(total_bytes, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])


def _max_wire_bytes(raw_bytes: int) -> int:
    """ZSTD_compressBound (zstd.h) plus slack for frame headers: no honest chunk is larger."""
    small = (128 * 1024 - raw_bytes) >> 11 if raw_bytes < 128 * 1024 else 0
    return raw_bytes + (raw_bytes >> 8) + small + 64


def _as_bytes_view(data: bytes | memoryview, name: str) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise LocalProtocolError(f"tensor {name!r}: bytes are not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


# --- building ------------------------------------------------------------------------------

MapChunks = Callable[..., Iterable[tuple[ChunkEntry, bytes]]]


def build_snapshot(
    version: int,
    tensors: Sequence[TensorBytes],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    zstd_level: int = 3,
    base: tuple[int, bytes | memoryview] | None = None,
    map_chunks: MapChunks = map,
) -> tuple[Manifest, list[bytes]]:
    """The manifest and the compressed chunks of `tensors` as policy `version`; with
    `base=(base_version, base_stream)`, a delta against that version's raw stream.

    Chunks are independent, and zstd, numpy and blake2b release the GIL: a caller that wants
    them coded in parallel passes `map_chunks=pool.map` of its own `ThreadPoolExecutor`; the
    default, `map`, codes them one after the other in the calling thread.
    Raises LocalProtocolError if a tensor's byte count does not match its dtype and shape, a
    name repeats, `version`/`chunk_bytes` are out of range, or the base stream's length differs.
    """
    if not _is_count(version):
        raise LocalProtocolError(f"version must be an int >= 0, got {version!r}")
    if not _is_count(chunk_bytes) or chunk_bytes == 0:
        raise LocalProtocolError(f"chunk_bytes must be an int > 0, got {chunk_bytes!r}")
    entries, views = _lay_out(tensors)
    total_bytes = sum(e.nbytes for e in entries)
    base_view = memoryview(base[1]).cast("B") if base is not None else None
    if base_view is not None and base_view.nbytes != total_bytes:
        raise LocalProtocolError(
            f"base stream has {base_view.nbytes} bytes, this version {total_bytes}")
    # Deltas code words of the dominant dtype, so that each byte plane is one byte of a weight.
    word = DTYPE_BYTES[max(entries, key=lambda t: t.nbytes).dtype] if entries else 1

    def code(index: int, raw: bytes | memoryview) -> tuple[ChunkEntry, bytes]:
        if base_view is None:
            wire = zstandard.ZstdCompressor(level=zstd_level).compress(raw)
        else:
            start = index * chunk_bytes
            wire = delta.encode(raw, base_view[start:start + len(raw)],
                                word_bytes=word if len(raw) % word == 0 else 1, level=zstd_level)
        return ChunkEntry(len(raw), len(wire), chunk_digest(wire)), wire

    stream_hash = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for view in views:
        stream_hash.update(view)
    pieces = _cut_pieces(views, chunk_bytes)
    coded = list(map_chunks(code, range(len(pieces)), pieces))
    manifest = Manifest(
        version=version,
        base_version=base[0] if base is not None else None,
        codec=CODEC if base is None else CODEC_DELTA,
        hash_algo=HASH_ALGO,
        chunk_bytes=chunk_bytes,
        total_bytes=total_bytes,
        tensors=entries,
        chunks=[entry for entry, _ in coded],
        digest=stream_hash.digest(),
    )
    return manifest, [wire for _, wire in coded]


def _lay_out(tensors: Sequence[TensorBytes]) -> tuple[list[TensorEntry], list[memoryview]]:
    """Each tensor's entry (laid back to back from offset 0) and its bytes as a flat view.
    Raises LocalProtocolError for an empty or repeated name, or bytes that do not match."""
    entries: list[TensorEntry] = []
    views: list[memoryview] = []
    seen: set[str] = set()
    offset = 0
    for name, dtype, shape, data in tensors:
        if not isinstance(name, str) or not name or name in seen:
            raise LocalProtocolError(f"tensor name {name!r} is empty or repeated")
        seen.add(name)
        shape_list = list(shape)
        view = _as_bytes_view(data, name)
        expected = _expected_nbytes(dtype, shape_list)
        if expected is None:
            raise LocalProtocolError(f"tensor {name!r}: bad dtype {dtype!r} or shape {shape_list}")
        if view.nbytes != expected:
            raise LocalProtocolError(
                f"tensor {name!r}: {view.nbytes} bytes, {dtype}{shape_list} needs {expected}")
        entries.append(TensorEntry(name, dtype, shape_list, offset, view.nbytes))
        views.append(view)
        offset += view.nbytes
    return entries, views


def _cut_pieces(views: Sequence[memoryview], chunk_bytes: int) -> list[bytes | memoryview]:
    """The raw pieces of `chunk_bytes` (the last may be shorter) of the views laid end to end.

    Only pieces that straddle tensor boundaries are copied (they gather in `pending`); whole
    chunks inside one tensor go to the compressor straight from the caller's memory.
    """
    pieces: list[bytes | memoryview] = []
    pending = bytearray()
    for view in views:
        pos = 0
        while pos < view.nbytes:
            if not pending and view.nbytes - pos >= chunk_bytes:
                pieces.append(view[pos:pos + chunk_bytes])
                pos += chunk_bytes
                continue
            take = min(chunk_bytes - len(pending), view.nbytes - pos)
            pending += view[pos:pos + take]
            pos += take
            if len(pending) == chunk_bytes:
                pieces.append(bytes(pending))
                pending.clear()
    if pending:
        pieces.append(bytes(pending))
    return pieces


# --- checking a manifest ----------------------------------------------------------------------


def validate_manifest(manifest: Manifest) -> None:
    """Raise SnapshotError unless the manifest's layout is self-consistent and supported."""
    m = manifest
    if not isinstance(m, Manifest):
        raise SnapshotError("not a manifest")
    if not _is_count(m.version):
        raise SnapshotError(f"bad manifest version {m.version!r}")
    if m.base_version is not None and not (_is_count(m.base_version) and m.base_version < m.version):
        raise SnapshotError(f"bad base version {m.base_version!r} for version {m.version}")
    if m.codec not in (CODEC, CODEC_DELTA):
        raise SnapshotError(f"unknown codec {str(m.codec)[:40]!r}")
    if (m.codec == CODEC_DELTA) != (m.base_version is not None):
        raise SnapshotError("a delta needs a base version, a full snapshot has none")
    if m.hash_algo != HASH_ALGO:
        raise SnapshotError(f"unknown hash algorithm {str(m.hash_algo)[:40]!r}")
    if not _is_count(m.chunk_bytes) or m.chunk_bytes == 0 or not _is_count(m.total_bytes):
        raise SnapshotError("bad chunk_bytes or total_bytes")
    if not isinstance(m.digest, bytes) or len(m.digest) != DIGEST_BYTES:
        raise SnapshotError("manifest digest is not a blake2b-256 digest")

    offset = 0
    names: set[str] = set()
    for t in m.tensors:
        if not isinstance(t.name, str) or not t.name or t.name in names:
            raise SnapshotError(f"tensor name {str(t.name)[:80]!r} is empty or repeated")
        names.add(t.name)
        expected = _expected_nbytes(t.dtype, t.shape)
        if expected is None:
            raise SnapshotError(f"tensor {t.name[:80]!r}: bad dtype or shape")
        if t.nbytes != expected:
            raise SnapshotError(f"tensor {t.name[:80]!r}: nbytes does not match dtype and shape")
        if t.offset != offset:
            raise SnapshotError(f"tensor {t.name[:80]!r}: offset leaves a gap or overlaps")
        offset += t.nbytes
    if offset != m.total_bytes:
        raise SnapshotError("tensors do not cover total_bytes exactly")

    sizes = _raw_chunk_sizes(m.total_bytes, m.chunk_bytes)
    if len(m.chunks) != len(sizes):
        raise SnapshotError(f"{len(m.chunks)} chunks listed, the layout needs {len(sizes)}")
    for i, (c, raw) in enumerate(zip(m.chunks, sizes)):
        if c.raw_bytes != raw:
            raise SnapshotError(f"chunk {i}: raw_bytes does not match chunk_bytes layout")
        bound = _max_wire_bytes(raw) + (delta.HEADER_BYTES if m.codec == CODEC_DELTA else 0)
        if not _is_count(c.wire_bytes) or not 0 < c.wire_bytes <= bound:
            raise SnapshotError(f"chunk {i}: implausible wire_bytes")
        if not isinstance(c.digest, bytes) or len(c.digest) != DIGEST_BYTES:
            raise SnapshotError(f"chunk {i}: digest is not a blake2b-256 digest")
