"""Protocol negotiation, sans-IO: `echo2p2p.negotiation` on its own, then the hub's and the
peer's protocol objects connected through frames (h11 style), each side's frames read back as
bytes: the hello framed 2, the welcome and everything after it with the version agreed."""

from __future__ import annotations

import msgpack
import pytest

from echo2p2p import messages as m
from echo2p2p.errors import JoinRefused, RemoteProtocolError, UnsupportedProtocol
from echo2p2p.hub_protocol import HelloReceived, HubProtocol
from echo2p2p.negotiation import (FEATURES, LEAF_NOTICE, SPEAKS, Agreed, Speaks, read_header,
                                  refusal)
from echo2p2p.peer_protocol import PeerProtocol
from echo2p2p.seed_watch import is_leaf, relay_url

NONCE, KEY = bytes(range(16)), bytes(32)
HELLO = m.Hello("n", "transformers", "cpu", nonce=NONCE, peer_key=KEY)
SENTENCE_1 = "this hub speaks protocol 3; this peer speaks 1: upgrade with pip install -U echo2p2p"


def p_of(frame: bytes) -> int:
    return msgpack.unpackb(frame)["p"]


def raw(fields: dict) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def welcome(protocol: int = 2, features: tuple[str, ...] = (), leaf: bool = False) -> m.Welcome:
    return m.Welcome("p1", "run", "tiny", "add", 0, 1, 2, 1.0, 1.0, 8, 0,
                     protocol=protocol, features=list(features), leaf=leaf)


def test_this_release_speaks_2_and_3_with_the_leaf_notice():
    assert m.PROTOCOL_VERSION == 3 and m.SUPPORTED_PROTOCOLS == (2, 3)
    assert SPEAKS.newest == m.PROTOCOL_VERSION and LEAF_NOTICE in FEATURES


@pytest.mark.parametrize("theirs, agreed", [(2, 2), (3, 3), (4, 3), (1000, 3)])
def test_the_answer_is_the_lower_newest_version(theirs, agreed):
    """Min of the two newest versions; the features both speak, unknown ones ignored."""
    got = SPEAKS.answer(theirs, ["zstd-dict", LEAF_NOTICE, "x"])
    assert got == Agreed(agreed, (LEAF_NOTICE,))
    assert SPEAKS.answer(theirs, []).features == ()


@pytest.mark.parametrize("theirs", [0, 1])
def test_an_opener_older_than_our_oldest_is_refused_with_the_sentence(theirs):
    with pytest.raises(RemoteProtocolError) as info:
        SPEAKS.answer(theirs, [LEAF_NOTICE])
    assert info.value.code == m.CLOSE_BAD_PROTOCOL_VERSION == 4000
    assert info.value.reason == refusal(3, theirs)
    assert len(info.value.reason.encode()) <= 120  # it fits a close frame's reason whole


def test_a_future_hub_refuses_this_release_naming_both_versions():
    with pytest.raises(RemoteProtocolError) as info:
        Speaks((4,)).answer(3, [])
    assert info.value.reason == ("this hub speaks protocol 4; this peer speaks 3: "
                                 "upgrade with pip install -U echo2p2p")


def test_an_answer_is_checked_against_what_we_speak():
    assert SPEAKS.check(2, []) == Agreed(2)
    assert SPEAKS.check(3, [LEAF_NOTICE, "later"]) == Agreed(3, (LEAF_NOTICE,))
    assert SPEAKS.check(4, []) is None and SPEAKS.check(1, []) is None


@pytest.mark.parametrize("protocol, features, expected", [
    (None, None, (2, [])), (None, "leaf-notice", (2, [])), ("3", "", (3, [])),
    ("3", " a, b ,,", (3, ["a", "b"])), ("3", None, (3, [])),
    ("x", "", None), ("-1", "", None), ("3.0", "", None), ("", "", None), ("999999", "", None),
])
def test_upgrade_headers_read(protocol, features, expected):
    """No header: an older release, 2 and no features; anything but a short number: refused."""
    assert read_header(protocol, features) == expected


# --- the hub's end ---------------------------------------------------------------------------


def hub_reads(frame: bytes, speaks: Speaks = SPEAKS) -> HubProtocol:
    hub = HubProtocol(0.0, 1 << 20, speaks=speaks)
    assert isinstance(hub.receive_frame(frame, 0.0), HelloReceived)
    return hub


def test_an_old_peers_hello_is_served_in_protocol_2():
    """A hello with no `protocol` (protocol 2's): the welcome and everything after it carry
    "p": 2, and a frame of 3 from that peer closes 4000."""
    hub = hub_reads(raw({"p": 2, "t": "hello", "name": "old", "engine": "relay", "device": "cpu"}))
    assert hub.agreed == Agreed(2)
    frame = hub.send(welcome(2))
    assert p_of(frame) == 2 and p_of(hub.send(m.Heartbeat())) == 2
    assert hub.receive_frame(m.encode(m.LeaseRequest(1), 2), 0.0) is not None
    with pytest.raises(UnsupportedProtocol) as info:
        hub.receive_frame(m.encode(m.LeaseRequest(1), 3), 0.0)
    assert info.value.code == 4000


def test_a_new_peers_hello_agrees_3_and_every_later_frame_carries_it():
    peer = PeerProtocol(0.0, hub_url="ws://h/ws", peer_key=KEY, nonce=NONCE)
    hello = peer.hello(HELLO)
    assert p_of(hello) == 2  # always: every hub since 2 reads it
    assert m.decode(hello).protocol == 3 and m.decode(hello).features == sorted(FEATURES)
    hub = hub_reads(hello)
    assert hub.agreed == Agreed(3, (LEAF_NOTICE,))
    with pytest.raises(Exception, match="welcome naming protocol 2"):
        hub.send(welcome(2))  # a bug: the welcome must name what the connection uses
    told = hub.send(welcome(3, (LEAF_NOTICE,), leaf=True))
    assert p_of(told) == 3
    got = peer.receive_welcome(told, 0.0)
    assert got.leaf and peer.agreed == Agreed(3, (LEAF_NOTICE,))
    assert p_of(peer.send(m.Heartbeat())) == 3 and p_of(hub.send(m.Heartbeat())) == 3
    with pytest.raises(UnsupportedProtocol):  # a frame of 2 on a connection of 3
        hub.receive_frame(m.encode(m.Heartbeat(), 2), 0.0)
    with pytest.raises(UnsupportedProtocol):
        peer.receive(m.encode(m.Heartbeat(), 2), 0.0)


@pytest.mark.parametrize("frame", [
    raw({"p": 1, "t": "hello", "name": "v1", "engine": "relay", "device": "cpu"}),  # protocol 1's
    m.encode(m.Hello("v1", "relay", "cpu", protocol=1)),  # framed 2, saying 1
], ids=["framed-1", "says-1"])
def test_a_protocol_1_hello_is_refused_with_the_sentence(frame):
    hub = HubProtocol(0.0, 1 << 20)
    with pytest.raises(RemoteProtocolError) as info:
        hub.receive_frame(frame, 0.0)
    assert (info.value.code, info.value.reason) == (4000, SENTENCE_1)
    assert p_of(hub.send(m.Goodbye(4000, info.value.reason))) == 2  # said in the base version


def test_a_hello_framed_with_another_version_than_2_is_not_read():
    """The hello's frame is always 2: one framed 3 is a protocol error (4000), not a hello."""
    hub = HubProtocol(0.0, 1 << 20)
    with pytest.raises(UnsupportedProtocol):
        hub.receive_frame(m.encode(HELLO, 3), 0.0)


# --- the peer's end --------------------------------------------------------------------------


def new_peer() -> PeerProtocol:
    peer = PeerProtocol(0.0, hub_url="ws://h/ws", peer_key=KEY, nonce=NONCE)
    peer.hello(HELLO)
    return peer


def test_a_welcome_without_protocol_is_an_old_hub_spoken_to_in_2():
    peer = new_peer()
    old = {k: v for k, v in m.to_wire(welcome()).items() if k not in ("protocol", "features", "leaf")}
    peer.receive_welcome(raw({"p": 2, "t": "welcome", **old}), 0.0)
    assert peer.agreed == Agreed(2)
    assert p_of(peer.send(m.LeaseRequest(1))) == 2


def test_the_hubs_refusal_ends_the_peer_with_its_sentence():
    """A goodbye 4000 before the welcome: JoinRefused carrying the hub's sentence as it is."""
    peer = new_peer()
    sentence = refusal(4, 3)
    with pytest.raises(JoinRefused) as info:
        peer.receive_welcome(m.encode(m.Goodbye(4000, sentence)), 0.0)
    assert str(info.value) == sentence


@pytest.mark.parametrize("version", [1, 4])
def test_a_welcome_in_a_version_the_peer_cannot_speak_ends_it(version):
    peer = new_peer()
    with pytest.raises(JoinRefused) as info:
        peer.receive_welcome(m.encode(welcome(version), version), 0.0)
    said = str(info.value)
    assert f"hub ws://h/ws speaks protocol {version}; this peer speaks 2 to 3" in said
    assert "pip install -U echo2p2p" in said


def test_a_welcome_framed_in_one_version_naming_another_is_refused():
    peer = new_peer()
    with pytest.raises(RemoteProtocolError) as info:
        peer.receive_welcome(m.encode(welcome(2), 3), 0.0)
    assert info.value.code == 4000


# --- who is a leaf ---------------------------------------------------------------------------


@pytest.mark.parametrize("url, probe, leaf, dealt", [
    (None, "unprobed", True, None), (None, "ok", True, None),
    ("http://a:1", "unprobed", False, None), ("http://a:1", "ok", False, "http://a:1"),
    ("http://a:1", "slow", False, None), ("http://a:1", "failed", True, None),
])
def test_a_leaf_is_never_dealt_and_the_welcome_reads_the_same_rule(url, probe, leaf, dealt):
    assert is_leaf(url, probe) is leaf
    assert relay_url(url, probe) == dealt
    assert relay_url(url, probe, relays=False) is None  # quarantined: pulls only
    assert not (leaf and dealt)
