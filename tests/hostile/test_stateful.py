"""Any sequence of well-formed messages, with any field values, never gets past the hub's one
per-connection boundary.

A real hub (the `tracker` rig, two versions published, one honest bystander peer joined) runs
on 127.0.0.1 in a thread with its own event loop for the whole module. Each Hypothesis example
says hello (honest half the time, else with a few fields of any value), the hub publishes a
version it is expected to fetch, and it sends a list of frames: real message types (mostly
peer -> hub, some the wrong way), each field of its wire type, values drawn from anything the
type allows (NaN, infinities, 2**64 - 1, negative versions, unknown lease and peer ids, long or
control-character strings, ragged packed arrays), some naming live versions, leases and peers,
packed with `msgpack.packb` directly so that nothing on our send side filters them. Whatever the hub makes of them (takes, rejects, closes
with a code), it must never fall back on `handle_ws`'s `except Exception` ("internal error
serving", close code 1011), log any other error, or leave a task exception unretrieved; after
each example the hub publishes a version and re-plans its active peers (what the learner loop
does next, where a poisoned rate or price would raise), and a fresh honest peer is welcomed.

Random bytes are `tests/echo2p2p/test_fuzz.py`'s; this drives the hub's logic past the decoder.
`pytest --slow` runs 500 examples instead of 60.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
import typing

import aiohttp
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo2p2p import messages as m
from echo2p2p import signing

from tests.blob_versions import blob_version
from tests.conftest import tracker, until
from echo2p2p.hub.core.events import Replanned, VersionPublished

QUICK, SLOW = 60, 500
GUARD_S = 60.0  # an example that hangs fails here; this is not what the test asserts
PEER_KEY = signing.public_key(signing.new_private_key())


def hello_frame(name: str) -> bytes:
    return pack(m.Hello(name, "transformers", "cpu", 0.0, None, "", os.urandom(32), PEER_KEY))


def pack(msg) -> bytes:
    """A frame for `msg`, whatever its values: no check on the way out."""
    return msgpack.packb({"p": m.BASE_PROTOCOL, "t": msg.TYPE, **m.to_wire(msg)},
                         use_bin_type=True)


# --- the hub, in a thread of its own ------------------------------------------------------------


class Trouble(logging.Handler):
    """Every ERROR record from any logger: the boundary's "internal error serving", aiohttp's
    "Error handling request", asyncio's "Task exception was never retrieved"."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}"
                            + (f" [{record.exc_info[1]!r}]" if record.exc_info else ""))


class LiveHub:
    """A tracker hub serving on its own event loop thread; `run(coro)` runs a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_exception)
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.stray: list[str] = []  # exceptions nobody retrieved, from the loop's handler
        self.bystander_left: tuple | None = None  # how its connection ended, if it did
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _loop_exception(self, loop, context) -> None:
        self.stray.append(str(context.get("exception") or context.get("message")))

    def _main(self) -> None:
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # seen by the test, which fails on it
            self.failed = exc
            self.ready.set()

    async def _serve(self) -> None:
        self.stop = asyncio.Event()
        # The bystander only listens: a long peer timeout keeps it joined however long we run.
        # Every example joins twice from 127.0.0.1 with one key: no join limits (test_churn's).
        async with tracker(peer_timeout_s=3600.0, joins_per_min=0, joins_per_min_per_key=0
                           ) as (hub, key, url, _records):
            self.hub, self.url, self.key = hub, url, key
            hub.feed(VersionPublished(blob_version(key, 0, os.urandom(40 << 10), chunk_bytes=16 << 10)))
            v0 = os.urandom(40 << 10)
            hub.feed(VersionPublished(blob_version(key, 1, v0, base=(0, os.urandom(40 << 10)),
                                     chunk_bytes=16 << 10)))
            async with aiohttp.ClientSession() as http, http.ws_connect(url) as bystander:
                await bystander.send_bytes(hello_frame("bystander"))
                welcome = m.decode((await bystander.receive()).data)
                self.bystander_id = welcome.peer_id
                reader = asyncio.ensure_future(self._drain(bystander))
                self.ready.set()
                await self.stop.wait()
                reader.cancel()

    async def _drain(self, ws) -> None:
        while (frame := await ws.receive()).type is aiohttp.WSMsgType.BINARY:
            pass
        self.bystander_left = (frame.type, frame.data, frame.extra)  # the test fails on it

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(GUARD_S)

    def close(self) -> None:
        if self.ready.is_set() and self.failed is None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(GUARD_S)


@pytest.fixture(scope="module")
def live():
    trouble = Trouble()
    logging.getLogger().addHandler(trouble)
    hub = LiveHub()
    hub.thread.start()
    assert hub.ready.wait(GUARD_S) and hub.failed is None, hub.failed
    hub.trouble = trouble
    try:
        yield hub
    finally:
        hub.close()
        logging.getLogger().removeHandler(trouble)


# --- what the attacker sends -------------------------------------------------------------------

# Placeholders, swapped for live values as each frame goes out, so that reports name versions
# the hub keeps, leases it granted us and peers that are connected (the hub's state moves on
# from one example to the next, so the strategy cannot name them itself).
NOW, PREV = -(2**62) - 1, -(2**62) - 2  # the newest published version, the one before
SELF, BYSTANDER, LEASE = "<self>", "<bystander>", "<lease>"  # our id, the bystander's, our lease

NASTY_INTS = [-1, 0, 1, 2, 3, 7, 64, 2**31 - 1, 2**31, 2**32, 2**48 + 1, 2**53 + 1, 2**63 - 1,
              2**64 - 1, -(2**31), -(2**63)]
NASTY_FLOATS = [math.nan, math.inf, -math.inf, 5e-324, -0.0, 0.0, 1e-300, 1.0, 1e308, -1e308,
                86_400.0, 1e9]
IDS = [SELF, BYSTANDER, LEASE, "p1", "p2", "p9", "hub", "L1", "L2", ""]


def strings() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(IDS + list(m.RELAY_FAULTS) + list(m.FINISH_REASONS) + list(m.ENGINES)),
        st.text(max_size=30), st.text(alphabet="\n\r\x00\x1b\u2028 ", max_size=8),
        st.integers(200, 5000).map(lambda n: "x" * n),
        st.sampled_from(["http://127.0.0.1:9", "http://h:1/anything?x=/chunk/1/full/0&wait=5"]))


def packed(width: int, fmt: str) -> st.SearchStrategy[bytes]:
    """Packed arrays of any length (a multiple of `width` or not), of any values."""
    values = st.integers(0, 2**32 - 1) if fmt == "I" else st.floats(width=32)
    whole = st.lists(values, max_size=10).map(
        lambda xs: m.pack_ids(xs) if fmt == "I" else m.pack_logprobs(xs))
    return st.one_of(whole, st.binary(max_size=41))


def value(typ, where: str = "") -> st.SearchStrategy:
    """Any value of a field's wire type."""
    if typ is bool:
        return st.booleans()
    if typ is int:
        return st.one_of(st.sampled_from([NOW, PREV]), st.sampled_from(NASTY_INTS),
                         st.integers(-(2**63), 2**64 - 1), st.integers(-2, 12))
    if typ is float:
        return st.one_of(st.sampled_from(NASTY_FLOATS), st.floats(), st.floats(0, 1))
    if typ is str:
        return strings()
    if typ is bytes:
        if where == "token_ids":
            return packed(4, "I")
        if where == "logprobs":
            return packed(4, "f")
        return st.one_of(st.binary(max_size=70), st.binary(min_size=32, max_size=32))
    origin = typing.get_origin(typ)
    if origin is not None and type(None) in typing.get_args(typ):
        (inner,) = [t for t in typing.get_args(typ) if t is not type(None)]
        return st.none() | value(inner, where)
    if origin is list:
        inner = value(typing.get_args(typ)[0])
        return st.one_of(st.lists(inner, max_size=3), st.lists(inner, min_size=8, max_size=8))
    if dataclasses.is_dataclass(typ):
        hints = typing.get_type_hints(typ)
        return st.builds(typ, **{f.name: value(hints[f.name], f.name)
                                 for f in dataclasses.fields(typ)})
    raise AssertionError(f"no strategy for {typ!r}")


PEER_TO_HUB = [m.Heartbeat, m.LeaseRequest, m.RolloutSubmission, m.VersionHeld, m.TransferReport,
               m.RelayReport, m.Goodbye, m.Hello]
HUB_TO_PEER = [t for t in m.MESSAGE_TYPES.values() if t not in PEER_TO_HUB]
HONEST_HELLO = m.Hello("attacker", "transformers", "cpu", 0.0, None, "", b"n" * 32, PEER_KEY)


@st.composite
def join_hello(draw) -> m.Hello:
    """Half the time an honest hello; else one with up to three fields of any value."""
    if draw(st.booleans()):
        return HONEST_HELLO
    hints = typing.get_type_hints(m.Hello)
    names = draw(st.lists(st.sampled_from([f.name for f in dataclasses.fields(m.Hello)]),
                          min_size=1, max_size=3, unique=True))
    return dataclasses.replace(HONEST_HELLO, **{n: draw(value(hints[n], n)) for n in names})


messages = st.lists(st.one_of(
    st.sampled_from(PEER_TO_HUB).flatmap(value),
    st.sampled_from([m.LeaseRequest(4), m.Heartbeat(), m.VersionHeld(NOW)]),  # honest moves too
    st.sampled_from(HUB_TO_PEER).flatmap(value),
), max_size=12)


def live_frame(msg, now: dict) -> bytes:
    """`msg` packed with its placeholders swapped for the live values in `now`."""

    def swap(v):
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        if type(v) in (int, str) and v in now:
            return now[v]
        return v

    return msgpack.packb(swap({"p": m.BASE_PROTOCOL, "t": msg.TYPE, **m.to_wire(msg)}),
                         use_bin_type=True)


# --- the property ------------------------------------------------------------------------------


async def attack(live: LiveHub, hello: m.Hello, sequence: list) -> int | None:
    """Join with `hello`, have the hub publish (so that we are expected to report on it), send
    `sequence`, close; wait until the hub has let us go. The close code we got (the hub's, if
    it closed first)."""
    hub = live.hub
    leases: list[str] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(live.url, max_msg_size=0) as ws:
        await ws.send_bytes(pack(hello))
        first = await ws.receive()
        if first.type is not aiohttp.WSMsgType.BINARY or not isinstance(
                welcome := m.decode(first.data), m.Welcome):
            await ws.close()
            return ws.close_code  # refused at the door: fine, if it said why
        hub.feed(VersionPublished(blob_version(live.key, max(hub.statistics().published) + 1, os.urandom(40 << 10),
                                 chunk_bytes=16 << 10)))

        async def read() -> None:  # keeps the hub's writes flowing; notes the leases we get
            while (frame := await ws.receive()).type is aiohttp.WSMsgType.BINARY:
                if isinstance(msg := m.decode(frame.data), m.LeaseGrant):
                    leases.append(msg.lease_id)

        reader = asyncio.ensure_future(read())
        for msg in sequence:
            now = {NOW: max(hub.statistics().published), PREV: max(hub.statistics().published) - 1, SELF: welcome.peer_id,
                   BYSTANDER: live.bystander_id, LEASE: leases[-1] if leases else "L0"}
            try:
                await ws.send_bytes(live_frame(msg, now))
            except (ConnectionError, aiohttp.ClientError):
                break  # the hub closed us: fine, if it said why (checked by the caller)
            await asyncio.sleep(0)  # a yield to the reader (so LEASE can name a grant), not a wait
        await ws.close()
        await reader
        code = ws.close_code
    await until(hub, lambda: welcome.peer_id not in hub.peer_views())  # its handler has finished
    return code


async def honest_join(live: LiveHub) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(live.url) as ws:
        await ws.send_bytes(hello_frame("honest"))
        assert isinstance(m.decode((await ws.receive()).data), m.Welcome)


async def plan_on(live: LiveHub) -> None:
    """What the learner loop does next: publish a version (planning its broadcast over the
    upload rates peers reported) and re-choose the active peers (over their prices and
    rates). State poisoned by a report would raise here, outside any connection."""
    hub = live.hub
    version = max(hub.statistics().published) + 1
    hub.feed(VersionPublished(blob_version(live.key, version, os.urandom(40 << 10), chunk_bytes=16 << 10)))
    hub.feed(Replanned(1.0))


async def peer_ids(live: LiveHub) -> list[str]:
    """The hub's connected peers, read on its own loop (its views are taken at the loop's time)."""
    return list(live.hub.peer_views())


def check(live: LiveHub, hello: m.Hello, sequence: list) -> None:
    assert live.failed is None, live.failed
    live.trouble.records.clear()  # each example answers for its own errors only
    live.stray.clear()
    code = live.run(attack(live, hello, sequence))
    live.run(plan_on(live))
    live.run(honest_join(live))
    assert code != 1011, f"closed with 1011; hub errors: {live.trouble.records}"
    assert not live.trouble.records, live.trouble.records
    assert not live.stray, live.stray
    assert live.thread.is_alive()
    assert live.bystander_id in live.run(peer_ids(live)), f"the bystander left: {live.bystander_left}"


def examples(n: int):
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


@examples(QUICK)
@given(hello=join_hello(), sequence=messages)
def test_well_formed_messages_never_break_the_hub(live, hello, sequence):
    """Any sequence of well-formed messages with any values leaves the hub without an error
    outside its per-connection boundary, the bystander connected, and a new peer welcomed."""
    check(live, hello, sequence)


@pytest.mark.slow
@examples(SLOW)
@given(hello=join_hello(), sequence=messages)
def test_well_formed_messages_never_break_the_hub_slow(live, hello, sequence):
    """The same, at 500 examples."""
    check(live, hello, sequence)
