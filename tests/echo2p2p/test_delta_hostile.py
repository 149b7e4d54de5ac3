"""Hostile deltas: payloads that inflate fine but lie (counts, lengths, positions past the
stream, huge declared sizes) are a SnapshotError, never another exception, and never make the
decoder allocate beyond what the stream size it was given allows."""

import struct
import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import delta
from echo2p2p.errors import SnapshotError

WORDS = 1000
BASE = (np.arange(WORDS, dtype="<u2") + 0x3C00).tobytes()
COUNTS = struct.Struct("<QQ")  # the step codec: changed words, position bytes (docs/protocol/)


def forged(raw: bytes, codec: str = "step", frame: bytes | None = None,
           base: bytes = BASE) -> bytes:
    """A delta with an honest header (docs/protocol/overlay.md, "Delta chunks") around `raw`, for
    2-byte words of `base`."""
    payload = zstandard.ZstdCompressor().compress(raw) if frame is None else frame
    return struct.pack("<4sBBxxQQ", b"E2D1", delta.CODECS.index(codec), 2, len(base),
                       len(payload)) + payload


def real_raw() -> bytes:
    """The inflated payload of an honest step delta with unit, small and wide steps."""
    new = np.frombuffer(BASE, "<u2").copy()
    new[::7] += 1
    new[3::50] += 9
    new[5::300] ^= 0x8000
    d = delta.encode(new.tobytes(), BASE, codec="step")
    return zstandard.ZstdDecompressor().decompress(d[delta.HEADER_BYTES:])


LIES = {
    "count above its terminators": COUNTS.pack(3, 2) + bytes([0, 0]) + b"\x00",
    "count below its terminators": COUNTS.pack(1, 2) + bytes([0, 0]) + b"\x00",
    "positions run past the payload": COUNTS.pack(0, 2**63),
    "a count of 2**63": COUNTS.pack(2**63, 0),
    "the unused position byte 254": COUNTS.pack(1, 2) + bytes([254, 0]) + b"\x00",
    "a trailing continuation": COUNTS.pack(1, 2) + bytes([0, 255]) + b"\x00",
    "a position past the stream": COUNTS.pack(1, 9) + bytes([255] * 8 + [0]) + b"\x00",
    "a sign byte missing": COUNTS.pack(1, 1) + bytes([0]),
    "sign padding bits set": COUNTS.pack(1, 1) + bytes([0]) + b"\x01",
    "a byte too many": COUNTS.pack(1, 1) + bytes([0]) + b"\x00\x00",
    "a small step missing": COUNTS.pack(1, 1) + bytes([1]),
    "a wide step missing": COUNTS.pack(1, 1) + bytes([1]) + b"\x80",
    "half a wide step": COUNTS.pack(1, 1) + bytes([1]) + b"\x80\x01",
    "too short for its counts": b"\x01" * 15,
}


@pytest.mark.parametrize("raw", LIES.values(), ids=LIES.keys())
def test_lying_step_payloads_are_refused(raw):
    """Each lie, in a well-formed zstd frame behind a well-formed header, is a SnapshotError."""
    with pytest.raises(SnapshotError):
        delta.decode(forged(raw), BASE)


def test_the_honest_payload_decodes_and_every_cut_of_it_is_refused():
    """The payload the encoder made decodes when re-framed; every strict prefix of it, and it
    with a byte more, is refused."""
    raw = real_raw()
    assert len(delta.decode(forged(raw), BASE)) == len(BASE)
    for cut in range(len(raw)):
        with pytest.raises(SnapshotError):
            delta.decode(forged(raw[:cut]), BASE)
    with pytest.raises(SnapshotError):
        delta.decode(forged(raw + b"\x00"), BASE)


@pytest.mark.parametrize("codec", delta.CODECS)
def test_a_stream_of_part_words_is_refused(codec):
    """A header that says 2-byte words over a stream of odd length is a SnapshotError."""
    with pytest.raises(SnapshotError):
        delta.decode(forged(b"", codec, base=BASE[:-1]), BASE[:-1])


def peak_bytes_of_refusal(data: bytes) -> int:
    """Peak traced allocation while `data` is refused (it must be)."""
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError):
            delta.decode(data, BASE)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("codec", delta.CODECS)
def test_huge_declared_sizes_allocate_nothing_big(codec):
    """A frame that declares 2**40 bytes, one of unknown size that inflates to 64 MiB, and one
    that declares more than the codec can need for this base are refused, each while the
    decoder holds far less than a MiB (the base is 2 KB)."""
    huge = b"\x28\xb5\x2f\xfd" + bytes([0b11100000]) + struct.pack("<Q", 1 << 40) + b"\x01\x00\x00"
    obj = zstandard.ZstdCompressor().compressobj()  # no size given: the frame does not say
    bomb = obj.compress(bytes(64 << 20)) + obj.flush()
    too_big = zstandard.ZstdCompressor().compress(bytes(100 * len(BASE)))
    for frame in (huge, bomb, too_big):
        assert peak_bytes_of_refusal(forged(b"", codec, frame=frame)) < 1 << 20


def flip(raw: bytes, positions: list[int], junk: int) -> bytes:
    data = bytearray(raw)
    for p in positions:
        data[p % len(data)] ^= junk
    return bytes(data)


@settings(max_examples=300, deadline=None, database=None)
@given(st.sampled_from(delta.CODECS),
       st.one_of(st.binary(max_size=64),
                 st.builds(lambda c, n, tail: COUNTS.pack(c, n) + tail,
                           st.integers(0, 40), st.integers(0, 60), st.binary(max_size=80)),
                 st.builds(flip, st.just(real_raw()), st.lists(st.integers(0, 10**6), min_size=1,
                                                              max_size=3), st.integers(1, 255))))
def test_any_inflated_payload_decodes_or_is_refused(codec, raw):
    """Whatever a well-framed payload holds, decoding gives a stream of the base's length or a
    SnapshotError: no other exception escapes."""
    try:
        out = delta.decode(forged(raw, codec), BASE)
    except SnapshotError:
        return
    assert len(out) == len(BASE)
