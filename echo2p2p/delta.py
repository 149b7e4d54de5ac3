"""Lossless deltas between two versions' raw snapshot streams.

Between nearby RL steps almost every bf16 weight is bit-identical: fp32 master weights move by
about lr per step, far below one bf16 rounding step. So a version can travel as its difference
from a base version the receiver already holds, and be rebuilt bit for bit.

Two codecs over the same pair of equal-length byte streams (`new`, `base`):

- "xor": new XOR base, split into byte planes (all first bytes of each `word_bytes` word, then
  all second bytes, ...), then zstd. Unchanged words become zero runs; the high byte of a bf16
  that moved by one rounding step barely ever changes, so its plane compresses to almost nothing.
- "sparse": the positions of changed words (as gaps, little-endian uint64) and their new values,
  then zstd. Wins when changes are very rare; loses to "xor" as density grows.

`encode` picks the smaller of the two unless told which; `decode` reads the codec from the
header. Pure: no torch, no files; numpy does the word-wise work.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from .errors import SnapshotError

CODECS = ("xor", "sparse")
_HEADER = struct.Struct("<4sBBxxQQ")  # magic, codec id, word bytes, pad, stream bytes, payload bytes
_MAGIC = b"E2D1"
HEADER_BYTES = _HEADER.size
_WORD_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def encode(new: bytes | memoryview, base: bytes | memoryview, *, word_bytes: int = 2,
           codec: str | None = None, level: int = 3) -> bytes:
    """A self-describing delta that turns `base` into `new` (same length) with `decode`."""
    a, b = _words(new, word_bytes), _words(base, word_bytes)
    if a.shape != b.shape:
        raise ValueError(f"streams differ in length: {a.nbytes} vs {b.nbytes} bytes")
    cctx = zstandard.ZstdCompressor(level=level)
    candidates = [codec] if codec else list(CODECS)
    best = None
    for name in candidates:
        payload = cctx.compress(_ENCODERS[name](a, b))
        if best is None or len(payload) < len(best[1]):
            best = (name, payload)
    name, payload = best
    header = _HEADER.pack(_MAGIC, CODECS.index(name), word_bytes, a.nbytes, len(payload))
    return header + payload


def decode(delta: bytes | memoryview, base: bytes | memoryview) -> bytes:
    """The stream `encode` was given as `new`; SnapshotError if the delta does not fit `base`."""
    delta = memoryview(delta)
    if len(delta) < _HEADER.size:
        raise SnapshotError("delta too short for its header")
    magic, codec_id, word_bytes, n_bytes, n_payload = _HEADER.unpack(delta[:_HEADER.size])
    if magic != _MAGIC or codec_id >= len(CODECS) or word_bytes not in _WORD_DTYPES:
        raise SnapshotError("not an echo2p2p delta")
    if n_bytes != len(base) or n_payload != len(delta) - _HEADER.size:
        raise SnapshotError(f"delta is for a {n_bytes}-byte base, got {len(base)} bytes")
    b = _words(base, word_bytes)
    # Neither codec's raw payload exceeds this (sparse: a count, then a gap and a value a word).
    limit = max(n_bytes, 8 + n_bytes // word_bytes * (8 + word_bytes))
    try:
        # python-zstandard trusts a frame's declared size over max_output_size: check it first.
        if zstandard.frame_content_size(delta[_HEADER.size:]) > limit:
            raise SnapshotError("delta payload declares more bytes than its base allows")
        raw = zstandard.ZstdDecompressor().decompress(delta[_HEADER.size:], max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise SnapshotError(f"delta payload does not decompress: {exc}") from None
    return _DECODERS[CODECS[codec_id]](raw, b).tobytes()


def changed_fraction(new: bytes | memoryview, base: bytes | memoryview, word_bytes: int = 2) -> float:
    """Share of words that differ: what the codecs have to carry."""
    a, b = _words(new, word_bytes), _words(base, word_bytes)
    return float(np.count_nonzero(a != b)) / max(a.size, 1)


def _words(data: bytes | memoryview, word_bytes: int) -> np.ndarray:
    if word_bytes not in _WORD_DTYPES or len(data) % word_bytes:
        raise ValueError(f"{len(data)} bytes is not a whole number of {word_bytes}-byte words")
    return np.frombuffer(data, dtype=np.dtype(_WORD_DTYPES[word_bytes]).newbyteorder("<"))


def _xor_encode(a: np.ndarray, b: np.ndarray) -> bytes:
    x = np.bitwise_xor(a, b)  # (N,)
    # byte planes, low byte first; shifts vectorise far better than a strided transpose
    return b"".join((x >> (8 * k)).astype(np.uint8).tobytes() for k in range(a.itemsize))


def _xor_decode(raw: bytes, b: np.ndarray) -> np.ndarray:
    if len(raw) != b.nbytes:
        raise SnapshotError("xor delta has the wrong size")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(b.itemsize, -1)  # (word bytes, N)
    out = b.copy()
    for k in range(b.itemsize):
        out ^= planes[k].astype(b.dtype) << b.dtype.type(8 * k)
    return out


def _sparse_encode(a: np.ndarray, b: np.ndarray) -> bytes:
    where = np.flatnonzero(a != b)
    gaps = np.diff(where, prepend=-1).astype("<u8")  # first gap is index + 1
    return struct.pack("<Q", where.size) + gaps.tobytes() + a[where].tobytes()


def _sparse_decode(raw: bytes, b: np.ndarray) -> np.ndarray:
    if len(raw) < 8:
        raise SnapshotError("sparse delta too short")
    (count,) = struct.unpack_from("<Q", raw)
    if len(raw) != 8 + count * (8 + b.itemsize):
        raise SnapshotError("sparse delta has the wrong size")
    gaps = np.frombuffer(raw, dtype="<u8", count=count, offset=8)
    if count and (np.any(gaps == 0) or int(gaps.max()) > b.size):
        raise SnapshotError("sparse delta positions out of range")
    values = np.frombuffer(raw, dtype=b.dtype, count=count, offset=8 + 8 * count)
    where = np.cumsum(gaps, dtype=np.uint64).astype(np.int64) - 1
    if count and where[-1] >= b.size:
        raise SnapshotError("sparse delta positions out of range")
    out = b.copy()
    out[where] = values
    return out


_ENCODERS = {"xor": _xor_encode, "sparse": _sparse_encode}
_DECODERS = {"xor": _xor_decode, "sparse": _sparse_decode}
