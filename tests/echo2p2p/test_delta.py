"""Lossless deltas: bit-exact round trips at every change density, clear errors on bad input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import delta
from echo2p2p.errors import SnapshotError


@st.composite
def stream_pairs(draw):
    """(new, base, word_bytes): base random, new = base with a random share of words changed."""
    word = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**31))
    density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * word, dtype=np.uint8)
    new = base.copy().view(f"<u{word}")
    flip = rng.random(n) < density
    new[flip] ^= rng.integers(1, 2 ** min(8 * word, 62), flip.sum(), dtype=np.uint64).astype(new.dtype) | 1
    return new.tobytes(), base.tobytes(), word


@settings(max_examples=80, deadline=None)
@given(stream_pairs(), st.sampled_from([None, "xor", "sparse"]))
def test_round_trip_is_bit_exact(pair, codec):
    """decode(encode(new, base), base) == new for every codec, word size and density."""
    new, base, word = pair
    assert delta.decode(delta.encode(new, base, word_bytes=word, codec=codec), base) == new


def test_auto_picks_the_smaller_codec():
    """With no codec named, the encoding is no larger than either codec alone."""
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
