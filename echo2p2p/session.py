"""Per-connection protocol state, for either end of a hub <-> peer websocket.

A `Session` turns incoming frames into validated messages and checks outgoing ones, following
one transition table (h11 style): a (state, direction, message type) triple missing from the
table is a protocol error — RemoteProtocolError for what the other side sent (close that
connection), LocalProtocolError for what we were about to send (a bug here).

    hub side:   AWAIT_HELLO --recv Hello--> GREETED --send Welcome--> READY
    peer side:  CONNECTED --send Hello--> AWAIT_WELCOME --recv Welcome--> READY
    any state   --send/recv Goodbye--> CLOSED

Once the hub has sent its Welcome the session also knows G and the token cap, and checks each
rollout's shape against them (the hub never sees a malformed rollout). The clock is an argument.
"""

from __future__ import annotations

import enum
import math

from . import messages as m
from .errors import LocalProtocolError, RemoteProtocolError


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

    def __init__(self, side: Side, now: float):
        self.side = side
        self.state = S.AWAIT_HELLO if side is Side.HUB else S.CONNECTED
        self.last_heard = now
        self.hello: m.Hello | None = None
        self.welcome: m.Welcome | None = None

    def receive(self, data: bytes, now: float) -> m.Message:
        """Decode, validate and account one incoming frame."""
        msg = m.decode(data)
        nxt = TRANSITIONS.get((self.side, self.state, RECV, type(msg)))
        if nxt is None:
            raise RemoteProtocolError(
                f"unexpected {msg.TYPE} in state {self.state.value}", m.CLOSE_UNEXPECTED_MESSAGE)
        if isinstance(msg, m.RolloutSubmission):
            check_rollout(msg, self.welcome)
        self.last_heard = now
        self._advance(msg, nxt)
        return msg

    def send(self, msg: m.Message) -> bytes:
        """The frame for `msg`, after checking we may send it now."""
        nxt = TRANSITIONS.get((self.side, self.state, SEND, type(msg)))
        if nxt is None:
            raise LocalProtocolError(f"may not send {type(msg).__name__} in state {self.state.value}")
        frame = m.encode(msg)
        self._advance(msg, nxt)
        return frame

    def _advance(self, msg: m.Message, nxt: State) -> None:
        self.state = nxt
        if isinstance(msg, m.Hello):
            self.hello = msg
        elif isinstance(msg, m.Welcome):
            self.welcome = msg

    def silent_for(self, now: float) -> float:
        """Seconds since the other side last sent anything."""
        return now - self.last_heard


def check_rollout(msg: m.RolloutSubmission, welcome: m.Welcome | None) -> None:
    """Reject a structurally impossible rollout (wrong G, ragged arrays, over the token cap)."""

    def bad(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"bad rollout {msg.lease_id[:40]!r}: {why}", m.CLOSE_PROTOCOL_ERROR)

    if welcome is not None and len(msg.samples) != welcome.group_size:
        raise bad(f"{len(msg.samples)} samples, expected {welcome.group_size}")
    if msg.version < 0:
        raise bad("negative version")
    for s in msg.samples:
        if len(s.token_ids) % 4 or len(s.logprobs) != len(s.token_ids):
            raise bad("token_ids and logprobs must be packed arrays of equal length")
        if s.n_tokens == 0 or (welcome is not None and s.n_tokens > welcome.max_new_tokens):
            raise bad(f"{s.n_tokens} completion tokens")
        if s.finish_reason not in m.FINISH_REASONS:
            raise bad(f"finish_reason {s.finish_reason[:20]!r}")
        if not math.isfinite(s.reward):
            raise bad("reward is not finite")
