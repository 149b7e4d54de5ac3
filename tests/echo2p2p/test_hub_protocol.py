"""The hub's per-peer protocol: frames in, events out, credits and versions kept per peer.

Hand-written legal and illegal sequences, with an explicit clock, and a Hypothesis walk whose
model of the events (`EXPECTED` below) is written here, not read from `echo2p2p.hub_protocol`.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.read_budget import ReadBudget

WELCOME = m.Welcome("p1", "run", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7)
HELLO = m.Hello("a", "transformers", "cpu")
SAMPLE = m.Sample(m.pack_ids([1, 2, 3]), m.pack_logprobs([-0.5] * 3), "12", 1.0, "stop")
ROLLOUT = m.RolloutSubmission("L0", 0, [SAMPLE, SAMPLE])
TRANSFER = m.TransferReport(0, None, 1.5, 4, 0, [m.SourceRate("p2", 4, 0.5)])
RELAY = m.RelayReport(0, "p2", "corrupt")
GOODBYE = m.Goodbye(1000, "bye")
MAX_FRAME = 1 << 20

# What each message from a welcomed peer must come back as (type, and the field it carries).
EXPECTED = {
    m.Heartbeat: (hp.HeartbeatReceived, None),
    m.LeaseRequest: (hp.CreditsAdded, None),
    m.RolloutSubmission: (hp.RolloutReceived, "submission"),
    m.VersionHeld: (hp.HoldingReported, None),
    m.TransferReport: (hp.TransferReported, "report"),
    m.RelayReport: (hp.RelayAccused, "report"),
}
AFTER_WELCOME = [m.Heartbeat(), m.LeaseRequest(2), ROLLOUT, m.VersionHeld(0), TRANSFER, RELAY]


def fresh(now: float = 0.0) -> hp.HubProtocol:
    return hp.HubProtocol(now, MAX_FRAME, ReadBudget(now, rate_bps=1e12, burst_bytes=1 << 40))


def welcomed(now: float = 0.0) -> hp.HubProtocol:
    proto = fresh(now)
    assert proto.receive_frame(m.encode(HELLO), now) == hp.HelloReceived(HELLO)
    assert proto.send(WELCOME) is not None
    assert proto.ready
    return proto


def code_of(proto: hp.HubProtocol, data, now: float = 1.0) -> int:
    with pytest.raises(RemoteProtocolError) as err:
        proto.receive_frame(data, now)
    return err.value.code


def test_hello_then_welcome_makes_a_ready_peer():
    """A Hello is reported as a fact; after the hub's Welcome the peer is ready."""
    proto = fresh()
    assert not proto.ready
    event = proto.receive_frame(m.encode(HELLO), 1.0)
    assert isinstance(event, hp.HelloReceived) and event.hello == HELLO
    proto.send(WELCOME)
    assert proto.ready and not proto.closed


@pytest.mark.parametrize("msg", AFTER_WELCOME, ids=lambda msg: type(msg).__name__)
def test_every_message_before_hello_is_a_protocol_error(msg):
    """A rollout (or anything else) before the Hello closes the connection."""
    assert code_of(fresh(), m.encode(msg)) == m.CLOSE_UNEXPECTED_MESSAGE


@pytest.mark.parametrize("msg", AFTER_WELCOME, ids=lambda msg: type(msg).__name__)
def test_every_message_between_hello_and_welcome_is_a_protocol_error(msg):
    proto = fresh()
    proto.receive_frame(m.encode(HELLO), 0.0)
    assert code_of(proto, m.encode(msg)) == m.CLOSE_UNEXPECTED_MESSAGE


@pytest.mark.parametrize("msg", AFTER_WELCOME, ids=lambda msg: type(msg).__name__)
def test_each_message_of_a_ready_peer_is_one_event(msg):
    kind, field = EXPECTED[type(msg)]
    event = welcomed().receive_frame(m.encode(msg), 1.0)
    assert type(event) is kind
    if field is not None:
        assert getattr(event, field) == msg


def test_a_second_hello_is_refused():
    assert code_of(welcomed(), m.encode(HELLO)) == m.CLOSE_UNEXPECTED_MESSAGE


def test_text_other_and_oversized_frames_close_with_their_codes():
    """Text frames, non-data frames and frames over the limit each get their own close code."""
    assert code_of(welcomed(), "hello") == m.CLOSE_UNSUPPORTED_DATA
    assert code_of(welcomed(), None) == m.CLOSE_PROTOCOL_ERROR
    assert code_of(welcomed(), b"\0" * (MAX_FRAME + 1)) == m.CLOSE_TOO_BIG


def test_rollouts_for_no_lease_of_this_connection_close_it_past_the_bound():
    """A rollout for a lease granted here passes once; past MAX_UNOWED rollouts that named
    none (resubmissions, other leases, made-up ids) the connection is closed with 1002."""
    proto = welcomed()
    proto.receive_frame(m.encode(m.LeaseRequest(1)), 1.0)
    assert proto.take_credit("L0")
    assert proto.receive_frame(m.encode(ROLLOUT), 1.0) == hp.RolloutReceived(ROLLOUT)
    assert proto.unowed == 0
    for _ in range(hp.MAX_UNOWED):  # L0 again, as a peer back from a reconnect might send it
        proto.receive_frame(m.encode(ROLLOUT), 1.0)
    assert proto.unowed == hp.MAX_UNOWED
    assert code_of(proto, m.encode(ROLLOUT)) == m.CLOSE_PROTOCOL_ERROR


def test_lease_requests_add_credits_up_to_the_cap():
    """Credits add up, a request for none adds none, a negative one is out of bounds, and no
    peer holds more than the cap."""
    proto = welcomed()
    assert proto.receive_frame(m.encode(m.LeaseRequest(3)), 1.0) == hp.CreditsAdded(3)
    assert proto.receive_frame(m.encode(m.LeaseRequest(0)), 1.0) == hp.CreditsAdded(3)
    assert code_of(proto, m.encode(m.LeaseRequest(-5))) == m.CLOSE_PROTOCOL_ERROR
    proto = welcomed()
    proto.receive_frame(m.encode(m.LeaseRequest(3)), 1.0)
    for _ in range(10):
        proto.receive_frame(m.encode(m.LeaseRequest(60)), 1.0)
    assert proto.credits == hp.MAX_CREDITS
    spent = sum(proto.take_credit() for _ in range(hp.MAX_CREDITS + 5))
    assert spent == hp.MAX_CREDITS and proto.credits == 0 and not proto.take_credit()


def test_a_held_version_is_believed_only_up_to_the_newest_published():
    proto = welcomed()
    assert not proto.note_held(0, None)  # nothing published: nobody holds anything
    assert not proto.note_held(5, 4) and proto.held_version is None
    assert proto.note_held(4, 4) and proto.held_version == 4
    assert proto.note_held(2, 4) and (proto.held_version, proto.held_max) == (2, 4)


def test_a_version_never_published_is_told_apart_from_one_held():
    """A tag above both the newest published and what the peer held names no real version."""
    proto = welcomed()
    assert not proto.claims_unpublished(9, None)
    assert proto.claims_unpublished(5, 4) and not proto.claims_unpublished(4, 4)
    proto.note_held(4, 4)
    assert not proto.claims_unpublished(4, 3)  # a hub resumed from an older checkpoint


def test_stream_and_announcement_only_move_forward():
    proto = welcomed()
    assert proto.stream_version is None and proto.needs(0)
    proto.note_whole(3)
    proto.note_whole(1)
    assert proto.stream_version == 3
    proto.announce(2)
    assert not proto.needs(2) and proto.needs(3)


def test_busy_time_counts_from_the_grant_or_the_previous_submission():
    """Time spent waiting for a lease is not counted as work."""
    proto = welcomed()
    assert proto.busy_s(granted=10.0, now=12.0) == 2.0
    assert proto.busy_s(granted=11.0, now=15.0) == 3.0  # started when the last one arrived
    assert proto.busy_s(granted=20.0, now=21.0) == 1.0


def test_goodbye_closes_and_nothing_is_sent_after():
    proto = welcomed()
    assert proto.receive_frame(m.encode(GOODBYE), 1.0) == hp.GoodbyeReceived(GOODBYE)
    assert proto.closed and proto.send(m.Heartbeat()) is None
    assert code_of(proto, m.encode(m.Heartbeat())) == m.CLOSE_UNEXPECTED_MESSAGE


def test_liveness_is_measured_from_the_last_frame():
    proto = welcomed(now=0.0)
    proto.receive_frame(m.encode(m.Heartbeat()), 5.0)
    assert proto.silent_for(12.0) == 7.0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([HELLO, WELCOME, GOODBYE, *AFTER_WELCOME]), max_size=12))
def test_random_walk_agrees_with_the_hand_written_model(script):
    """Every frame either gives the event the model says or fails as the model says."""
    proto, state = fresh(), "await_hello"
    for msg in script:
        if msg is WELCOME:  # the hub's own move: legal only right after a Hello
            if state == "greeted":
                proto.send(msg)
                state = "ready"
            continue
        legal = ((state == "await_hello" and msg is HELLO) or msg is GOODBYE and state != "closed"
                 or (state == "ready" and type(msg) in EXPECTED))
        if not legal:
            code_of(proto, m.encode(msg))
            return
        event = proto.receive_frame(m.encode(msg), 1.0)
        if msg is HELLO:
            assert isinstance(event, hp.HelloReceived)
            state = "greeted"
        elif msg is GOODBYE:
            assert isinstance(event, hp.GoodbyeReceived) and proto.closed
            state = "closed"
        else:
            assert type(event) is EXPECTED[type(msg)][0]
