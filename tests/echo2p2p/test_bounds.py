"""Value bounds of peer -> hub messages: what honest peers send passes, each out-of-bounds field
closes that connection naming the field, any value either passes in bounds or is refused, and a
live hub refuses a NaN price before it reaches the pool."""

from __future__ import annotations

import dataclasses
import math
import typing

import aiohttp
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import bounds as b
from echo2p2p import messages as m
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.session import Session, Side
from echo2p2p.hub.core.events import Replanned

from tests.conftest import tracker
from tests.echo2p2p.test_session import WELCOME, sample

NONCE, KEY = bytes(range(32)), bytes(range(100, 132))
HONEST_HELLO = m.Hello("host-1234", "transformers", "cpu", 0.0, "http://127.0.0.1:41234", "ab12.xyz",
                       NONCE, KEY)
HONEST = [
    HONEST_HELLO, m.Heartbeat(), m.LeaseRequest(2), m.RolloutSubmission("L0", 0, [sample(), sample()]),
    m.VersionHeld(3), m.TransferReport(4, 3, 1.5, 4096, 8192, [m.SourceRate("p2", 8192, 0.25)]),
    m.TransferReport(4, None, 0.0, 0, 0, []), m.RelayReport(4, "p2", "corrupt", 7, 3),
    m.RelayReport(4, "p2", "stall"), m.Goodbye(1000, "bye"),
]


def ready_hub() -> Session:
    """A hub session past its handshake, welcomed with G = 2 and a 4-token cap."""
    hub = Session(Side.HUB, 0.0)
    hub.receive(m.encode(HONEST_HELLO), 0.0)
    hub.send(WELCOME)
    return hub


def refused(msg: m.Message) -> RemoteProtocolError:
    session = Session(Side.HUB, 0.0) if isinstance(msg, m.Hello) else ready_hub()
    with pytest.raises(RemoteProtocolError) as info:
        session.receive(m.encode(msg), 1.0)
    return info.value


@pytest.mark.parametrize("msg", HONEST, ids=lambda msg: type(msg).__name__)
def test_what_honest_peers_send_passes(msg):
    """Every kind of message an honest peer sends, with its usual values, is taken."""
    session = Session(Side.HUB, 0.0) if isinstance(msg, m.Hello) else ready_hub()
    assert session.receive(m.encode(msg), 1.0) == msg


@pytest.mark.parametrize("listen_addr", [None, "http://127.0.0.1:9", "https://[::1]:7000",
                                         "http://peer.example.org:7000/"])
def test_honest_listen_addresses_pass(listen_addr):
    """No address, or http(s)://HOST:PORT (IPv6 too, a trailing slash too), is taken."""
    hello = dataclasses.replace(HONEST_HELLO, listen_addr=listen_addr)
    assert Session(Side.HUB, 0.0).receive(m.encode(hello), 0.0) == hello


H, R = HONEST_HELLO, m.RolloutSubmission("L0", 0, [sample(), sample()])
lp = m.pack_logprobs
BAD = [
    (dataclasses.replace(H, price_per_hour=math.nan), "hello.price_per_hour"),
    (dataclasses.replace(H, price_per_hour=-0.01), "hello.price_per_hour"),
    (dataclasses.replace(H, price_per_hour=math.inf), "hello.price_per_hour"),
    (dataclasses.replace(H, price_per_hour=b.MAX_PRICE_PER_HOUR * 2), "hello.price_per_hour"),
    (dataclasses.replace(H, engine="none"), "hello.engine"),
    (dataclasses.replace(H, name="x" * 10_000), "hello.name"),
    (dataclasses.replace(H, name="honest\nINFO forged log line"), "hello.name"),
    (dataclasses.replace(H, device="d" * 65), "hello.device"),
    (dataclasses.replace(H, token="t" * 257), "hello.token"),
    (dataclasses.replace(H, nonce=b"short"), "hello.nonce"),
    (dataclasses.replace(H, nonce=bytes(65)), "hello.nonce"),
    (dataclasses.replace(H, peer_key=bytes(31)), "hello.peer_key"),
    (dataclasses.replace(H, listen_addr="ftp://127.0.0.1:9"), "hello.listen_addr"),
    (dataclasses.replace(H, listen_addr="http://127.0.0.1"), "hello.listen_addr"),
    (dataclasses.replace(H, listen_addr="http://127.0.0.1:99999"), "hello.listen_addr"),
    (dataclasses.replace(H, listen_addr="http://u:pw@127.0.0.1:9"), "hello.listen_addr"),
    (dataclasses.replace(H, listen_addr="http://127.0.0.1:9/?x=/chunk/1"), "hello.listen_addr"),
    (dataclasses.replace(H, listen_addr="http://" + "a" * 300 + ":9"), "hello.listen_addr"),
    (dataclasses.replace(H, listen_addr=""), "hello.listen_addr"),
    (m.LeaseRequest(-1), "lease_request.n"),
    (m.LeaseRequest(b.MAX_LEASE_REQUEST + 1), "lease_request.n"),
    (dataclasses.replace(R, lease_id="L" * 65), "rollout.lease_id"),
    (dataclasses.replace(R, version=2**40), "rollout.version"),
    (dataclasses.replace(R, samples=[sample(), dataclasses.replace(sample(), reward=math.nan)]), "reward"),
    (dataclasses.replace(R, samples=[sample(), dataclasses.replace(sample(), reward=math.inf)]), "reward"),
    (dataclasses.replace(R, samples=[sample(), dataclasses.replace(sample(), reward=-2e6)]), "reward"),
    (dataclasses.replace(R, samples=[sample(), dataclasses.replace(sample(), turns=b"\x01")]), "turns"),
    (dataclasses.replace(R, samples=[sample(), dataclasses.replace(sample(), logprobs=lp([-1, math.nan, -1]))]),
     "logprobs"),
    (dataclasses.replace(R, samples=[sample(), dataclasses.replace(sample(), logprobs=lp([-1, -math.inf, -1]))]),
     "logprobs"),
    (dataclasses.replace(R, samples=[sample(), dataclasses.replace(sample(), logprobs=lp([-1, 0.5, -1]))]),
     "logprobs"),
    (m.VersionHeld(-1), "version_held.version"),
    (m.VersionHeld(2**31), "version_held.version"),
    (m.TransferReport(-1, None, 1.0, 0, 0, []), "transfer_report.version"),
    (m.TransferReport(1, -5, 1.0, 0, 0, []), "transfer_report.base_version"),
    (m.TransferReport(1, None, math.nan, 0, 0, []), "transfer_report.download_s"),
    (m.TransferReport(1, None, -1.0, 0, 0, []), "transfer_report.download_s"),
    (m.TransferReport(1, None, 1e9, 0, 0, []), "transfer_report.download_s"),
    (m.TransferReport(1, None, 1.0, -1, 0, []), "transfer_report.bytes_from_hub"),
    (m.TransferReport(1, None, 1.0, 0, 2**63 - 1, []), "transfer_report.bytes_from_peers"),
    (m.TransferReport(1, None, 1.0, 0, 0, [m.SourceRate("p2", 2**63 - 1, 5e-324)]),
     "transfer_report.sources.nbytes"),
    (m.TransferReport(1, None, 1.0, 0, 0, [m.SourceRate("p2", 10, math.inf)]),
     "transfer_report.sources.span_s"),
    (m.TransferReport(1, None, 1.0, 0, 0, [m.SourceRate("p2", 10, -1.0)]),
     "transfer_report.sources.span_s"),
    (m.TransferReport(1, None, 1.0, 0, 0, [m.SourceRate("p" * 65, 10, 1.0)]),
     "transfer_report.sources.peer_id"),
    (m.RelayReport(1, "p2", "bored"), "relay_report.reason"),
    (m.RelayReport(1, "p2", "corrupt", -2), "relay_report.index"),
    (m.RelayReport(1, "p2", "corrupt", 2**32), "relay_report.index"),
    (m.RelayReport(1, "x" * 65, "corrupt"), "relay_report.peer_id"),
    (m.RelayReport(-1, "p2", "corrupt"), "relay_report.version"),
    (m.Goodbye(7, "bye"), "goodbye.code"),
]


@pytest.mark.parametrize("msg, field", BAD, ids=[f for _, f in BAD])
def test_out_of_bounds_field_closes_naming_it(msg, field):
    """Each out-of-bounds value is a protocol error (1002) whose short reason names the field
    and echoes none of a long input."""
    err = refused(msg)
    assert err.code == m.CLOSE_PROTOCOL_ERROR
    assert field in err.reason and len(err.reason) < 120


def test_too_many_sources_is_refused():
    """A transfer report listing more sources than MAX_SOURCES is refused (or the decoder's
    array cap refuses it first: either way a protocol error)."""
    sources = [m.SourceRate(f"p{i}", 1, 1.0) for i in range(b.MAX_SOURCES + 1)]
    assert refused(m.TransferReport(1, None, 1.0, 0, 0, sources)).code == m.CLOSE_PROTOCOL_ERROR


# --- any value: in bounds, or refused ---------------------------------------------------------

TEMPLATES = [msg for msg in HONEST if dataclasses.fields(msg)]


def wild(typ) -> st.SearchStrategy:
    """Any value of a field's wire type, the nasty ones included (NaN, inf, huge, odd text)."""
    if typ is int:
        return st.one_of(st.integers(-(2**63), 2**64 - 1), st.integers(-3, 70))
    if typ is float:
        return st.one_of(st.floats(), st.floats(0, 2000))
    if typ is str:
        return st.one_of(st.text(max_size=300), st.sampled_from(
            ["transformers", "relay", "stop", "length", "corrupt", "stall", "http://h:1", ""]))
    if typ is bytes:
        return st.one_of(st.binary(max_size=80), st.binary(min_size=32, max_size=32))
    origin = typing.get_origin(typ)
    if origin is not None and type(None) in typing.get_args(typ):
        (inner,) = [t for t in typing.get_args(typ) if t is not type(None)]
        return st.none() | wild(inner)
    if origin is list:  # two items often: the G of `ready_hub`'s welcome
        inner = wild(typing.get_args(typ)[0])
        return st.lists(inner, max_size=3) | st.lists(inner, min_size=2, max_size=2)
    if typ is m.Sample:  # packed arrays of any floats, a shape the session accepts or not
        return st.builds(lambda n, lps, reward, fin: m.Sample(m.pack_ids([1] * n), m.pack_logprobs(
                         (lps * n)[:n]), "t", reward, fin), st.integers(0, 5),
                         st.lists(st.floats(width=32), min_size=1, max_size=5), wild(float),
                         st.sampled_from(["stop", "length", "x"]))
    hints = typing.get_type_hints(typ)
    return st.builds(typ, **{f.name: wild(hints[f.name]) for f in dataclasses.fields(typ)})


@st.composite
def mutated(draw) -> m.Message:
    """An honest message with one to three of its fields (or a sample's fields) replaced by
    wild values, so that every check sees values on both sides of its bound."""
    msg = draw(st.sampled_from(TEMPLATES))
    if isinstance(msg, m.RolloutSubmission) and draw(st.booleans()):
        s = draw(wild(m.Sample))
        return dataclasses.replace(msg, samples=[msg.samples[0], s])
    hints = typing.get_type_hints(type(msg))
    names = draw(st.lists(st.sampled_from([f.name for f in dataclasses.fields(msg)]),
                          min_size=1, max_size=3, unique=True))
    return dataclasses.replace(msg, **{n: draw(wild(hints[n])) for n in names})


def in_bounds(msg: m.Message) -> bool:
    """What was taken holds no non-finite or negative number anywhere (a claimed reward: no
    number past +-MAX_REWARD), and any price is within MAX_PRICE_PER_HOUR: an independent
    sweep over every field, not the checks' code."""

    def ok(value) -> bool:
        if isinstance(value, bool):
            return True
        if isinstance(value, (int, float)):
            return math.isfinite(value) and (value >= 0 or value == -1)  # -1: "index unknown"
        if dataclasses.is_dataclass(value):
            return all(ok(getattr(value, f.name)) for f in dataclasses.fields(value))
        if isinstance(value, list):
            return all(ok(v) for v in value)
        return True

    if isinstance(msg, m.Goodbye):
        return 1000 <= msg.code <= 4999
    if isinstance(msg, m.Hello) and not msg.price_per_hour <= b.MAX_PRICE_PER_HOUR:
        return False
    if isinstance(msg, m.RolloutSubmission):  # a claimed reward may be negative (a penalty)
        samples = [dataclasses.replace(s, reward=0.0) for s in msg.samples]
        return (ok(dataclasses.replace(msg, samples=samples))
                and all(abs(s.reward) <= b.MAX_REWARD for s in msg.samples)
                and all(all(math.isfinite(x) and x <= b.MAX_LOGPROB
                            for x in m.unpack_logprobs(s.logprobs)) for s in msg.samples))
    return ok(msg)


@settings(max_examples=300, deadline=None)
@given(msg=mutated())
def test_any_value_is_taken_in_bounds_or_refused(msg):
    """Whatever the values, the hub session takes the message with every number finite and in
    range, or refuses it with a protocol error and a short reason; nothing else."""
    session = Session(Side.HUB, 0.0) if isinstance(msg, m.Hello) else ready_hub()
    try:
        got = session.receive(m.encode(msg), 1.0)
    except RemoteProtocolError as exc:
        assert exc.code == m.CLOSE_PROTOCOL_ERROR and 0 < len(exc.reason) < 120
    else:
        assert in_bounds(got), got


# --- live ---------------------------------------------------------------------------------------


async def test_nan_price_is_refused_at_the_wire_and_never_joins():
    """A hello with price NaN (sent as raw msgpack) is closed with 1002 naming the field; the
    pool never sees it and planning still works."""
    frame = msgpack.packb({**m.to_wire(HONEST_HELLO), "p": m.BASE_PROTOCOL, "t": "hello",
                           "price_per_hour": math.nan}, use_bin_type=True)
    async with tracker(activation="cost") as (hub, _, url, _records):
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            await ws.send_bytes(frame)
            while (msg := await ws.receive()).type is aiohttp.WSMsgType.BINARY:
                pass  # the goodbye
            assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == m.CLOSE_PROTOCOL_ERROR
            assert "hello.price_per_hour" in msg.extra
        stats = hub.statistics()  # no account left in the pool, active or on standby
        assert stats.cost["pool/active"] + stats.cost["pool/standby"] == 0
        assert stats.closed_for_protocol == 1
        hub.feed(Replanned(1.0))


@pytest.mark.parametrize("overrides, field", [
    ({"price_per_hour": math.nan}, "price_per_hour"), ({"price_per_hour": 1e6}, "price_per_hour"),
    ({"name": "n" * 200}, "name"), ({"device": "cuda\n0"}, "device"),
    ({"advertise": "http://203.0.113.7"}, "advertise"), ({"token": "t" * 300}, "token"),
])
def test_the_peer_refuses_at_start_what_the_hub_would_refuse(overrides, field):
    """A peer config whose hello the hub would close for fails at start, naming the flag, instead
    of reconnecting to the same refusal forever."""
    from echo2p2p.errors import ConfigError
    from echo2p2p.peer.config import PeerConfig

    with pytest.raises(ConfigError) as info:
        PeerConfig(**overrides)
    assert info.value.field == field


def test_logprob_close_reason_names_the_bound_it_checks():
    """A logprob a hair above 0 passes (float32 rounding of a near-certain token lands there);
    one past the bound is refused with a reason that names the bound checked, 1e-3, not 0."""
    hair = dataclasses.replace(sample(), logprobs=lp([-1, 0.0009, -1]))
    past = dataclasses.replace(sample(), logprobs=lp([-1, 0.002, -1]))
    assert ready_hub().receive(m.encode(dataclasses.replace(R, samples=[sample(), hair])), 1.0)
    err = refused(dataclasses.replace(R, samples=[sample(), past]))
    assert f"<= {b.MAX_LOGPROB:g}" in err.reason and b.MAX_LOGPROB == 1e-3
