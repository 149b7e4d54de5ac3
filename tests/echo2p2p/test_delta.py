"""Lossless deltas: bit-exact round trips at every change density and on every bit pattern, the
step codec chosen where it should be, and the entropy bound it is measured against."""

import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import delta
from echo2p2p.errors import SnapshotError

# bf16 patterns where a sign-magnitude float is easy to get wrong: +-0, the smallest
# subnormals, +-1, the largest finite, +-Inf, quiet and signalling NaNs of both signs.
SPECIAL = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80,
                    0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF], dtype="<u2")


def bf16_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """n bf16 patterns of weights as a model holds them: normal, std 0.02, both signs."""
    return (rng.normal(0, 0.02, n).astype("<f4").view("<u4") >> 16).astype("<u2")


def ulp_moves(base: np.ndarray, rng: np.random.Generator, share: float) -> np.ndarray:
    """base with `share` of its words moved by one unit in the last place, up or down in value."""
    new = base.copy()
    moved = rng.random(base.size) < share
    up = rng.random(base.size) < 0.5
    negative = (base >> 15).astype(bool)
    # one ulp up in value is +1 on the magnitude of a positive word and -1 on a negative one
    new[moved] += np.where(up ^ negative, 1, -1)[moved].astype("<u2")
    return new


@st.composite
def stream_pairs(draw):
    """(new, base, word_bytes): base random or bf16-like; new changed at a random density by a
    random move (any bits, +-1, a sign flip, a special pattern), or wholly random."""
    word = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(0, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
    move = draw(st.sampled_from(["bits", "step", "sign", "special", "random"]))
    base = rng.integers(0, 256, n * word, dtype=np.uint8).view(f"<u{word}")
    if word == 2 and draw(st.booleans()):
        base = bf16_like(rng, n)
    new, flip = base.copy(), rng.random(n) < density
    top = base.dtype.type(1) << base.dtype.type(8 * word - 1)
    if move == "bits":
        new[flip] ^= rng.integers(1, 2 ** min(8 * word, 62), flip.sum(),
                                  dtype=np.uint64).astype(new.dtype) | 1
    elif move == "step":
        new[flip] += rng.choice([1, -1, 2, -3, 200], flip.sum()).astype(new.dtype)
    elif move == "sign":
        new[flip] ^= top
    elif move == "special":
        new[flip] = rng.choice(SPECIAL, flip.sum()).astype(new.dtype)
    else:
        new = rng.integers(0, 256, n * word, dtype=np.uint8).view(f"<u{word}")
    return new.tobytes(), base.tobytes(), word


@settings(max_examples=150, deadline=None)
@given(stream_pairs(), st.sampled_from([None, *delta.CODECS]))
def test_round_trip_is_bit_exact(pair, codec):
    """decode(encode(new, base), base) == new for every codec, word size, density and move."""
    new, base, word = pair
    assert delta.decode(delta.encode(new, base, word_bytes=word, codec=codec), base) == new


def test_every_pair_of_special_patterns_round_trips():
    """Each special bf16 pattern turned into each other one (-0 to +0, Inf to NaN, sign flips,
    the wrap from the top pattern to the bottom) comes back bit for bit through "step"."""
    base = np.repeat(SPECIAL, SPECIAL.size)
    new = np.tile(SPECIAL, SPECIAL.size)
    d = delta.encode(new.tobytes(), base.tobytes(), codec="step")
    assert delta.decode(d, base.tobytes()) == new.tobytes()


def spec_step_decode(raw: bytes, base: bytes, w: int) -> bytes:
    """The "step" payload as docs/protocol/overlay.md words it, a word at a time in plain Python."""
    top, mask = 1 << (8 * w - 1), (1 << 8 * w) - 1
    count, n_positions = struct.unpack_from("<QQ", raw)
    changes, position, skip = [], -1, 0  # changes: (position, step is +-1)
    for byte in raw[16:16 + n_positions]:
        if byte == 255:
            skip += 127
            continue
        position, skip = position + skip + byte // 2 + 1, 0
        changes.append((position, byte % 2 == 0))
    n_unit = sum(unit for _, unit in changes)
    signs_at = 16 + n_positions
    small_at = signs_at + (n_unit + 7) // 8
    wide_at = small_at + count - n_unit
    words = [int.from_bytes(base[i:i + w], "little") for i in range(0, len(base), w)]
    units = others = 0
    for position, unit in changes:
        if unit:
            step = -1 if raw[signs_at + units // 8] >> (7 - units % 8) & 1 else 1
            units += 1
        else:
            step = raw[small_at + others] - 256 * (raw[small_at + others] >= 128)
            others += 1
            if step == -128:
                step = int.from_bytes(raw[wide_at:wide_at + w], "little", signed=True)
                wide_at += w
        word = words[position]
        key = ((word ^ mask if word & top else word | top) + step) & mask
        words[position] = key ^ top if key & top else key ^ mask
    return b"".join(x.to_bytes(w, "little") for x in words)


@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_step_payload_is_what_the_protocol_says(word):
    """An independent reading of docs/protocol/overlay.md rebuilds what the encoder sent, on a
    stream with one-ulp moves, larger and wide steps, sign flips and special patterns."""
    rng = np.random.default_rng(word)
    n = 4000
    base = rng.integers(0, 256, n * word, dtype=np.uint8).view(f"<u{word}")
    new = base.copy()
    new[::3] += rng.choice([1, -1], new[::3].size).astype(new.dtype)
    new[1::40] += rng.choice([5, -100, 300, -70_000], new[1::40].size).astype(new.dtype)
    new[2::50] ^= new.dtype.type(1) << new.dtype.type(8 * word - 1)
    new[:SPECIAL.size] = SPECIAL[:n].astype(new.dtype)
    d = delta.encode(new.tobytes(), base.tobytes(), word_bytes=word, codec="step")
    raw = zstandard.ZstdDecompressor().decompress(d[delta.HEADER_BYTES:])
    assert spec_step_decode(raw, base.tobytes(), word) == new.tobytes()


def test_odd_lengths_code_as_bytes_and_refuse_wider_words():
    """A stream whose length is no multiple of the word is coded with 1-byte words; asking for
    wider words is a ValueError, not a silent cut."""
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, 1001, dtype=np.uint8).tobytes()
    new = bytes(x ^ (i % 7 == 0) for i, x in enumerate(base))
    assert delta.decode(delta.encode(new, base, word_bytes=1, codec="step"), base) == new
    with pytest.raises(ValueError):
        delta.encode(new, base, word_bytes=2)


def test_step_codec_wins_on_one_ulp_moves():
    """On bf16 weights where 2 % of words moved by one ulp, "step" is chosen and is less than
    two thirds of the best older codec (it codes the moves, not the unchanged words)."""
    rng = np.random.default_rng(0)
    base = bf16_like(rng, 1 << 19)
    new = ulp_moves(base, rng, 0.02)
    d = delta.encode(new.tobytes(), base.tobytes())
    assert d[4] == delta.CODECS.index("step")
    older = min(len(delta.encode(new.tobytes(), base.tobytes(), codec=c))
                for c in ("xor", "sparse"))
    assert len(d) < older * 2 / 3


def test_step_codec_is_near_the_entropy_bound_on_independent_moves():
    """Where changes and their +-1 signs are independent draws, the order-0 bound is the
    information there is: the codec comes within 10 % of it, and never under it."""
    rng = np.random.default_rng(2)
    base = bf16_like(rng, 1 << 19)
    new = ulp_moves(base, rng, 0.02)
    bound = delta.entropy_bound_bytes(new.tobytes(), base.tobytes())
    size = len(delta.encode(new.tobytes(), base.tobytes(), codec="step"))
    assert bound < size < 1.1 * bound


def test_entropy_bound_counts_positions_and_steps():
    """No change and a change everywhere by the same step carry no information; half the words
    changed, by +1 or -1 in equal shares, carry one bit a word plus one bit a change."""
    base = np.arange(1000, dtype="<u2") + 0x3F00
    assert delta.entropy_bound_bytes(base.tobytes(), base.tobytes()) == 0
    assert delta.entropy_bound_bytes((base + 1).tobytes(), base.tobytes()) == 0
    new = base.copy()
    new[0:1000:4] += 1
    new[1:1000:4] -= 1
    bound = delta.entropy_bound_bytes(new.tobytes(), base.tobytes())
    assert bound == pytest.approx((1000 + 500) / 8)


def test_auto_picks_the_smaller_codec():
    """With no codec named, the encoding is no larger than any codec alone."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**16, 50_000, dtype=np.uint16)
    new = base.copy()
    new[rng.choice(new.size, 200, replace=False)] += 1
    sizes = {c: len(delta.encode(new.tobytes(), base.tobytes(), codec=c)) for c in delta.CODECS}
    assert len(delta.encode(new.tobytes(), base.tobytes())) == min(sizes.values())
    assert delta.changed_fraction(new.tobytes(), base.tobytes()) == pytest.approx(200 / 50_000)


def test_wrong_base_or_corrupt_delta_is_refused():
    """A delta applied to a base of another size, or tampered with, raises SnapshotError."""
    base = bytes(range(256)) * 8
    new = bytearray(base)
    new[10] ^= 0xFF
    d = delta.encode(bytes(new), base)
    with pytest.raises(SnapshotError):
        delta.decode(d, base[:-2])
    with pytest.raises(SnapshotError):
        delta.decode(d[:-1], base)
    with pytest.raises(SnapshotError):
        delta.decode(b"XXXX" + d[4:], base)
    with pytest.raises(ValueError):
        delta.encode(bytes(new), base[:-2])
