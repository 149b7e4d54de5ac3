"""The per-connection state machine, tested against rules written here by hand.

In the manner of h11's `test_state.py` and h2's state-machine tests: hand-written legal
sequences (hub side and peer side, Goodbye from every state), hand-written illegal ones, and a
Hypothesis walk whose model of what is legal (`LEGAL` below) is written independently of
`echo2p2p.session.TRANSITIONS`, which no test here reads. A transition added to or dropped from
the table fails a test.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo2p2p import messages as m
from echo2p2p.errors import LocalProtocolError, RemoteProtocolError
from echo2p2p.session import Session, Side, State

WELCOME = m.Welcome("p1", "run", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7)


def sample(n_tokens: int = 3, finish: str = "stop") -> m.Sample:
    return m.Sample(m.pack_ids(list(range(n_tokens))), m.pack_logprobs([-0.5] * n_tokens),
                    "12", 1.0, finish)


HELLO = m.Hello("a", "transformers", "cpu")
ROLLOUT = m.RolloutSubmission("L0", 0, [sample(), sample()])
GRANT = m.LeaseGrant("L0", "q", "1+1=", [1, 2], "2", 2, 60.0, 0)
MANIFEST = m.Manifest(0, None, "zstd", "blake2b-256", 4, 4, [m.TensorEntry("w", "float32", [1], 0, 4)],
                      [m.ChunkEntry(4, 4, b"h" * 32)])
GOODBYE = m.Goodbye(1000, "bye")
# One valid message of each type, by who sends it on a healthy connection.
FROM_PEER = [HELLO, m.Heartbeat(), m.LeaseRequest(2), ROLLOUT, m.VersionHeld(0),
             m.TransferReport(0, None, 1.5, 4, 0, [m.SourceRate("p2", 4, 0.5)]),
             m.RelayReport(0, "p2", "corrupt")]
FROM_HUB = [WELCOME, m.Heartbeat(), GRANT, m.Ack("L0"), m.Reject("L0", "stale"),
            m.VersionAnnouncement(MANIFEST, m.RelayPlan(0, None, 1, [], b"\xff\xff\xff\xff")),
            m.RelayPlan(0, None, 1, [m.RelaySource("p2", "http://127.0.0.1:9")], b"\0\0\0\0")]
ONE_OF_EACH = [*FROM_PEER, *FROM_HUB[:1], *FROM_HUB[2:], GOODBYE]  # every type once
assert len({type(msg) for msg in ONE_OF_EACH}) == len(ONE_OF_EACH) == 14

H, P = Side.HUB, Side.PEER
S = State
SEND, RECV = "send", "recv"

# The model: what each side may do in each state, written out by hand from the protocol
# (docs/protocol/wire.md), never read from the table under test. Goodbye is added below.
_AFTER_WELCOME_FROM_PEER = {m.Heartbeat, m.LeaseRequest, m.RolloutSubmission, m.VersionHeld,
                            m.TransferReport, m.RelayReport}
_AFTER_WELCOME_FROM_HUB = {m.Heartbeat, m.LeaseGrant, m.Ack, m.Reject, m.VersionAnnouncement,
                           m.RelayPlan}
LEGAL: dict[tuple[Side, State, str], dict[type, State]] = {
    (H, S.AWAIT_HELLO, RECV): {m.Hello: S.GREETED},
    (H, S.AWAIT_HELLO, SEND): {},
    (H, S.GREETED, RECV): {},
    (H, S.GREETED, SEND): {m.Welcome: S.READY},
    (H, S.READY, RECV): {t: S.READY for t in _AFTER_WELCOME_FROM_PEER},
    (H, S.READY, SEND): {t: S.READY for t in _AFTER_WELCOME_FROM_HUB},
    (P, S.CONNECTED, SEND): {m.Hello: S.AWAIT_WELCOME},
    (P, S.CONNECTED, RECV): {},
    (P, S.AWAIT_WELCOME, RECV): {m.Welcome: S.READY},
    (P, S.AWAIT_WELCOME, SEND): {},
    (P, S.READY, RECV): {t: S.READY for t in _AFTER_WELCOME_FROM_HUB},
    (P, S.READY, SEND): {t: S.READY for t in _AFTER_WELCOME_FROM_PEER},
}
for (_side, _state, _way), _moves in LEGAL.items():
    _moves[m.Goodbye] = S.CLOSED  # either side may say goodbye, either way, from any open state
STATES = {H: [S.AWAIT_HELLO, S.GREETED, S.READY, S.CLOSED],
          P: [S.CONNECTED, S.AWAIT_WELCOME, S.READY, S.CLOSED]}


def model_next(side: Side, state: State, way: str, msg: m.Message) -> State | None:
    """The state the model says follows, or None where the move is illegal."""
    return LEGAL.get((side, state, way), {}).get(type(msg))


def step(session: Session, way: str, msg: m.Message, now: float = 1.0) -> None:
    """One legal move; the message comes out of the session unchanged."""
    if way == SEND:
        assert m.decode(session.send(msg), session.limits) == msg
    else:
        assert session.receive(m.encode(msg), now) == msg


def refused(session: Session, way: str, msg: m.Message) -> None:
    """One illegal move: refused cleanly, the session's state unchanged. Received, it is the
    other side's fault (RemoteProtocolError, close 4002); sent, it is ours (LocalProtocolError)."""
    before = session.state
    if way == RECV:
        with pytest.raises(RemoteProtocolError) as info:
            session.receive(m.encode(msg), 1.0)
        assert info.value.code == m.CLOSE_UNEXPECTED_MESSAGE, info.value.reason
    else:
        with pytest.raises(LocalProtocolError):
            session.send(msg)
    assert session.state is before


def reach(side: Side, state: State) -> Session:
    """A session driven to `state` by legal moves only (no state is set by hand)."""
    session = Session(side, 0.0)
    path = {H: [(RECV, HELLO, S.GREETED), (SEND, WELCOME, S.READY), (RECV, GOODBYE, S.CLOSED)],
            P: [(SEND, HELLO, S.AWAIT_WELCOME), (RECV, WELCOME, S.READY), (SEND, GOODBYE, S.CLOSED)]}
    for way, msg, after in path[side]:
        if session.state is state:
            break
        step(session, way, msg)
        assert session.state is after
    assert session.state is state
    return session


# --- hand-written legal sequences -----------------------------------------------------------


def test_a_session_starts_in_its_sides_first_state():
    """The hub waits for a Hello; the peer has not sent one yet."""
    assert Session(H, 0.0).state is S.AWAIT_HELLO
    assert Session(P, 0.0).state is S.CONNECTED


def test_hub_side_legal_sequence():
    """Hello in, Welcome out, then the working conversation both ways, then Goodbye."""
    hub = Session(H, 0.0)
    for way, msg, after in [
        (RECV, HELLO, S.GREETED), (SEND, WELCOME, S.READY), (RECV, m.LeaseRequest(2), S.READY),
        (SEND, FROM_HUB[5], S.READY), (SEND, GRANT, S.READY), (RECV, m.Heartbeat(), S.READY),
        (RECV, ROLLOUT, S.READY), (SEND, m.Ack("L0"), S.READY), (RECV, FROM_PEER[5], S.READY),
        (RECV, m.VersionHeld(0), S.READY), (SEND, FROM_HUB[6], S.READY),
        (RECV, FROM_PEER[6], S.READY), (SEND, m.Reject("L0", "stale"), S.READY),
        (SEND, m.Heartbeat(), S.READY), (RECV, GOODBYE, S.CLOSED),
    ]:
        step(hub, way, msg)
        assert hub.state is after, (way, type(msg).__name__)
    assert hub.hello == HELLO and hub.welcome == WELCOME


def test_peer_side_legal_sequence():
    """Hello out, Welcome in, then announcements, leases and rollouts, then Goodbye."""
    peer = Session(P, 0.0)
    for way, msg, after in [
        (SEND, HELLO, S.AWAIT_WELCOME), (RECV, WELCOME, S.READY), (RECV, FROM_HUB[5], S.READY),
        (SEND, m.LeaseRequest(2), S.READY), (RECV, GRANT, S.READY), (SEND, ROLLOUT, S.READY),
        (RECV, m.Ack("L0"), S.READY), (RECV, m.Reject("L0", "stale"), S.READY),
        (RECV, FROM_HUB[6], S.READY), (SEND, FROM_PEER[5], S.READY), (SEND, FROM_PEER[6], S.READY),
        (SEND, m.VersionHeld(0), S.READY), (RECV, m.Heartbeat(), S.READY),
        (SEND, m.Heartbeat(), S.READY), (SEND, GOODBYE, S.CLOSED),
    ]:
        step(peer, way, msg)
        assert peer.state is after, (way, type(msg).__name__)
    assert peer.hello == HELLO and peer.welcome == WELCOME


def test_handshake_then_rollout_round_trip():
    """Hello -> Welcome -> lease -> rollout flows through a linked hub and peer unchanged."""
    hub, peer = Session(H, 0.0), Session(P, 0.0)
    assert hub.receive(peer.send(HELLO), 1.0) == HELLO
    assert peer.receive(hub.send(WELCOME), 1.0) == WELCOME
    assert hub.state is S.READY and peer.state is S.READY
    assert peer.receive(hub.send(GRANT), 2.0) == GRANT
    assert hub.receive(peer.send(ROLLOUT), 3.0) == ROLLOUT
    assert hub.silent_for(10.0) == 7.0


@pytest.mark.parametrize("way", [SEND, RECV])
@pytest.mark.parametrize("side,state", [(side, state) for side in Side
                                        for state in STATES[side] if state is not S.CLOSED],
                         ids=lambda v: v.value)
def test_goodbye_from_every_open_state_closes(side, state, way):
    """Either side may say or hear Goodbye in any state but CLOSED: the session is CLOSED."""
    session = reach(side, state)
    step(session, way, GOODBYE)
    assert session.state is S.CLOSED


# --- hand-written illegal sequences ---------------------------------------------------------


@pytest.mark.parametrize("msg", [msg for msg in ONE_OF_EACH if type(msg) not in (m.Hello, m.Goodbye)],
                         ids=lambda msg: type(msg).__name__)
def test_hub_refuses_every_message_before_hello(msg):
    """Before its Hello, a peer may send nothing but Hello (or Goodbye): close 4002."""
    refused(Session(H, 0.0), RECV, msg)


@pytest.mark.parametrize("msg", [msg for msg in ONE_OF_EACH if type(msg) is not m.Goodbye],
                         ids=lambda msg: type(msg).__name__)
def test_hub_sends_nothing_before_hello(msg):
    """The hub may not speak first, Welcome included (a bug of ours: LocalProtocolError)."""
    refused(Session(H, 0.0), SEND, msg)


@pytest.mark.parametrize("msg", [msg for msg in ONE_OF_EACH if type(msg) is not m.Goodbye],
                         ids=lambda msg: type(msg).__name__)
def test_hub_between_hello_and_welcome(msg):
    """Greeted but not yet welcomed: the peer may send nothing more (a second Hello, a rollout),
    and the hub may send only its Welcome."""
    hub = reach(H, S.GREETED)
    refused(hub, RECV, msg)
    if type(msg) is not m.Welcome:
        refused(hub, SEND, msg)


def test_a_second_hello_is_refused():
    """A Hello after the handshake is a protocol error on the hub; a peer never sends two."""
    refused(reach(H, S.READY), RECV, HELLO)
    refused(reach(P, S.AWAIT_WELCOME), SEND, HELLO)
    refused(reach(P, S.READY), SEND, HELLO)


def test_a_second_welcome_is_refused():
    """The peer takes one Welcome; the hub sends one."""
    refused(reach(P, S.READY), RECV, WELCOME)
    refused(reach(H, S.READY), SEND, WELCOME)


@pytest.mark.parametrize("msg", [msg for msg in ONE_OF_EACH if type(msg) is not m.Goodbye],
                         ids=lambda msg: type(msg).__name__)
def test_peer_takes_nothing_before_its_hello(msg):
    """A hub that speaks before the peer's Hello (even with a Welcome) breaks the protocol."""
    refused(Session(P, 0.0), RECV, msg)


@pytest.mark.parametrize("msg", [msg for msg in ONE_OF_EACH if type(msg) not in (m.Welcome, m.Goodbye)],
                         ids=lambda msg: type(msg).__name__)
def test_peer_refuses_everything_before_welcome(msg):
    """Awaiting its Welcome, a peer takes no lease grant, announcement, plan, ack or heartbeat."""
    refused(reach(P, S.AWAIT_WELCOME), RECV, msg)


@pytest.mark.parametrize("msg", [msg for msg in ONE_OF_EACH if type(msg) is not m.Goodbye],
                         ids=lambda msg: type(msg).__name__)
def test_peer_sends_nothing_but_hello_before_welcome(msg):
    """No rollout, lease request or report leaves a peer that has not been welcomed."""
    peer = Session(P, 0.0)
    if type(msg) is not m.Hello:
        refused(peer, SEND, msg)
    refused(reach(P, S.AWAIT_WELCOME), SEND, msg)


@pytest.mark.parametrize("msg", [WELCOME, *FROM_HUB[2:]], ids=lambda msg: type(msg).__name__)
def test_hub_refuses_the_hubs_own_messages(msg):
    """A welcomed peer that sends what only a hub sends (Welcome, a lease, a plan) is refused,
    and the hub never sends what only a peer sends."""
    refused(reach(H, S.READY), RECV, msg)
    refused(reach(P, S.READY), SEND, msg)


@pytest.mark.parametrize("msg", [HELLO, *FROM_PEER[2:]], ids=lambda msg: type(msg).__name__)
def test_peer_refuses_the_peers_own_messages(msg):
    """A hub that sends what only a peer sends (a rollout, a report) is refused, and the hub
    may not send one either."""
    refused(reach(P, S.READY), RECV, msg)
    refused(reach(H, S.READY), SEND, msg)


@pytest.mark.parametrize("way", [SEND, RECV])
@pytest.mark.parametrize("side", list(Side), ids=lambda s: s.value)
@pytest.mark.parametrize("msg", ONE_OF_EACH, ids=lambda msg: type(msg).__name__)
def test_nothing_after_goodbye(msg, side, way):
    """Once CLOSED, nothing goes either way, a second Goodbye included."""
    refused(reach(side, S.CLOSED), way, msg)


@pytest.mark.parametrize("bad, why", [
    (m.RolloutSubmission("L0", 0, [sample()]), "1 samples, expected 2"),
    (m.RolloutSubmission("L0", 0, [sample(), sample(9)]), "9 completion tokens"),
    (m.RolloutSubmission("L0", 0, [sample(), sample(0)]), "0 completion tokens"),
    (m.RolloutSubmission("L0", 0, [sample(), sample(finish="bored")]), "finish_reason"),
    (m.RolloutSubmission("L0", 0, [sample(), m.Sample(b"\0" * 8, b"\0" * 4, "", 0.0, "stop")]),
     "equal length"),
    (m.RolloutSubmission("L0", -1, [sample(), sample()]), "negative version"),
])
def test_malformed_rollout_closes_with_reason(bad, why):
    """Rollouts that break the welcome's G / token cap / array shapes are protocol errors."""
    hub = reach(H, S.READY)
    with pytest.raises(RemoteProtocolError) as info:
        hub.receive(m.encode(bad), 2.0)
    assert info.value.code == m.CLOSE_PROTOCOL_ERROR and why in info.value.reason
    assert hub.state is S.READY


# --- the walk -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(side=st.sampled_from(list(Side)), data=st.data())
def test_random_walk_agrees_with_the_hand_written_model(side, data):
    """Any sequence of sends and receives, legal or not: each move the model allows moves the
    session to the model's state; each it forbids is refused cleanly, the state unchanged.
    Half the moves are drawn from what the model allows, so the walk gets past the handshake."""
    session, state = Session(side, 0.0), STATES[side][0]
    for _ in range(data.draw(st.integers(1, 20), label="moves")):
        moves = [(way, msg) for way in (SEND, RECV) for msg in ONE_OF_EACH
                 if model_next(side, state, way, msg) is not None]
        anything = [(way, msg) for way in (SEND, RECV) for msg in ONE_OF_EACH]
        pick_legal = moves and data.draw(st.booleans(), label="legal")
        way, msg = data.draw(st.sampled_from(moves if pick_legal else anything), label="move")
        expected = model_next(side, state, way, msg)
        if expected is None:
            refused(session, way, msg)
        else:
            step(session, way, msg)
            state = expected
        assert session.state is state
