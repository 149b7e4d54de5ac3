"""Per-connection protocol state, for either end of a hub <-> peer websocket.

A `Session` turns incoming frames into validated messages and checks outgoing ones, following
one transition table (h11 style): a (state, direction, message type) triple missing from the
table is a protocol error — RemoteProtocolError for what the other side sent (close that
connection), LocalProtocolError for what we were about to send (a bug here).

    hub side:   AWAIT_HELLO --recv Hello--> GREETED --send Welcome--> READY
    peer side:  CONNECTED --send Hello--> AWAIT_WELCOME --recv Welcome--> READY
    any state   --send/recv Goodbye--> CLOSED

Every frame carries the protocol version the connection uses (`protocol`): the base version
(2) until the hub agrees one (`use`, from the hello: `echo2p2p.negotiation`), then that one both
ways, the welcome included; a frame of another version is `UnsupportedProtocol` (close 4000).
The hello is always framed 2, what every hub since 2 reads. Before the welcome a peer accepts
any version it speaks (`protocols`): the welcome's frame and its `protocol` field must agree.

On the hub side every message is also checked against `echo2p2p.bounds` (once the Welcome is
sent, rollouts against its G and token cap too), so the hub never sees a field out of bounds;
frames are decoded with `messages.FROM_PEER` limits (a peer decodes with `FROM_HUB`), and each
is charged to a `ReadBudget` whose `pause_s(now)` tells the shell how long to stop reading.
The clock is an argument.
"""

from __future__ import annotations

import enum

from . import messages as m
from .bounds import check_from_peer
from .errors import LocalProtocolError, RemoteProtocolError
from .read_budget import ReadBudget


class Side(enum.Enum):
    HUB = "hub"
    PEER = "peer"


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    GREETED = "greeted"
    CONNECTED = "connected"
    AWAIT_WELCOME = "await_welcome"
    READY = "ready"
    CLOSED = "closed"


SEND, RECV = "send", "recv"
S = State
_HUB_READY_RECV = (m.Heartbeat, m.LeaseRequest, m.RolloutSubmission, m.VersionHeld,
                   m.TransferReport, m.RelayReport)
_HUB_READY_SEND = (m.Heartbeat, m.LeaseGrant, m.Ack, m.Reject, m.VersionAnnouncement, m.RelayPlan)

TRANSITIONS: dict[tuple[Side, State, str, type], State] = {
    (Side.HUB, S.AWAIT_HELLO, RECV, m.Hello): S.GREETED,
    (Side.HUB, S.GREETED, SEND, m.Welcome): S.READY,
    **{(Side.HUB, S.READY, RECV, t): S.READY for t in _HUB_READY_RECV},
    **{(Side.HUB, S.READY, SEND, t): S.READY for t in _HUB_READY_SEND},
    (Side.PEER, S.CONNECTED, SEND, m.Hello): S.AWAIT_WELCOME,
    (Side.PEER, S.AWAIT_WELCOME, RECV, m.Welcome): S.READY,
    **{(Side.PEER, S.READY, RECV, t): S.READY for t in _HUB_READY_SEND},
    **{(Side.PEER, S.READY, SEND, t): S.READY for t in _HUB_READY_RECV},
    **{(side, state, way, m.Goodbye): S.CLOSED
       for side in Side for state in State if state is not S.CLOSED for way in (SEND, RECV)},
}


class Session:
    """Protocol state of one connection, seen from `side`."""

    def __init__(self, side: Side, now: float, budget: ReadBudget | None = None,
                 protocols: tuple[int, ...] = m.SUPPORTED_PROTOCOLS):
        """`budget`: what this side may spend on reading the other (default: `ReadBudget`'s
        defaults on the hub side; a peer reads its hub unmetered). `protocols`: the versions a
        peer accepts its welcome in."""
        self.side = side
        self.protocol = m.BASE_PROTOCOL  # what frames are framed with, both ways
        self.accepts = (m.BASE_PROTOCOL,) if side is Side.HUB else tuple(protocols)
        self.state = S.AWAIT_HELLO if side is Side.HUB else S.CONNECTED
        self.last_heard = now
        self.hello: m.Hello | None = None
        self.welcome: m.Welcome | None = None
        self.limits = m.FROM_PEER if side is Side.HUB else m.FROM_HUB
        self.budget = budget if budget is not None or side is Side.PEER else ReadBudget(now)

    def receive(self, data: bytes, now: float) -> m.Message:
        """Decode, validate and account one incoming frame."""
        msg, values, protocol = m.decode_versioned_message(data, self.limits, self.accepts)
        if self.budget is not None:
            self.budget.charge(len(data), values, now)
        nxt = TRANSITIONS.get((self.side, self.state, RECV, type(msg)))
        if nxt is None:
            raise RemoteProtocolError(
                f"unexpected {msg.TYPE} in state {self.state.value}", m.CLOSE_UNEXPECTED_MESSAGE)
        if self.side is Side.HUB:
            check_from_peer(msg, self.welcome)
        elif isinstance(msg, m.Welcome):
            if msg.protocol != protocol:
                raise RemoteProtocolError(f"a welcome framed with protocol {protocol} names "
                                          f"protocol {msg.protocol}", m.CLOSE_BAD_PROTOCOL_VERSION)
            self.use(protocol)
        self.last_heard = now
        self._advance(msg, nxt)
        return msg

    def send(self, msg: m.Message) -> bytes:
        """The frame for `msg`, after checking we may send it now."""
        nxt = TRANSITIONS.get((self.side, self.state, SEND, type(msg)))
        if nxt is None:
            raise LocalProtocolError(f"may not send {type(msg).__name__} in state {self.state.value}")
        if isinstance(msg, m.Welcome) and msg.protocol != self.protocol:
            raise LocalProtocolError(f"a welcome naming protocol {msg.protocol} on a connection "
                                     f"that uses {self.protocol}")
        frame = m.encode(msg, m.BASE_PROTOCOL if isinstance(msg, m.Hello) else self.protocol)
        self._advance(msg, nxt)
        return frame

    def use(self, protocol: int) -> None:
        """From now on frames carry `protocol`, both ways (the version agreed)."""
        self.protocol, self.accepts = protocol, (protocol,)

    def _advance(self, msg: m.Message, nxt: State) -> None:
        self.state = nxt
        if isinstance(msg, m.Hello):
            self.hello = msg
        elif isinstance(msg, m.Welcome):
            self.welcome = msg

    def silent_for(self, now: float) -> float:
        """Seconds since the other side last sent anything."""
        return now - self.last_heard

    def pause_s(self, now: float) -> float:
        """Seconds the shell should stop reading this connection before its next frame: the
        other side spent its read budget (0 when it has not, or nothing is metered)."""
        return self.budget.pause_s(now) if self.budget is not None else 0.0

