"""The wire codec: every message round-trips, and no input makes decode raise anything but
RemoteProtocolError with the right close code."""

from __future__ import annotations

import dataclasses
import math
import types
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import messages as m
from echo2p2p.errors import LocalProtocolError, RemoteProtocolError, UnsupportedProtocol

FAST = settings(max_examples=40, deadline=None)
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def strategy_for(typ) -> st.SearchStrategy:
    """Values msgpack can carry for a field hint; NaN is left out since NaN != NaN."""
    if typ is bool:
        return st.booleans()
    if typ is int:
        return st.integers(INT64_MIN, UINT64_MAX)
    if typ is float:
        return st.floats(allow_nan=False)
    if typ is str:
        return st.text(max_size=20)
    if typ is bytes:
        return st.binary(max_size=40)
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[strategy_for(t) for t in typing.get_args(typ)])
    if typ is type(None):
        return st.none()
    if origin is list:
        return st.lists(strategy_for(typing.get_args(typ)[0]), max_size=3)
    if dataclasses.is_dataclass(typ):
        hints = typing.get_type_hints(typ)
        return st.builds(typ, **{f.name: strategy_for(hints[f.name])
                                 for f in dataclasses.fields(typ)})
    raise AssertionError(f"no strategy for {typ!r}")


any_message = st.one_of(*[strategy_for(cls) for cls in m.MESSAGE_TYPES.values()])

msgpack_objects = st.recursive(
    st.none() | st.booleans() | st.integers(INT64_MIN, UINT64_MAX) | st.floats()
    | st.text(max_size=10) | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


def _decode_error(data: bytes) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        m.decode(data)
    return info.value


def _frame(tag: str, **fields) -> bytes:
    return msgpack.packb({"p": m.BASE_PROTOCOL, "t": tag, **fields}, use_bin_type=True)


@FAST
@given(msg=any_message)
def test_round_trip_every_message(msg):
    """decode(encode(msg)) == msg for every wire message type."""
    assert m.decode(m.encode(msg)) == msg


@pytest.mark.parametrize("tag", sorted(m.MESSAGE_TYPES))
def test_round_trip_each_type(tag):
    """Each type in MESSAGE_TYPES round-trips (at least a few examples each)."""

    @settings(max_examples=10, deadline=None)
    @given(msg=strategy_for(m.MESSAGE_TYPES[tag]))
    def check(msg):
        assert m.decode(m.encode(msg)) == msg

    check()


def test_unknown_keys_ignored():
    """Extra keys in a frame are ignored, so newer peers can talk to older hubs."""
    assert m.decode(_frame("lease_request", n=3, future_field=[1, 2])) == m.LeaseRequest(3)


def test_encode_rejects_non_messages():
    """encode of something that is not a wire message raises LocalProtocolError."""
    with pytest.raises(LocalProtocolError):
        m.encode(m.Sample(b"", b"", "", 0.0, "stop"))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200))
def test_decode_arbitrary_bytes(data):
    """decode of any bytes returns a message or raises RemoteProtocolError, nothing else."""
    try:
        assert isinstance(m.decode(data), tuple(m.MESSAGE_TYPES.values()))
    except RemoteProtocolError:
        pass


@settings(max_examples=150, deadline=None)
@given(obj=msgpack_objects)
def test_decode_arbitrary_msgpack(obj):
    """decode of any msgpack value returns a message or raises RemoteProtocolError."""
    try:
        m.decode(msgpack.packb(obj, use_bin_type=True))
    except RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(tag=st.sampled_from(sorted(m.MESSAGE_TYPES)), data=st.data())
def test_decode_valid_header_random_fields(tag, data):
    """A valid header with random values under the real field names never crashes decode."""
    names = [f.name for f in dataclasses.fields(m.MESSAGE_TYPES[tag])]
    fields = data.draw(st.dictionaries(st.sampled_from(names), msgpack_objects)) if names else {}
    try:
        msg = m.decode(_frame(tag, **fields))
    except RemoteProtocolError as e:
        assert e.code == m.CLOSE_PROTOCOL_ERROR
    else:
        assert type(msg) is m.MESSAGE_TYPES[tag]


@pytest.mark.parametrize("proto", [0, 1, 4, "2", 2.0, True, None])
def test_wrong_protocol_version(proto):
    """A frame whose "p" is not a version this release speaks (an int) closes with
    CLOSE_BAD_PROTOCOL_VERSION."""
    frame = msgpack.packb({"p": proto, "t": "heartbeat"})
    assert _decode_error(frame).code == m.CLOSE_BAD_PROTOCOL_VERSION


@pytest.mark.parametrize("proto", m.SUPPORTED_PROTOCOLS)
def test_a_frame_decodes_only_in_the_versions_asked_for(proto):
    """Each supported version round-trips when asked for; a frame of one version is refused
    (4000, naming it) where only the other is accepted: a connection uses one."""
    frame = m.encode(m.LeaseRequest(n=2), proto)
    assert msgpack.unpackb(frame)["p"] == proto
    assert m.decode(frame, protocols=(proto,)) == m.LeaseRequest(n=2)
    other = next(p for p in m.SUPPORTED_PROTOCOLS if p != proto)
    with pytest.raises(UnsupportedProtocol) as info:
        m.decode(frame, protocols=(other,))
    assert (info.value.code, info.value.theirs) == (m.CLOSE_BAD_PROTOCOL_VERSION, proto)


@pytest.mark.parametrize("tag", ["nope", "", None, 3, b"heartbeat", ["hello"]])
def test_unknown_type(tag):
    """An unknown or non-string "t" closes with CLOSE_UNKNOWN_TYPE."""
    frame = msgpack.packb({"p": m.BASE_PROTOCOL, "t": tag}, use_bin_type=True)
    assert _decode_error(frame).code == m.CLOSE_UNKNOWN_TYPE


@pytest.mark.parametrize("data", [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({1: 2}),
                                  _frame("heartbeat") + b"\x00"])
def test_malformed_frames(data):
    """Garbage, non-maps, non-string keys and trailing bytes close with CLOSE_PROTOCOL_ERROR."""
    assert _decode_error(data).code == m.CLOSE_PROTOCOL_ERROR


def _wrong_value(typ):
    """A value of the wrong wire type for a field of type `typ` (`X | None` counts as X)."""
    if typing.get_origin(typ) is not None and type(None) in typing.get_args(typ):
        (typ,) = [t for t in typing.get_args(typ) if t is not type(None)]
    return 7 if typ is str else 1 if typ is bool else "x"


@FAST
@given(msg=any_message, data=st.data())
def test_wrong_field_type_names_field(msg, data):
    """A top-level field of the wrong type closes with CLOSE_PROTOCOL_ERROR, naming the field."""
    cls = type(msg)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if not names:
        return
    name = data.draw(st.sampled_from(names))
    frame = msgpack.unpackb(m.encode(msg), raw=False)
    frame[name] = _wrong_value(hints[name])
    err = _decode_error(msgpack.packb(frame, use_bin_type=True))
    assert err.code == m.CLOSE_PROTOCOL_ERROR
    assert f"{cls.TYPE}.{name}" in err.reason


def test_wrong_nested_field_type_names_path():
    """A bad field deep inside a manifest is named by its path."""
    frame = {"p": m.BASE_PROTOCOL, "t": "version", "manifest": {
        "version": 1, "base_version": None, "codec": "zstd", "hash_algo": "blake2b-256",
        "chunk_bytes": 4, "total_bytes": 0, "tensors": [],
        "chunks": [{"raw_bytes": 1, "wire_bytes": 1, "digest": "not bytes"}]}}
    err = _decode_error(msgpack.packb(frame, use_bin_type=True))
    assert err.code == m.CLOSE_PROTOCOL_ERROR and "manifest.chunks.digest" in err.reason


def test_missing_field():
    """A required field left out closes with CLOSE_PROTOCOL_ERROR, naming it."""
    err = _decode_error(_frame("hello", name="x", engine="vllm"))
    assert err.code == m.CLOSE_PROTOCOL_ERROR and "hello.device" in err.reason


@pytest.mark.parametrize("key", ["t", "p"])
def test_deeply_nested_header_value(key):
    """A header value nested ~1000 lists deep still gives RemoteProtocolError."""
    nested = b"\x91" * 1000 + b"\xc0"
    other = b"\xa1t\xa9heartbeat" if key == "p" else b"\xa1p\x01"
    _decode_error(b"\x82" + other + b"\xa1" + key.encode() + nested)


@FAST
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_pack_ids_round_trip(ids):
    """Token ids survive pack_ids/unpack_ids, 4 bytes each."""
    packed = m.pack_ids(ids)
    assert len(packed) == 4 * len(ids) and m.unpack_ids(packed) == ids


@FAST
@given(values=st.lists(st.floats(width=32, allow_nan=False), max_size=300))
def test_pack_logprobs_round_trip(values):
    """float32-representable logprobs survive pack_logprobs/unpack_logprobs exactly."""
    packed = m.pack_logprobs(values)
    assert len(packed) == 4 * len(values) and m.unpack_logprobs(packed) == values


def test_pack_logprobs_rounds_to_float32():
    """Python floats are rounded to float32 on the wire."""
    (back,) = m.unpack_logprobs(m.pack_logprobs([-0.1]))
    assert back != -0.1 and math.isclose(back, -0.1, rel_tol=1e-7)


# --- bounded decoding ---------------------------------------------------------------------------

PEER_TO_HUB = [m.Hello, m.Heartbeat, m.LeaseRequest, m.RolloutSubmission, m.VersionHeld,
               m.TransferReport, m.RelayReport, m.Goodbye]
LIMITED = ["max_str_len", "max_bin_len", "max_array_len", "max_map_len", "max_ext_len"]


def _oversized(kind: str, n: int):
    """A msgpack value whose length, for the limit `kind`, is n."""
    return {"max_str_len": lambda: "s" * n, "max_bin_len": lambda: b"b" * n,
            "max_array_len": lambda: [0] * n, "max_map_len": lambda: {f"k{i}": 0 for i in range(n)},
            "max_ext_len": lambda: msgpack.ExtType(1, b"e" * n)}[kind]()


# FROM_HUB's caps run to millions: the same decoder under smaller numbers keeps examples quick.
SMALL_HUB = dataclasses.replace(m.FROM_HUB, max_str_len=5000, max_bin_len=5000, max_array_len=5000)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(LIMITED), over=st.integers(1, 3000), where=st.sampled_from(
    ["unknown key", "known field", "nested"]), limits=st.sampled_from([m.FROM_PEER, SMALL_HUB]))
def test_a_value_over_a_decoder_limit_is_refused(kind, over, where, limits):
    """Any string, bin, array, map or ext longer than its limit, wherever it sits in the frame,
    is refused with RemoteProtocolError (1002) naming the limit; never another exception."""
    value = _oversized(kind, getattr(limits, kind) + over)
    body = {"junk": value} if where == "unknown key" else \
        {"name": value} if where == "known field" else {"junk": [[{"x": value}]]}
    data = _frame("hello", engine="relay", device="cpu", **({} if "name" in body else {"name": "a"}),
                  **body)
    with pytest.raises(RemoteProtocolError) as info:
        m.decode(data, limits)
    assert info.value.code == m.CLOSE_PROTOCOL_ERROR and kind in info.value.reason


@settings(max_examples=60, deadline=None)
@given(width=st.integers(0, 20), depth=st.integers(1, 3), maps=st.booleans())
def test_values_past_max_objects_are_refused(width, depth, maps):
    """A frame that builds more than max_objects values (each array or map adds its length
    + 1) is refused; one that builds no more decodes."""
    limits = dataclasses.replace(m.FROM_PEER, max_objects=2000)

    def tree(d):
        if d == 0:
            return None
        return {f"k{i}": tree(d - 1) for i in range(width)} if maps else \
            [tree(d - 1) for _ in range(width)]

    def built(value) -> int:  # the definition in `Limits`, counted independently
        if isinstance(value, dict):
            return len(value) + 1 + sum(built(v) for v in value.values())
        if isinstance(value, list):
            return len(value) + 1 + sum(built(v) for v in value)
        return 0

    frame = {"p": m.BASE_PROTOCOL, "t": "heartbeat", "junk": tree(depth)}
    data = msgpack.packb(frame, use_bin_type=True)
    if built(frame) > limits.max_objects:
        with pytest.raises(RemoteProtocolError) as info:
            m.decode(data, limits)
        assert "values" in info.value.reason
    else:
        assert m.decode_counted(data, limits) == (m.Heartbeat(), built(frame))


def test_the_reported_flood_is_refused_at_the_map_header():
    """The issue's frame, a 4 MB heartbeat with 590,000 unknown keys, is refused for its map
    length; 4 MB of small nested maps within every length cap is refused for its value count."""
    keys = msgpack.packb({"p": m.BASE_PROTOCOL, "t": "heartbeat", **{f"k{i}": 0 for i in range(590_000)}})
    assert "max_map_len" in _decode_error_with(keys, m.FROM_PEER).reason
    nested = msgpack.packb({"p": m.BASE_PROTOCOL, "t": "heartbeat", "x": [
        [{f"{j}": None for j in range(32)} for _ in range(1000)] for _ in range(40)]})
    assert len(nested) > 1 << 20
    assert "values" in _decode_error_with(nested, m.FROM_PEER).reason


def _decode_error_with(data: bytes, limits: m.Limits) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        m.decode(data, limits)
    return info.value


def test_limits_are_sized_per_direction():
    """A manifest of 20,000 chunks decodes under FROM_HUB (what a peer reads) and is refused
    under FROM_PEER (the hub never reads one); a rollout of G = 64 long samples passes FROM_PEER."""
    chunks = [m.ChunkEntry(1 << 16, 1000, bytes(32))] * 20_000
    manifest = m.Manifest(3, None, "zstd", "blake2b-256", 1 << 16, 20_000 << 16,
                          [m.TensorEntry("w", "bfloat16", [20_000, 1 << 15], 0, 20_000 << 16)],
                          chunks)
    frame = m.encode(m.VersionAnnouncement(
        manifest, m.RelayPlan(3, None, 1, [], b"\xff" * 4 * 20_000), bytes(64)))
    assert m.decode(frame, m.FROM_HUB).manifest == manifest
    assert "max_array_len" in _decode_error_with(frame, m.FROM_PEER).reason
    sample = m.Sample(m.pack_ids([7] * 4096), m.pack_logprobs([-0.5] * 4096), "word " * 4096, 1.0,
                      "length")
    rollout = m.RolloutSubmission("L9", 3, [sample] * 64)
    assert m.decode(m.encode(rollout), m.FROM_PEER) == rollout


@FAST
@given(msg=st.one_of(*[strategy_for(cls) for cls in PEER_TO_HUB]))
def test_peer_messages_round_trip_under_the_hubs_limits(msg):
    """Everything a peer may send decodes under FROM_PEER as it was."""
    assert m.decode(m.encode(msg), m.FROM_PEER) == msg


def test_python_names_read_the_wire_fields_they_stand_for():
    """Welcome.task_kind is welcome.task; RelayPlan.swarm is relay_plan.gossip; neither is a
    field of its own (the wire keeps its names), so a decoded frame answers to both."""
    assert "task_kind" not in {f.name for f in dataclasses.fields(m.Welcome)}
    assert "swarm" not in {f.name for f in dataclasses.fields(m.RelayPlan)}
    welcome = m.Welcome("p1", "run", "tiny", "rg:chain_sum", 0, 2, 4, 1.0, 1.0, 16, 7)
    assert m.decode(m.encode(welcome)).task_kind == "rg:chain_sum"
    part = m.GossipPlan(3, None, m.pack_ids([0, 2]), [])
    assert m.decode(m.encode(m.RelayPlan(3, None, 0, [], b"", gossip=part))).swarm == part
    assert m.RelayPlan(3, None, 0, [], b"").swarm is None


@pytest.mark.parametrize("answer,seed", [("17", 17), ("0", 0), ("", None), ("-3", None),
                                         ("85.0", None), ("²", None), (" 4", None)])
def test_a_leases_episode_seed_is_its_answer_in_decimal_or_none(answer, seed):
    """In an environment run the lease's `answer` carries the episode's seed; anything that is
    not plain ASCII digits is no seed (the peer drops such a lease)."""
    lease = m.LeaseGrant("L1", "env-1", "", [1], answer, 2, 10.0, 0)
    assert lease.episode_seed == seed
