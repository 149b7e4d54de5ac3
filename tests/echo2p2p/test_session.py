"""The per-connection state machine, driven through an in-memory hub <-> peer link."""

import pytest

from echo2p2p import messages as m
from echo2p2p.errors import LocalProtocolError, RemoteProtocolError
from echo2p2p.session import TRANSITIONS, RECV, SEND, Session, Side, State

WELCOME = m.Welcome("p1", "run", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7)


def sample(n_tokens: int = 3, finish: str = "stop") -> m.Sample:
    return m.Sample(m.pack_ids(list(range(n_tokens))), m.pack_logprobs([-0.5] * n_tokens),
                    "12", 1.0, finish)


ONE_OF_EACH = [
    m.Hello("a", "transformers", "cpu"), m.Heartbeat(), m.LeaseRequest(2),
    m.RolloutSubmission("L0", 0, [sample(), sample()]), m.VersionHeld(0), WELCOME,
    m.LeaseGrant("L0", "q", "1+1=", [1, 2], "2", 2, 60.0, 0), m.Ack("L0"), m.Reject("L0", "stale"),
    m.VersionAnnouncement(m.Manifest(0, None, "zstd", "blake2b-256", 4, 4,
                                     [m.TensorEntry("w", "float32", [1], 0, 4)],
                                     [m.ChunkEntry(4, 4, b"h" * 32)]),
                          m.RelayPlan(0, None, 1, [], b"\xff\xff\xff\xff")),
    m.RelayPlan(0, None, 1, [m.RelaySource("p2", "http://127.0.0.1:9")], b"\0\0\0\0"),
    m.TransferReport(0, None, 1.5, 4, 0, [m.SourceRate("p2", 4, 0.5)]), m.RelayReport(0, "p2", "corrupt"),
    m.Goodbye(1000, "bye"),
]


def handshake() -> tuple[Session, Session]:
    """A hub session and a peer session, welcomed, linked by passing frames by hand."""
    hub, peer = Session(Side.HUB, 0.0), Session(Side.PEER, 0.0)
    assert isinstance(hub.receive(peer.send(ONE_OF_EACH[0]), 1.0), m.Hello)
    assert peer.receive(hub.send(WELCOME), 1.0) == WELCOME
    assert hub.state is State.READY and peer.state is State.READY
    return hub, peer


def test_handshake_then_rollout_round_trip():
    """Hello -> Welcome -> lease -> rollout flows through both sessions unchanged."""
    hub, peer = handshake()
    grant = ONE_OF_EACH[6]
    assert peer.receive(hub.send(grant), 2.0) == grant
    rollout = ONE_OF_EACH[3]
    assert hub.receive(peer.send(rollout), 3.0) == rollout
    assert hub.silent_for(10.0) == 7.0


@pytest.mark.parametrize("side", list(Side))
@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("msg", ONE_OF_EACH, ids=lambda msg: type(msg).__name__)
def test_every_state_and_input_transitions_or_fails_cleanly(side, state, msg):
    """A (state, message) pair in the table transitions; any other closes with 4002."""
    session = Session(side, 0.0)
    session.state = state
    session.welcome = WELCOME
    expected = TRANSITIONS.get((side, state, RECV, type(msg)))
    if expected is None:
        with pytest.raises(RemoteProtocolError) as info:
            session.receive(m.encode(msg), 1.0)
        assert info.value.code == m.CLOSE_UNEXPECTED_MESSAGE
        assert session.state is state
    else:
        assert session.receive(m.encode(msg), 1.0) == msg
        assert session.state is expected
    session.state = state
    if TRANSITIONS.get((side, state, SEND, type(msg))) is None:
        with pytest.raises(LocalProtocolError):
            session.send(msg)


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
    hub, peer = handshake()
    with pytest.raises(RemoteProtocolError) as info:
        hub.receive(m.encode(bad), 2.0)
    assert info.value.code == m.CLOSE_PROTOCOL_ERROR and why in info.value.reason
