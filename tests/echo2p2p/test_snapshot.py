"""Snapshots: build, chunk, verify and reassemble weights bit-exactly, and refuse bad input."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import messages as m
from echo2p2p.errors import LocalProtocolError, SnapshotError
from echo2p2p.messages import ChunkEntry
from echo2p2p.assembler import ChunkAssembler
from echo2p2p.snapshot import DTYPE_BYTES, build_snapshot, chunk_digest, validate_manifest
from echo2p2p.policy.weights import state_to_tensors, tensors_to_state

FAST = settings(max_examples=60, deadline=None)


@st.composite
def tensor(draw, name: str):
    dtype = draw(st.sampled_from(sorted(DTYPE_BYTES)))
    shape = draw(st.lists(st.integers(0, 6), max_size=3))
    n = math.prod(shape) * DTYPE_BYTES[dtype]
    return name, dtype, shape, draw(st.binary(min_size=n, max_size=n))


tensor_lists = st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=6).flatmap(
    lambda names: st.tuples(*[tensor(n) for n in names]).map(list))


def _snapshot(chunk_bytes: int = 16):
    tensors = [("a", "bfloat16", [4, 5], bytes(range(40))),
               ("b", "float32", [7], bytes(range(100, 128))),
               ("c", "int64", [0, 3], b"")]
    return tensors, *build_snapshot(2, tensors, chunk_bytes=chunk_bytes)


def _assemble(manifest, chunks, order=None) -> ChunkAssembler:
    asm = ChunkAssembler(manifest)
    for i in order if order is not None else range(len(chunks)):
        asm.add(i, chunks[i])
    return asm


@FAST
@given(tensors=tensor_lists, chunk_bytes=st.integers(1, 300), data=st.data())
def test_round_trip_any_order(tensors, chunk_bytes, data):
    """Chunks added in any order reassemble every tensor bit-exactly."""
    manifest, chunks = build_snapshot(5, tensors, chunk_bytes=chunk_bytes)
    order = data.draw(st.permutations(range(len(chunks))))
    asm = ChunkAssembler(manifest)
    assert asm.complete == (len(chunks) == 0)
    for k, i in enumerate(order):
        assert asm.add(i, chunks[i]) == (k == len(order) - 1)
    assert asm.complete and asm.missing == []
    assert asm.received_bytes == sum(len(c) for c in chunks)
    got = asm.tensors()
    assert [(n, d, s, bytes(v)) for n, d, s, v in got] == [
        (n, d, list(s), bytes(b)) for n, d, s, b in tensors]
    assert all(len(c) == e.wire_bytes and chunk_digest(c) == e.digest
               for c, e in zip(chunks, manifest.chunks))


def test_chunk_layout_and_memoryview_input():
    """Raw chunks are chunk_bytes long (last one shorter) and memoryviews are accepted as input."""
    raw = bytes(range(256)) * 10
    manifest, chunks = build_snapshot(0, [("w", "uint8", [2560], memoryview(raw))], chunk_bytes=1000)
    assert [c.raw_bytes for c in manifest.chunks] == [1000, 1000, 560]
    assert manifest.total_bytes == 2560 and manifest.digest == chunk_digest(raw)
    assert bytes(_assemble(manifest, chunks).tensors()[0][3]) == raw


def test_duplicate_add_is_ignored():
    """A chunk added twice counts once and does not change the result."""
    tensors, manifest, chunks = _snapshot()
    asm = ChunkAssembler(manifest)
    asm.add(0, chunks[0])
    before = asm.received_bytes
    assert asm.add(0, chunks[0]) is False
    assert asm.received_bytes == before and asm.missing == list(range(1, len(chunks)))


def test_concurrent_writes_from_threads():
    """Chunks (each sent three times) verified and written from many threads, their claims kept
    by one owner, assemble exactly once."""
    from concurrent.futures import ThreadPoolExecutor

    raw = bytes(range(256)) * 64
    manifest, chunks = build_snapshot(1, [("w", "uint8", [len(raw)], raw)], chunk_bytes=100)
    asm = ChunkAssembler(manifest)
    copies = [i % len(chunks) for i in range(3 * len(chunks))]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: asm.verify(i, chunks[i]), copies))
        claimed = [i for i in copies if asm.claim(i)]  # the owner's thread: no lock needed
        assert sorted(claimed) == list(range(len(chunks)))  # every duplicate refused a claim
        list(pool.map(lambda i: asm.write(i, chunks[i]), claimed))
    done = [asm.commit(i) for i in claimed]
    assert done[-1] and not any(done[:-1])
    assert asm.complete and asm.received_bytes == sum(map(len, chunks))
    assert bytes(asm.tensors()[0][3]) == raw


def test_a_failed_write_releases_its_claim():
    """A claimed chunk whose write fails is released: the next copy claims and completes it; a
    write or commit without a claim is our bug (LocalProtocolError)."""
    manifest, chunks = build_snapshot(1, [("w", "uint8", [300], bytes(300))], chunk_bytes=100)
    asm = ChunkAssembler(manifest)
    with pytest.raises(LocalProtocolError):
        asm.write(0, chunks[0])
    with pytest.raises(LocalProtocolError):
        asm.commit(0)
    assert asm.claim(0) and not asm.claim(0)
    with pytest.raises(SnapshotError):
        asm.write(0, b"not zstd" + bytes(len(chunks[0])))
    asm.release(0)
    assert asm.missing == [0, 1, 2] and asm.received_bytes == 0
    assert not asm.add(0, chunks[0]) and asm.missing == [1, 2]
    assert not asm.add(0, chunks[0]) and asm.received_bytes == len(chunks[0])  # repeat ignored


@FAST
@given(data=st.data())
def test_flipped_byte_rejected_then_good_chunk_taken(data):
    """A chunk with one flipped byte raises SnapshotError; the right bytes are still taken later."""
    tensors, manifest, chunks = _snapshot()
    i = data.draw(st.integers(0, len(chunks) - 1))
    pos = data.draw(st.integers(0, len(chunks[i]) - 1))
    bad = bytearray(chunks[i])
    bad[pos] ^= data.draw(st.integers(1, 255))
    asm = ChunkAssembler(manifest)
    with pytest.raises(SnapshotError):
        asm.add(i, bytes(bad))
    assert i in asm.missing and asm.received_bytes == 0
    for j in range(len(chunks)):
        asm.add(j, chunks[j])
    assert bytes(asm.tensors()[0][3]) == tensors[0][3]


@pytest.mark.parametrize("index", [-1, 99, "0", True])
def test_bad_index_rejected(index):
    """A chunk index outside the manifest (or not an int) raises SnapshotError."""
    _, manifest, chunks = _snapshot()
    with pytest.raises(SnapshotError):
        ChunkAssembler(manifest).add(index, chunks[0])


def test_wrong_size_and_truncated_chunk_rejected():
    """A chunk of the wrong length is refused before hashing."""
    _, manifest, chunks = _snapshot()
    asm = ChunkAssembler(manifest)
    with pytest.raises(SnapshotError):
        asm.add(0, chunks[0][:-1])
    with pytest.raises(SnapshotError):
        asm.add(0, chunks[0] + b"\0")


def test_tensors_before_complete_raises():
    """tensors() with chunks missing raises SnapshotError."""
    _, manifest, chunks = _snapshot()
    asm = ChunkAssembler(manifest)
    asm.add(0, chunks[0])
    with pytest.raises(SnapshotError):
        asm.tensors()


def test_stream_digest_checked():
    """A manifest whose stream digest is wrong fails at tensors(), though every chunk verified."""
    _, manifest, chunks = _snapshot()
    forged = dataclasses.replace(manifest, digest=bytes(32))
    asm = _assemble(forged, chunks)
    with pytest.raises(SnapshotError):
        asm.tensors()


def test_chunk_that_inflates_to_the_wrong_size_rejected():
    """A hash-consistent chunk whose frame declares a different raw size raises SnapshotError."""
    import zstandard

    _, manifest, chunks = _snapshot(chunk_bytes=16)
    wire = zstandard.ZstdCompressor().compress(b"\0" * 17)
    entries = list(manifest.chunks)
    entries[0] = ChunkEntry(16, len(wire), chunk_digest(wire))
    asm = ChunkAssembler(dataclasses.replace(manifest, chunks=entries))
    with pytest.raises(SnapshotError):
        asm.add(0, wire)


def _malformed(manifest):
    t, c = manifest.tensors, manifest.chunks
    yield "overlapping offsets", dataclasses.replace(
        manifest, tensors=[t[0], dataclasses.replace(t[1], offset=t[1].offset - 2), t[2]])
    yield "gap in offsets", dataclasses.replace(
        manifest, tensors=[t[0], dataclasses.replace(t[1], offset=t[1].offset + 2), t[2]])
    yield "wrong nbytes", dataclasses.replace(
        manifest, tensors=[dataclasses.replace(t[0], nbytes=38), *t[1:]])
    yield "unknown dtype", dataclasses.replace(
        manifest, tensors=[dataclasses.replace(t[0], dtype="bfloat17"), *t[1:]])
    yield "negative dim", dataclasses.replace(
        manifest, tensors=[dataclasses.replace(t[0], shape=[-4, -5]), *t[1:]])
    yield "duplicate name", dataclasses.replace(
        manifest, tensors=[t[0], dataclasses.replace(t[1], name="a"), t[2]])
    yield "unknown codec", dataclasses.replace(manifest, codec="lz4")
    yield "unknown hash", dataclasses.replace(manifest, hash_algo="sha1")
    yield "total too big", dataclasses.replace(manifest, total_bytes=manifest.total_bytes + 1)
    yield "chunk missing", dataclasses.replace(manifest, chunks=c[:-1])
    yield "chunk raw size", dataclasses.replace(
        manifest, chunks=[dataclasses.replace(c[0], raw_bytes=15), *c[1:]])
    yield "huge wire size", dataclasses.replace(
        manifest, chunks=[dataclasses.replace(c[0], wire_bytes=1 << 30), *c[1:]])
    yield "short digest", dataclasses.replace(
        manifest, chunks=[dataclasses.replace(c[0], digest=b"x"), *c[1:]])
    yield "zero chunk_bytes", dataclasses.replace(manifest, chunk_bytes=0)
    yield "no stream digest", dataclasses.replace(manifest, digest=b"")
    yield "base after version", dataclasses.replace(manifest, base_version=manifest.version)


@pytest.mark.parametrize("case", [name for name, _ in _malformed(_snapshot()[1])])
def test_malformed_manifest_rejected(case):
    """Each kind of inconsistent manifest raises SnapshotError at ChunkAssembler()."""
    bad = dict(_malformed(_snapshot()[1]))[case]
    with pytest.raises(SnapshotError):
        ChunkAssembler(bad)


def test_max_total_bytes_guard():
    """A manifest larger than the caller allows is refused before any allocation."""
    _, manifest, _ = _snapshot()
    with pytest.raises(SnapshotError):
        ChunkAssembler(manifest, max_total_bytes=manifest.total_bytes - 1)


@pytest.mark.parametrize("tensors", [
    [("a", "float32", [3], b"\0" * 11)],
    [("a", "float31", [3], b"\0" * 12)],
    [("a", "uint8", [1], b"\0"), ("a", "uint8", [1], b"\0")],
])
def test_build_rejects_inconsistent_input(tensors):
    """build_snapshot raises LocalProtocolError for bad sizes, dtypes or repeated names."""
    with pytest.raises(LocalProtocolError):
        build_snapshot(1, tensors)


def test_torch_round_trip_bf16_and_tied_sent_once():
    """state -> snapshot -> assemble -> state equals the bf16 cast; a tied tensor travels once."""
    torch.manual_seed(0)
    emb = torch.randn(50, 8)
    state = {"embed.weight": emb, "layer.weight": torch.randn(8, 8),
             "layer.bias": torch.randn(8), "scale": torch.tensor(3.5), "empty": torch.zeros(0, 4),
             "lm_head.weight": emb, "positions": torch.arange(7)}
    tensors = state_to_tensors(state)
    assert [n for n, *_ in tensors] == [
        "embed.weight", "layer.weight", "layer.bias", "scale", "empty", "positions"]
    manifest, chunks = build_snapshot(3, tensors, chunk_bytes=100)
    asm = _assemble(manifest, chunks, order=reversed(range(len(chunks))))
    out = tensors_to_state(asm.tensors())
    for name, got in out.items():
        want = state[name].to(torch.bfloat16) if state[name].is_floating_point() else state[name]
        assert got.dtype == want.dtype and torch.equal(got, want), name
    got = out["layer.weight"]
    got.add_(1)  # owns writable memory, detached from the assembler's buffer
    assert torch.equal(tensors_to_state(asm.tensors())["layer.weight"],
                       state["layer.weight"].to(torch.bfloat16))


def test_tensors_to_state_rejects_wrong_size():
    """tensors_to_state raises SnapshotError when bytes do not fit dtype and shape."""
    with pytest.raises(SnapshotError):
        tensors_to_state([("a", "bfloat16", [3], b"\0" * 5)])


# --- full snapshots: arrival with repeats ---------------------------------------------------


@FAST
@given(tensors=tensor_lists, chunk_bytes=st.integers(1, 300), data=st.data())
def test_repeated_chunks_in_any_order_count_once(tensors, chunk_bytes, data):
    """Chunks arriving in any order, some several times, assemble once: add() turns True with
    the last new chunk, repeats change neither the bytes taken nor the result."""
    manifest, chunks = build_snapshot(5, tensors, chunk_bytes=chunk_bytes)
    n = len(chunks)
    repeats = data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n)) if n else []
    arrivals = data.draw(st.permutations(list(range(n)) + repeats))
    asm = ChunkAssembler(manifest)
    seen: set[int] = set()
    for i in arrivals:
        seen.add(i)
        assert asm.add(i, chunks[i]) == (len(seen) == n)
        assert asm.received_bytes == sum(len(chunks[j]) for j in seen)
        assert asm.missing == sorted(set(range(n)) - seen)
    assert bytes(asm.stream()) == b"".join(bytes(t[3]) for t in tensors)


# --- delta snapshots -----------------------------------------------------------------------


def _split(stream: bytes, specs: list[tuple[str, list[int]]]) -> list:
    """Tensors t0, t1, ... of the given (dtype, shape), cut in order from `stream`."""
    out, pos = [], 0
    for i, (dtype, shape) in enumerate(specs):
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        out.append((f"t{i}", dtype, shape, stream[pos:pos + n]))
        pos += n
    return out


@st.composite
def delta_cases(draw):
    """(tensors of the new version, base stream, new stream): new = base with a random share of
    bytes, or of whole 2/4/8-byte words, changed; the share is sometimes exactly 0 or 1."""
    common = st.sampled_from(["bfloat16", "float32", "uint8", "int64"])
    dtypes = st.one_of(common, st.sampled_from(sorted(DTYPE_BYTES)))
    specs = draw(st.lists(st.tuples(dtypes, st.lists(st.integers(0, 7), max_size=3)), max_size=5))
    total = sum(math.prod(shape) * DTYPE_BYTES[d] for d, shape in specs)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 256, total, dtype=np.uint8)
    unit = draw(st.sampled_from([1, 2, 4, 8]))
    density = draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)))
    new = base.copy()
    words = new[:total // unit * unit].reshape(-1, unit)  # (words, unit), a view into new
    hit = rng.random(len(words)) < density  # random() < 1.0 always: density 1 changes all
    mask = rng.integers(0, 256, (int(hit.sum()), unit), dtype=np.uint8)
    mask[:, 0] |= 1  # every word hit really changes
    words[hit] ^= mask
    return _split(new.tobytes(), specs), base.tobytes(), new.tobytes()


@FAST
@given(case=delta_cases(), data=st.data())
def test_delta_round_trip_any_order(case, data):
    """A delta manifest validates, crosses the wire in a VersionAnnouncement, and its chunks,
    applied to the base in any order, rebuild the new stream bit for bit."""
    tensors, base, new = case
    chunk_bytes = data.draw(st.integers(max(1, len(new) // 150), max(1, len(new)) + 64))
    manifest, chunks = build_snapshot(9, tensors, chunk_bytes=chunk_bytes, base=(4, base))
    assert (manifest.codec, manifest.base_version, manifest.total_bytes) == ("delta", 4, len(new))
    assert manifest.digest == chunk_digest(new)
    validate_manifest(manifest)
    announcement = m.VersionAnnouncement(
        manifest, m.RelayPlan(9, 4, 1, [], b"\xff" * 4 * len(chunks)), b"\x01" * 64)
    assert m.decode(m.encode(announcement)) == announcement
    asm = ChunkAssembler(manifest, base=memoryview(base))
    for i in data.draw(st.permutations(range(len(chunks)))):
        asm.add(i, chunks[i])
    assert bytes(asm.stream()) == new
    assert [(n, d, s, bytes(v)) for n, d, s, v in asm.tensors()] == tensors


def _delta_pair(density: float = 0.05):
    """v1 -> v2 of one bf16 tensor, as (base stream, new stream, delta manifest, its chunks)."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 2**16, 600, dtype=np.uint16)
    new = base.copy()
    hit = rng.random(new.size) < density
    new[hit] ^= 0x0101
    tensors = [("w", "bfloat16", [20, 30], new.tobytes())]
    manifest, chunks = build_snapshot(2, tensors, chunk_bytes=128, base=(1, base.tobytes()))
    return base.tobytes(), new.tobytes(), manifest, chunks


@pytest.mark.parametrize("density", [0.01, 0.9])
def test_delta_on_the_wrong_base_fails_the_stream_digest(density):
    """Every chunk of a delta applied to a base one byte off verifies, but stream() and
    tensors() then raise SnapshotError: the wrong base never passes silently."""
    base, new, manifest, chunks = _delta_pair(density)
    pos = next(i for i in range(len(base) - 1, -1, -1) if base[i] == new[i])
    wrong = bytearray(base)
    wrong[pos] ^= 0x40
    asm = ChunkAssembler(manifest, base=bytes(wrong))
    for i in range(len(chunks)):
        asm.add(i, chunks[i])
    assert asm.complete
    with pytest.raises(SnapshotError, match="digest"):
        asm.stream()
    with pytest.raises(SnapshotError, match="digest"):
        asm.tensors()


def test_delta_needs_exactly_its_base():
    """A delta without a base, a full snapshot with one, or a base of the wrong length: refused."""
    base, new, delta_manifest, _ = _delta_pair()
    full_manifest, _ = build_snapshot(2, [("w", "bfloat16", [20, 30], new)], chunk_bytes=128)
    with pytest.raises(SnapshotError):
        ChunkAssembler(delta_manifest)
    with pytest.raises(SnapshotError):
        ChunkAssembler(full_manifest, base=base)
    for wrong in (base[:-2], base + b"\0\0", b""):
        with pytest.raises(SnapshotError):
            ChunkAssembler(delta_manifest, base=wrong)


def test_build_delta_rejects_a_base_of_the_wrong_length():
    """build_snapshot with a base longer or shorter than the version raises LocalProtocolError."""
    tensors = [("w", "uint8", [10], bytes(10))]
    for wrong in (bytes(9), bytes(11)):
        with pytest.raises(LocalProtocolError):
            build_snapshot(2, tensors, base=(1, wrong))


def test_codec_and_base_version_must_agree():
    """validate_manifest refuses codec "delta" without a base version and "zstd" with one."""
    _, _, delta_manifest, _ = _delta_pair()
    _, full_manifest, _ = _snapshot()
    validate_manifest(delta_manifest)
    validate_manifest(full_manifest)
    with pytest.raises(SnapshotError):
        validate_manifest(dataclasses.replace(delta_manifest, base_version=None))
    with pytest.raises(SnapshotError):
        validate_manifest(dataclasses.replace(full_manifest, base_version=1))
