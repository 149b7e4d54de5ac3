"""The peer's sans-IO connection protocol: handshake checks, events, plan matching, adoption.

Driven synchronously with explicit `now`, against a real hub-side `Session` (the frames are the
ones a hub sends), with hand-written legal and illegal sequences and a Hypothesis walk checked
against a model written here, not against the protocol's own state.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
from hypothesis import given, strategies as st

from echo2p2p import messages as m
from echo2p2p import peer_protocol as pp
from echo2p2p import signing
from echo2p2p.errors import JoinRefused, RemoteProtocolError, SnapshotError
from echo2p2p.session import Session, Side
from echo2p2p.snapshot import build_snapshot

HUB_KEY = signing.new_private_key()
PEER_KEY = signing.public_key(signing.new_private_key())
NONCE = b"\7" * 32
HELLO = m.Hello("p", "transformers", "cpu", 0.0, None, "", NONCE, PEER_KEY)


def welcome(key: bytes | None = HUB_KEY, *, run_id="run", model="tiny", version=0,
            nonce=NONCE) -> m.Welcome:
    w = m.Welcome("p1", run_id, model, "addition", version, 1, 2, 1.0, 1.0, 4, 0)
    if key is None:
        return w
    return replace(w, hub_key=signing.public_key(key),
                   proof=signing.sign_welcome(key, nonce, run_id, "p1", PEER_KEY))


def pair(w: m.Welcome | None = None, pinned: bytes | None = None):
    """(peer protocol, hub session) after a completed handshake."""
    peer = pp.PeerProtocol(0.0, hub_url="ws://hub", peer_key=PEER_KEY, nonce=NONCE,
                           pinned_hub_key=pinned)
    hub = Session(Side.HUB, 0.0)
    hub.receive(peer.hello(HELLO), 0.0)
    assert peer.receive_welcome(hub.send(w or welcome()), 0.0) == (w or welcome())
    return peer, hub


@functools.lru_cache
def manifest(version: int, base: int | None = None) -> m.Manifest:
    man, _ = build_snapshot(version, [("w", "float32", [4], bytes(range(16)))], chunk_bytes=8)
    return replace(man, base_version=base)


def plan(version: int, base: int | None = None, revision: int = 1) -> m.RelayPlan:
    return m.RelayPlan(version, base, revision, [], b"\xff" * 8)


@functools.lru_cache
def announce(version: int, base: int | None = None, *, signed=True, plan_for=None):
    man = manifest(version, base)
    sig = signing.sign_manifest(HUB_KEY, man) if signed else b"\0" * 64
    return m.VersionAnnouncement(man, plan(*(plan_for or (version, base))), sig)


def test_handshake_with_a_signed_welcome_is_adopted():
    """A welcome whose proof signs our nonce with its key, pinned to that key, is accepted."""
    peer, _ = pair(pinned=signing.public_key(HUB_KEY))
    assert peer.welcome == welcome()


@pytest.mark.parametrize("w,pinned,match", [
    (welcome(), signing.public_key(signing.new_private_key()), "pinned"),
    (replace(welcome(), proof=b""), None, "cannot prove"),
    (welcome(nonce=b"\1" * 32), None, "cannot prove"),
    (welcome(key=None), signing.public_key(HUB_KEY), "pinned"),
])
def test_handshake_refuses_an_unproven_or_unpinned_hub(w, pinned, match):
    """Another key than the pinned one, or no valid proof over our nonce: refused."""
    peer = pp.PeerProtocol(0.0, hub_url="ws://hub", peer_key=PEER_KEY, nonce=NONCE,
                           pinned_hub_key=pinned)
    hub = Session(Side.HUB, 0.0)
    hub.receive(peer.hello(HELLO), 0.0)
    with pytest.raises(RemoteProtocolError, match=match):
        peer.receive_welcome(hub.send(w), 0.0)
    assert peer.welcome is None


def test_an_unsigned_hub_is_taken_when_nothing_is_pinned():
    """A hub without a key (no manifests signed) is welcomed by an unpinned peer."""
    peer, _ = pair(welcome(key=None))
    assert peer.welcome.hub_key == b""


@pytest.mark.parametrize("code,error", [(m.CLOSE_UNAUTHORIZED, JoinRefused),
                                        (m.CLOSE_PROTOCOL_ERROR, RemoteProtocolError)])
def test_a_goodbye_instead_of_a_welcome(code, error):
    """Refused for the join token: JoinRefused (do not retry); otherwise a protocol error."""
    peer = pp.PeerProtocol(0.0, hub_url="ws://hub", peer_key=PEER_KEY, nonce=NONCE)
    hub = Session(Side.HUB, 0.0)
    hub.receive(peer.hello(HELLO), 0.0)
    with pytest.raises(error):
        peer.receive_welcome(hub.send(m.Goodbye(code, "no")), 0.0)


def test_nothing_but_a_welcome_or_goodbye_before_welcome():
    """A lease (or any hub message) before the welcome is a protocol error."""
    peer = pp.PeerProtocol(0.0, hub_url="ws://hub", peer_key=PEER_KEY, nonce=NONCE)
    peer.hello(HELLO)
    grant = m.LeaseGrant("L1", "q", "1+1", [1, 2], "2", 2, 30.0, 0)
    with pytest.raises(RemoteProtocolError):
        peer.receive_welcome(m.encode(grant), 0.0)


def test_a_hello_carries_the_protocol_nonce_and_key():
    """A hello with another nonce would make the proof check meaningless: refused locally."""
    peer = pp.PeerProtocol(0.0, hub_url="ws://hub", peer_key=PEER_KEY, nonce=NONCE)
    with pytest.raises(ValueError):
        peer.hello(replace(HELLO, nonce=b"\2" * 32))


def test_messages_become_events():
    """Leases (with their deadline on our clock), acks, rejects, heartbeats, goodbyes."""
    peer, hub = pair()
    grant = m.LeaseGrant("L1", "q", "1+1", [1, 2], "2", 2, 30.0, 0)
    assert peer.receive(hub.send(grant), 5.0) == pp.LeaseGranted(grant, 35.0)
    assert peer.receive(hub.send(m.Ack("L1")), 6.0) == pp.RolloutAcked("L1")
    assert peer.receive(hub.send(m.Reject("L2", "stale")), 6.0) == pp.RolloutRejected("L2", "stale")
    assert peer.receive(hub.send(m.Heartbeat()), 7.0) is None
    assert peer.receive(hub.send(m.Goodbye(m.CLOSE_NORMAL, "bye")), 8.0) == \
        pp.HubLeft(m.CLOSE_NORMAL, "bye")


def test_a_goodbye_for_the_token_raises_join_refused():
    """Sent away for the join token while connected: JoinRefused."""
    peer, hub = pair()
    with pytest.raises(JoinRefused):
        peer.receive(hub.send(m.Goodbye(m.CLOSE_UNAUTHORIZED, "token revoked")), 1.0)


def test_announcements_must_be_signed_and_carry_their_own_plan():
    """An unsigned manifest raises SnapshotError; a plan for another version is a protocol
    error; a valid announcement is a version to fetch."""
    peer, hub = pair()
    with pytest.raises(SnapshotError):
        peer.receive(hub.send(announce(1, signed=False)), 1.0)
    with pytest.raises(RemoteProtocolError, match="another's relay plan"):
        peer.receive(hub.send(announce(1, plan_for=(2, None))), 1.0)
    with pytest.raises(RemoteProtocolError, match="another's relay plan"):
        peer.receive(hub.send(announce(2, 1, plan_for=(2, None))), 1.0)
    event = peer.receive(hub.send(announce(1)), 1.0)
    assert event == pp.VersionAnnounced(manifest(1), plan(1))


def test_an_unsigned_hub_announces_unsigned_manifests():
    """No hub key: no signature to check."""
    peer, hub = pair(welcome(key=None))
    assert isinstance(peer.receive(hub.send(announce(1, signed=False)), 1.0), pp.VersionAnnounced)


def test_only_a_newer_announcement_replaces_the_download_under_way():
    """Downloading v3: v2 and v3 again are ignored, v4 replaces it."""
    peer, hub = pair()
    peer.download_started(manifest(3))
    assert peer.receive(hub.send(announce(2)), 1.0) is None
    assert peer.receive(hub.send(announce(3)), 1.0) is None
    assert isinstance(peer.receive(hub.send(announce(4, 3)), 1.0), pp.VersionAnnounced)
    assert peer.downloading is None  # the shell drops v3, then starts v4
    peer.download_started(manifest(4, 3))
    assert peer.downloading == (4, 3)


def test_later_plans_follow_the_download_under_way_only():
    """A RelayPlan is a revision for the download under way, matched by (version, base);
    one for anything else, or once that download ended, is dropped."""
    peer, hub = pair()
    assert peer.receive(hub.send(plan(3, None, 2)), 1.0) is None  # nothing under way
    peer.download_started(manifest(3))
    assert peer.receive(hub.send(plan(3, None, 2)), 1.0) == pp.PlanRevised(plan(3, None, 2))
    assert peer.receive(hub.send(plan(3, 2, 2)), 1.0) is None  # the delta against v2
    assert peer.receive(hub.send(plan(4, None, 2)), 1.0) is None
    peer.download_ended(manifest(2))  # not the one under way: changes nothing
    assert peer.downloading == (3, None)
    peer.download_ended(manifest(3))
    assert peer.receive(hub.send(plan(3, None, 3)), 1.0) is None


@pytest.mark.parametrize("previous,new,held,has_engine,relay,expected", [
    (None, welcome(), None, False, False, pp.Adoption("tiny", False, False)),
    (None, welcome(), None, False, True, pp.Adoption(None, False, False)),
    (None, welcome(), None, True, False, pp.Adoption(None, False, False)),
    (welcome(), welcome(version=5), 3, True, False, pp.Adoption(None, False, False)),
    (welcome(), welcome(version=2), 3, True, False, pp.Adoption(None, False, True)),
    (welcome(), welcome(version=3), 3, True, False, pp.Adoption(None, False, False)),
    (welcome(), welcome(version=2), None, True, False, pp.Adoption(None, False, False)),
    (welcome(), welcome(run_id="other", version=0), 3, True, False,
     pp.Adoption(None, True, False)),
    (welcome(), welcome(model="big", version=0), 3, True, False,
     pp.Adoption("big", False, False)),  # a new engine holds nothing: it cannot be behind
    (welcome(), welcome(model="big", version=0), 3, False, True,
     pp.Adoption(None, False, True)),  # a relay builds nothing and keeps its version
    (welcome(), welcome(model="big", run_id="other"), 3, True, False,
     pp.Adoption("big", True, False)),
])
def test_adoption_decisions(previous, new, held, has_engine, relay, expected):
    """What a welcome changes: build an engine, forget another run, drop what the hub is behind."""
    assert pp.adoption(previous, new, held_version=held, has_engine=has_engine,
                       relay=relay) == expected


STEPS = st.lists(st.one_of(
    st.tuples(st.just("announce"), st.integers(0, 6)),
    st.tuples(st.just("plan"), st.integers(0, 6)),
    st.tuples(st.just("start"), st.integers(0, 6)),
    st.tuples(st.just("end"), st.integers(0, 6)),
), max_size=30)


@given(STEPS)
def test_walk_plans_and_announcements(steps):
    """Any order of announcements, plans and downloads starting and ending: an announcement
    is a version to fetch exactly when no download of it or a newer one is under way, and a
    plan is a revision exactly when its version is the one under way (a model kept here)."""
    peer, hub = pair()
    under_way: int | None = None
    for what, version in steps:
        if what == "announce":
            event = peer.receive(hub.send(announce(version)), 1.0)
            fresh = under_way is None or version > under_way
            assert isinstance(event, pp.VersionAnnounced) == fresh
            if fresh:
                under_way = None
        elif what == "plan":
            event = peer.receive(hub.send(plan(version, None, 2)), 1.0)
            assert isinstance(event, pp.PlanRevised) == (version == under_way)
        elif what == "start":
            peer.download_started(manifest(version))
            under_way = version
        else:
            peer.download_ended(manifest(version))
            if version == under_way:
                under_way = None
