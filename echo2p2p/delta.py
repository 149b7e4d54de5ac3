"""Lossless deltas between two versions' raw snapshot streams.

Between nearby RL steps almost every bf16 weight is bit-identical: fp32 master weights move by
about lr per step, far below one bf16 rounding step, and a weight that does cross a rounding
boundary mostly moves by one unit in the last place. So a version can travel as its difference
from a base version the receiver already holds, and be rebuilt bit for bit.

Three codecs over the same pair of equal-length byte streams (`new`, `base`), each one zstd frame:

- "xor": new XOR base, split into byte planes (all first bytes of each `word_bytes` word, then
  all second bytes, ...), then zstd. Unchanged words become zero runs that zstd still has to
  code; kept for dense, erratic changes, where it is the smallest.
- "sparse": the positions of changed words (as gaps, little-endian uint64) and their new values,
  then zstd. Wins when changes are very rare.
- "step": codes only what changed, as symbols an entropy coder prices near their information.
  Each word is read as its key in float order (`_order_keys`: positive patterns above negative
  ones, -0 next to +0, NaN/Inf at the ends; a bijection on bit patterns, so any stream round
  trips) and a changed word carries its signed step, new key - base key modulo 2**(8w). One
  byte stream holds, per changed word, its gap g from the previous change and whether its step
  is +-1: g // 127 bytes 255 (each skips 127 words), then `2 * (g % 127) + (step is not +-1)`,
  so one running sum over the stream gives every position. The signs of the +-1 steps follow as
  raw bits (a fair coin costs one bit, and Huffman cannot code a symbol in less); the other
  steps follow as int8 bytes, -128 escaping to the full w-byte step at the end. Each stream is
  its own zstd block, so each gets its own Huffman table.
  Decoding is O(changed words) after one copy of the base.

`encode` codes every codec (unless told which) and keeps the smallest; `decode` reads the codec
from the header and bounds its memory by the stream size, which the caller checks against the
manifest. `entropy_bound_bytes` is the order-0 information of the delta (positions as a
changed/unchanged coin per word, then the steps), the yardstick for the codecs.
Pure: no torch, no files; numpy does the word-wise work.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from .errors import SnapshotError

CODECS = ("xor", "sparse", "step")
_HEADER = struct.Struct("<4sBBxxQQ")  # magic, codec id, word bytes, pad, stream bytes, payload bytes
_MAGIC = b"E2D1"
HEADER_BYTES = _HEADER.size
_WORD_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_STEP_COUNTS = struct.Struct("<QQ")  # step codec: changed words, position bytes
_MORE = 255  # a position byte that adds _MORE_GAP to the gap and continues it; 254 is unused
_MORE_GAP = 127
# How far each position byte moves the running position: a change byte 2 * rest + flag moves
# rest + 1 (to its word), a continuation _MORE_GAP.
_ADVANCE = np.concatenate([np.arange(254) // 2 + 1, [0, _MORE_GAP]]).astype(np.int64)
_WIDE = -128  # a step byte that says "the full step is in the wide stream"


def encode(new: bytes | memoryview, base: bytes | memoryview, *, word_bytes: int = 2,
           codec: str | None = None, level: int = 3) -> bytes:
    """A self-describing delta that turns `base` into `new` (same length) with `decode`."""
    a, b = _words(new, word_bytes), _words(base, word_bytes)
    if a.shape != b.shape:
        raise ValueError(f"streams differ in length: {a.nbytes} vs {b.nbytes} bytes")
    cctx = zstandard.ZstdCompressor(level=level)
    candidates = [codec] if codec else list(CODECS)
    where = np.flatnonzero(a != b) if candidates != ["xor"] else None  # changed words, found once
    best = None
    for name in candidates:
        payload = _compress(cctx, _ENCODERS[name](a, b, where))
        if best is None or len(payload) < len(best[1]):
            best = (name, payload)
    name, payload = best
    header = _HEADER.pack(_MAGIC, CODECS.index(name), word_bytes, a.nbytes, len(payload))
    return header + payload


def decode(delta: bytes | memoryview, base: bytes | memoryview) -> bytearray:
    """The stream `encode` was given as `new`; SnapshotError if the delta does not fit `base`.
    A bytearray: the one copy of the base that decoding writes into."""
    delta = memoryview(delta)
    if len(delta) < _HEADER.size:
        raise SnapshotError("delta too short for its header")
    magic, codec_id, word_bytes, n_bytes, n_payload = _HEADER.unpack(delta[:_HEADER.size])
    if magic != _MAGIC or codec_id >= len(CODECS) or word_bytes not in _WORD_DTYPES:
        raise SnapshotError("not an echo2p2p delta")
    if n_bytes != len(base) or n_payload != len(delta) - _HEADER.size:
        raise SnapshotError(f"delta is for a {n_bytes}-byte base, got {len(base)} bytes")
    if n_bytes % word_bytes:
        raise SnapshotError(f"{n_bytes} bytes are no whole number of {word_bytes}-byte words")
    name = CODECS[codec_id]
    limit = _RAW_LIMITS[name](n_bytes // word_bytes, word_bytes)
    try:
        # python-zstandard trusts a frame's declared size over max_output_size: check it first.
        if zstandard.frame_content_size(delta[_HEADER.size:]) > limit:
            raise SnapshotError("delta payload declares more bytes than its base allows")
        raw = zstandard.ZstdDecompressor().decompress(delta[_HEADER.size:], max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise SnapshotError(f"delta payload does not decompress: {exc}") from None
    out = bytearray(base)
    _DECODERS[name](raw, _words(out, word_bytes))
    return out


def changed_fraction(new: bytes | memoryview, base: bytes | memoryview, word_bytes: int = 2) -> float:
    """Share of words that differ: what the codecs have to carry."""
    a, b = _words(new, word_bytes), _words(base, word_bytes)
    return float(np.count_nonzero(a != b)) / max(a.size, 1)


def entropy_bound_bytes(new: bytes | memoryview, base: bytes | memoryview,
                        word_bytes: int = 2) -> float:
    """Order-0 empirical entropy of the delta, in bytes: n * h(changed share) for the positions
    plus the entropy of the measured step frequencies for each changed word. A coder that sees
    each word's change and step as independent draws cannot go below it."""
    a, b = _words(new, word_bytes), _words(base, word_bytes)
    steps = _steps(a, b, np.flatnonzero(a != b))
    bits = _entropy_bits(np.array([steps.size, a.size - steps.size]))
    if steps.size:
        bits += _entropy_bits(np.unique(steps, return_counts=True)[1])
    return bits / 8


def _entropy_bits(counts: np.ndarray) -> float:
    counts = counts[counts > 0]
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum())


def _words(data: bytes | memoryview, word_bytes: int) -> np.ndarray:
    if word_bytes not in _WORD_DTYPES or len(data) % word_bytes:
        raise ValueError(f"{len(data)} bytes is not a whole number of {word_bytes}-byte words")
    return np.frombuffer(data, dtype=np.dtype(_WORD_DTYPES[word_bytes]).newbyteorder("<"))


def _compress(cctx: zstandard.ZstdCompressor, parts: list[bytes]) -> bytes:
    """One zstd frame of `parts`, each part starting a new block (so a new Huffman table)."""
    if len(parts) == 1:
        return cctx.compress(parts[0])
    obj = cctx.compressobj(size=sum(map(len, parts)))
    out = [obj.compress(p) + obj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK) for p in parts[:-1]]
    return b"".join(out) + obj.compress(parts[-1]) + obj.flush()


def _xor_encode(a: np.ndarray, b: np.ndarray, _where: np.ndarray | None) -> list[bytes]:
    x = np.bitwise_xor(a, b)  # (N,)
    # byte planes, low byte first; shifts vectorise far better than a strided transpose
    return [b"".join((x >> (8 * k)).astype(np.uint8).tobytes() for k in range(a.itemsize))]


def _xor_decode(raw: bytes, out: np.ndarray) -> None:
    if len(raw) != out.nbytes:
        raise SnapshotError("xor delta has the wrong size")
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(out.itemsize, -1)  # (word bytes, N)
    for k in range(out.itemsize):
        out ^= planes[k].astype(out.dtype) << out.dtype.type(8 * k)


def _sparse_encode(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> list[bytes]:
    gaps = np.diff(where, prepend=-1).astype("<u8")  # first gap is index + 1
    return [struct.pack("<Q", where.size) + gaps.tobytes() + a[where].tobytes()]


def _sparse_decode(raw: bytes, out: np.ndarray) -> None:
    if len(raw) < 8:
        raise SnapshotError("sparse delta too short")
    (count,) = struct.unpack_from("<Q", raw)
    if len(raw) != 8 + count * (8 + out.itemsize):
        raise SnapshotError("sparse delta has the wrong size")
    gaps = np.frombuffer(raw, dtype="<u8", count=count, offset=8)
    if count and (np.any(gaps == 0) or int(gaps.max()) > out.size):
        raise SnapshotError("sparse delta positions out of range")
    values = np.frombuffer(raw, dtype=out.dtype, count=count, offset=8 + 8 * count)
    where = np.cumsum(gaps, dtype=np.uint64).astype(np.int64) - 1
    if count and where[-1] >= out.size:
        raise SnapshotError("sparse delta positions out of range")
    out[where] = values


def _order_keys(x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Float bit patterns (sign-magnitude) as unsigned keys in float order, or back.

    key = x | top for x >= +0, ~x for negative x: -NaN < -Inf < ... < -0 < +0 < ... < +Inf < NaN,
    -0 and +0 one apart. Both ways are bijections on w-bit patterns, so no pattern is special."""
    shift = x.dtype.type(8 * x.itemsize - 1)
    top = x.dtype.type(1) << shift
    negative = (x >> shift) ^ x.dtype.type(1) if inverse else x >> shift  # 1 where all bits flip
    return x ^ ((negative * (top - x.dtype.type(1))) | top)


def _steps(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> np.ndarray:
    """The signed steps in key order (modulo 2**(8w)) of the changed words at `where`."""
    steps = _order_keys(a[where]) - _order_keys(b[where])  # wraps: unsigned arithmetic
    return steps.view(steps.dtype.str.replace("u", "i"))


def _step_encode(a: np.ndarray, b: np.ndarray, where: np.ndarray) -> list[bytes]:
    steps = _steps(a, b, where)
    unit = (steps == 1) | (steps == -1)
    runs, rest = np.divmod(np.diff(where, prepend=-1) - 1, _MORE_GAP)  # gap = runs * 127 + rest
    length = runs + 1  # bytes per changed word: `runs` continuations, then its own byte
    positions = np.full(int(length.sum()), _MORE, dtype=np.uint8)
    positions[np.cumsum(length) - 1] = 2 * rest + ~unit  # 2 * rest + (step is not +-1)
    other = steps[~unit]
    wide = (other < -127) | (other > 127)
    small = np.where(wide, _WIDE, other).astype(np.int8)
    return [_STEP_COUNTS.pack(where.size, positions.size) + positions.tobytes(),
            np.packbits(steps[unit] < 0).tobytes(),
            small.tobytes() + other[wide].tobytes()]


def _step_decode(raw: bytes, out: np.ndarray) -> None:
    if len(raw) < _STEP_COUNTS.size:
        raise SnapshotError("step delta too short")
    count, n_positions = _STEP_COUNTS.unpack_from(raw)
    at = _STEP_COUNTS.size
    if n_positions > len(raw) - at:
        raise SnapshotError("step delta positions run past the payload")
    positions = np.frombuffer(raw, dtype=np.uint8, count=n_positions, offset=at)
    ends = positions < _MORE - 1
    if (np.count_nonzero(ends) != count or (n_positions and not ends[-1])
            or np.count_nonzero(positions == _MORE - 1)):
        raise SnapshotError("step delta positions do not match their count")
    where = np.cumsum(_ADVANCE[positions])[ends] - 1  # one running sum gives every position
    if count and where[-1] >= out.size:
        raise SnapshotError("step delta positions out of range")
    other = (positions[ends] & 1).astype(bool)
    n_other = int(np.count_nonzero(other))
    n_signs = (count - n_other + 7) // 8
    at += n_positions
    if len(raw) < at + n_signs + n_other:
        raise SnapshotError("step delta too short for its steps")
    signs = np.unpackbits(np.frombuffer(raw, dtype=np.uint8, count=n_signs, offset=at))
    small = np.frombuffer(raw, dtype=np.int8, count=n_other, offset=at + n_signs)
    wide = small == _WIDE
    at += n_signs + n_other
    if len(raw) != at + np.count_nonzero(wide) * out.itemsize or signs[count - n_other:].any():
        raise SnapshotError("step delta has the wrong size")
    steps = np.empty(count, dtype=out.dtype)  # unsigned: adding wraps modulo 2**(8w)
    steps[~other] = 1 - 2 * signs[:count - n_other].astype(out.dtype)
    small_steps = small.astype(out.dtype.str.replace("u", "i")).view(out.dtype)
    small_steps[wide] = np.frombuffer(raw, dtype=out.dtype, offset=at)
    steps[other] = small_steps
    out[where] = _order_keys(_order_keys(out[where]) + steps, inverse=True)


_ENCODERS = {"xor": _xor_encode, "sparse": _sparse_encode, "step": _step_encode}
_DECODERS = {"xor": _xor_decode, "sparse": _sparse_decode, "step": _step_decode}
# The most raw bytes an honest payload of each codec inflates to, for n words of w bytes.
# step: positions <= n + n/127, signs <= n/8 + 1, steps <= n (1 + w), counts 16 bytes.
_RAW_LIMITS = {"xor": lambda n, w: n * w,
               "sparse": lambda n, w: 8 + n * (8 + w),
               "step": lambda n, w: 24 + n * (4 + w)}
