"""Fuzzing what strangers can send: the wire decoder, the session state machine, and the chunk
and delta codecs. Whatever the input, the answer is the module's own error (which the shells
turn into a close with a reason, or a skipped source), never another exception.

The default suite runs a few hundred cases per target; `pytest --slow` runs the slow-marked
copies at 10,000 cases each.
"""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo2p2p import delta
from echo2p2p import messages as m
from echo2p2p.errors import ProtocolError, RemoteProtocolError, SnapshotError
from echo2p2p.session import Session, Side, State
from echo2p2p.assembler import ChunkAssembler
from echo2p2p.snapshot import build_snapshot

from tests.echo2p2p.test_messages import any_message, msgpack_objects

QUICK, SLOW = 300, 10_000


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def frames() -> st.SearchStrategy[bytes]:
    """Raw bytes, arbitrary msgpack, valid headers over random fields, and valid frames with a
    few bytes flipped."""
    header = st.builds(lambda tag, body: msgpack.packb({"p": m.BASE_PROTOCOL, "t": tag, **body},
                                                       use_bin_type=True),
                       st.sampled_from(sorted(m.MESSAGE_TYPES)),
                       st.dictionaries(st.text(max_size=12), msgpack_objects, max_size=6))
    flipped = st.builds(_flip, any_message.map(m.encode), st.lists(st.integers(0, 10**6), max_size=4))
    return st.one_of(st.binary(max_size=300), msgpack_objects.map(
        lambda o: msgpack.packb(o, use_bin_type=True)), header, flipped)


def _flip(frame: bytes, positions: list[int]) -> bytes:
    data = bytearray(frame)
    for p in positions:
        data[p % len(data)] ^= 0xFF
    return bytes(data)


def check_decoder(data: bytes) -> None:
    try:
        msg = m.decode(data)
    except RemoteProtocolError as exc:
        assert exc.reason and len(exc.reason) < 200 and 1000 <= exc.code < 5000
    else:
        assert type(msg) in m.MESSAGE_TYPES.values()


def check_session(side: Side, inputs: list[bytes]) -> None:
    """Feed a session frames until it closes: each is a message or a ProtocolError, and a
    closed session takes nothing more."""
    session = Session(side, 0.0)
    for i, data in enumerate(inputs):
        try:
            session.receive(data, float(i))
        except ProtocolError:
            session.state = State.CLOSED  # what the shells do: close the connection
            break
    if session.state is State.CLOSED:
        with pytest.raises(ProtocolError):
            session.receive(m.encode(m.Heartbeat()), 1e6)


BASE = os.urandom(3000)
NEW = bytes(b ^ (i % 7 == 0) for i, b in enumerate(BASE))
TENSORS = [("w", "uint8", [len(NEW)], NEW)]
FULL = build_snapshot(1, TENSORS, chunk_bytes=512)
DELTA = build_snapshot(1, TENSORS, chunk_bytes=512, base=(0, BASE))


def check_chunk(is_delta: bool, index: int, data: bytes) -> None:
    manifest, chunks = DELTA if is_delta else FULL
    assembler = ChunkAssembler(manifest, base=BASE if is_delta else None)
    try:
        assembler.add(index, data)
    except SnapshotError:
        return
    assert data == chunks[index]  # accepted: then it is the very chunk the manifest names


def check_delta_decode(data: bytes, base: bytes) -> None:
    try:
        out = delta.decode(data, base)
    except SnapshotError:
        return
    assert len(out) == len(base)


def mutated_chunks() -> st.SearchStrategy[tuple[bool, int, bytes]]:
    def draw(is_delta: bool, index: int, positions: list[int], junk: bytes, mode: int):
        chunk = (DELTA if is_delta else FULL)[1][index % len(FULL[1])]
        data = (_flip(chunk, positions) if mode == 0 else junk if mode == 1
                else chunk[: len(chunk) // 2] if mode == 2 else chunk + junk)
        return is_delta, index, data
    return st.builds(draw, st.booleans(), st.integers(-2, len(FULL[1]) + 2),
                     st.lists(st.integers(0, 10**6), min_size=1, max_size=3),
                     st.binary(max_size=600), st.integers(0, 3))


def _targets(examples: int):
    @fuzz(examples)
    @given(frames())
    def decoder(data):
        check_decoder(data)

    @fuzz(examples)
    @given(st.sampled_from(list(Side)), st.lists(st.one_of(any_message.map(m.encode), frames()),
                                                 max_size=8))
    def session(side, inputs):
        check_session(side, inputs)

    @fuzz(examples)
    @given(mutated_chunks())
    def chunks(case):
        check_chunk(*case)

    @fuzz(examples)
    @given(st.one_of(st.binary(max_size=400), st.builds(
        _flip, st.just(delta.encode(NEW, BASE)), st.lists(st.integers(0, 10**6), max_size=3))),
        st.sampled_from([BASE, BASE[:100], b""]))
    def delta_decode(data, base):
        check_delta_decode(data, base)

    return {"decoder": decoder, "session": session, "chunks": chunks, "delta": delta_decode}


QUICK_TARGETS, SLOW_TARGETS = _targets(QUICK), _targets(SLOW)


@pytest.mark.parametrize("target", sorted(QUICK_TARGETS))
def test_fuzz(target):
    QUICK_TARGETS[target]()


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(SLOW_TARGETS))
def test_fuzz_10k(target):
    SLOW_TARGETS[target]()
