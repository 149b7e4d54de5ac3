"""The hub's end of one peer connection, sans-IO (as websockets' `Protocol`, h11's `Connection`).

The shell feeds each received websocket frame to `HubProtocol.receive_frame(data, now)` and
gets back one event, a fact about what the peer said (`HelloReceived`, `RolloutReceived`, ...);
it acts on the event and sends what `send(msg)` encodes. The protocol owns what is per peer:
the `Session` (validation, the state table, the read budget), the rate of each kind of message
(`echo2p2p.frame_budget`: a frame past its kind's rate is `FrameDropped`, one that keeps coming
raises `Flooding`), the version and features the connection uses (`agreed`, the hello answered
by `echo2p2p.negotiation`: a peer too old is refused with its one sentence, close 4000), the
peer's lease credits, the versions it holds and was announced, when it last submitted, and its
liveness. It never reads the clock (`now` is an argument), never touches a socket, and knows
nothing of other peers, leases or the learner: what follows from an event is the hub's decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from . import messages as m
from .errors import Flooding, RemoteProtocolError, UnsupportedProtocol
from .frame_budget import CLOSE, DROP, FrameBudget, worst
from .negotiation import SPEAKS, Agreed, Speaks, refusal
from .read_budget import ReadBudget
from .session import Session, Side, State

MAX_CREDITS = 64  # lease requests a peer may have outstanding; more asked for are not kept
# Rollouts naming no lease granted on this connection (or one already submitted) before the
# connection is closed: an honest peer sends them only once, as it reconnects, for the leases
# it held (at most its credits, a few times over); a flood of them is probing or a reject loop.
MAX_UNOWED = 1024
_OWED_MEMORY = 16 * MAX_CREDITS  # granted lease ids remembered per connection until submitted


@dataclass(frozen=True)
class HelloReceived:
    """The peer introduced itself; the hub decides whether it joins."""
    hello: m.Hello


@dataclass(frozen=True)
class CreditsAdded:
    """The peer asked for more leases; its credits are already counted."""
    credits: int


@dataclass(frozen=True)
class RolloutReceived:
    submission: m.RolloutSubmission


@dataclass(frozen=True)
class HoldingReported:
    """The peer says it loaded `version` (believed once the hub checks it published it)."""
    version: int


@dataclass(frozen=True)
class TransferReported:
    report: m.TransferReport


@dataclass(frozen=True)
class RelayAccused:
    report: m.RelayReport


@dataclass(frozen=True)
class HeartbeatReceived:
    """Nothing to do: the session already noted that the peer is alive."""


@dataclass(frozen=True)
class GoodbyeReceived:
    goodbye: m.Goodbye


@dataclass(frozen=True)
class FrameDropped:
    """A frame of `kind` came past its rate and was dropped unread (count it, nothing else)."""
    kind: str


Event = Union[HelloReceived, CreditsAdded, RolloutReceived, HoldingReported, TransferReported,
              RelayAccused, HeartbeatReceived, GoodbyeReceived, FrameDropped]


class HubProtocol:
    """Protocol state of one peer connection, as the hub keeps it."""

    def __init__(self, now: float, max_frame_bytes: int, budget: ReadBudget | None = None,
                 speaks: Speaks = SPEAKS):
        """`speaks`: the versions and features this hub speaks (a test makes a future hub)."""
        self.session = Session(Side.HUB, now, budget)
        self.max_frame_bytes = max_frame_bytes
        self.speaks = speaks
        self.agreed: Agreed | None = None  # what the connection uses, once the hello is answered
        # This connection's rates, and those it shares with its identity's other connections.
        self.budgets = [FrameBudget(now)]
        self.credits = 0
        self.held_version: int | None = None  # loaded in its engine
        self.held_max = -1  # the newest version it ever reported holding
        self.stream_version: int | None = None  # newest version it has whole (a base for deltas)
        self.announced = -1  # newest version announced to it
        self.last_done = 0.0  # when its last submission arrived (see `busy_s`)
        self.owed: dict[str, None] = {}  # lease ids granted here, not yet submitted (in order)
        self.unowed = 0  # rollouts that named none of them

    # --- receiving -------------------------------------------------------------------

    def receive_frame(self, data: bytes | str | None, now: float) -> Event:
        """One websocket frame: `bytes` for a binary frame, `str` for a text frame, None for any
        other frame type. Raises RemoteProtocolError (close code and reason) on a violation."""
        if isinstance(data, str):
            raise RemoteProtocolError("text frames are not part of the protocol",
                                      m.CLOSE_UNSUPPORTED_DATA)
        if data is None:
            raise RemoteProtocolError("unexpected websocket frame", m.CLOSE_PROTOCOL_ERROR)
        if len(data) > self.max_frame_bytes:
            raise RemoteProtocolError(
                f"frame of {len(data)} bytes exceeds the {self.max_frame_bytes} byte limit",
                m.CLOSE_TOO_BIG)
        try:
            msg = self.session.receive(data, now)
        except UnsupportedProtocol as exc:  # a hello of protocol 1 was framed with 1
            theirs, waiting = exc.theirs, self.session.state is State.AWAIT_HELLO
            if waiting and theirs is not None and theirs < m.BASE_PROTOCOL:
                raise RemoteProtocolError(refusal(self.speaks.newest, theirs),
                                          m.CLOSE_BAD_PROTOCOL_VERSION) from None
            raise
        verdict = worst([b.spend(msg.TYPE, now) for b in self.budgets])
        if verdict == CLOSE:
            raise Flooding(msg.TYPE, m.CLOSE_FLOODING)
        if verdict == DROP:
            return FrameDropped(msg.TYPE)
        return _EVENTS[type(msg)](self, msg)

    def share_budget(self, budget: FrameBudget) -> None:
        """Hold this connection to `budget` too: its identity's, shared by all its connections."""
        self.budgets.append(budget)

    def _hello(self, msg: m.Hello) -> HelloReceived:
        """Answer the hello's protocol and features: every frame from now on, the welcome
        first, carries the version agreed (RemoteProtocolError, 4000: we speak none of its)."""
        self.agreed = self.speaks.answer(msg.protocol, msg.features)
        self.session.use(self.agreed.protocol)
        return HelloReceived(msg)

    def _rollout(self, msg: m.RolloutSubmission) -> RolloutReceived:
        if self.owed.pop(msg.lease_id, 0) is not None:
            self.unowed += 1
            if self.unowed > MAX_UNOWED:
                raise RemoteProtocolError(f"over {MAX_UNOWED} rollouts for no lease granted "
                                          "on this connection", m.CLOSE_PROTOCOL_ERROR)
        return RolloutReceived(msg)

    def _credits(self, msg: m.LeaseRequest) -> CreditsAdded:
        self.credits = min(self.credits + max(msg.n, 0), MAX_CREDITS)
        return CreditsAdded(self.credits)

    # --- what the hub learns and decides ---------------------------------------------

    def note_held(self, version: int, newest: int | None) -> bool:
        """The peer holds `version`, unless it is newer than the newest the hub published
        (`newest`; None: nothing published), which nobody could hold. Whether it was believed."""
        if newest is None or version > newest:
            return False
        self.held_version = version
        self.held_max = max(self.held_max, version)
        return True

    def note_whole(self, version: int) -> None:
        """The peer has every chunk of `version` (of a manifest the hub keeps)."""
        self.stream_version = max(version, self.stream_version or 0)

    def claims_unpublished(self, version: int, newest: int | None) -> bool:
        """Whether a rollout tagged `version` names a version this hub never published (one
        the peer said it holds may come from a hub resumed from an older checkpoint)."""
        return newest is not None and version > max(newest, self.held_max)

    def needs(self, version: int) -> bool:
        """Whether `version` is newer than any announced to this peer."""
        return self.announced < version

    def announce(self, version: int) -> None:
        self.announced = version

    def take_credit(self, lease_id: str = "") -> bool:
        """Spend one credit on a grant of `lease_id`; False when the peer has none."""
        if self.credits <= 0:
            return False
        self.credits -= 1
        self.owed[lease_id] = None
        if len(self.owed) > _OWED_MEMORY:  # leases it let expire, oldest first
            del self.owed[next(iter(self.owed))]
        return True

    def busy_s(self, granted: float, now: float) -> float:
        """Seconds the peer spent on the submission arriving `now` for a lease `granted` then.
        A peer works through its leases one at a time, so that time started at the grant or at
        its previous submission, whichever is later: idle time waiting for leases is not counted."""
        busy = now - max(granted, self.last_done)
        self.last_done = now
        return busy

    # --- sending and liveness --------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.session.state is State.CLOSED

    @property
    def ready(self) -> bool:
        return self.session.state is State.READY

    def send(self, msg: m.Message) -> bytes | None:
        """The frame for `msg`, or None once the connection is closing (drop it)."""
        return None if self.closed else self.session.send(msg)

    def pause_s(self, now: float) -> float:
        """How long the shell should stop reading: the peer spent its read budget."""
        return self.session.pause_s(now)

    def silent_for(self, now: float) -> float:
        return self.session.silent_for(now)


_EVENTS = {
    m.Hello: HubProtocol._hello,
    m.LeaseRequest: HubProtocol._credits,
    m.RolloutSubmission: HubProtocol._rollout,
    m.VersionHeld: lambda p, msg: HoldingReported(msg.version),
    m.TransferReport: lambda p, msg: TransferReported(msg),
    m.RelayReport: lambda p, msg: RelayAccused(msg),
    m.Heartbeat: lambda p, msg: HeartbeatReceived(),
    m.Goodbye: lambda p, msg: GoodbyeReceived(msg),
}
