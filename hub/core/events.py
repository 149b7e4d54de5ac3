"""What happened, as the hub's shell tells its core (`hub.core.core.HubCore.handle`).

Each event is a fact, a frozen value, named in the past tense as h11's and trio's are: a
connection said hello, a joined peer's frame arrived, a peer left, a score or a spot-check
finished, the learner wants a batch or finished a step, a version was published, a deadline
passed, the event loop's turn ended. The shell makes them from sockets, timers and finished
futures; a test makes them by hand and feeds them with a fake clock. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m


class Snapshot(Protocol):
    """A signed manifest and its chunks (`hub.overlay.versions.Snapshot`), as the core reads it."""

    manifest: m.Manifest
    chunks: list[bytes]
    signature: bytes
    wire_bytes: int


class Published(Protocol):
    """A version built and signed for the peers (`hub.overlay.versions.Published`): in full,
    and as a delta from the one before (None: none). The core's tracker deals both; hub.core
    never imports hub.overlay (`tests/test_hub_layers.py`), so it names what it reads here."""

    version: int
    full: Snapshot
    delta: Snapshot | None


@dataclass(frozen=True)
class HelloReceived:
    """Connection `conn_id` (the shell's name for it; no peer id yet) said `hello` from
    `remote`; `protocol` is its connection's state. `token_refusal`: why its join token is not
    (or no longer) valid, read by the shell from the token file (None: valid, or none needed)."""

    conn_id: str
    hello: m.Hello
    protocol: hp.HubProtocol
    remote: str | None = None
    token_refusal: str | None = None


@dataclass(frozen=True)
class FrameReceived:
    """Joined peer `peer_id`'s frame, as its `HubProtocol` read it (`echo2p2p.hub_protocol`):
    credits, a rollout, a holding, a transfer or relay report, a heartbeat, a dropped frame."""

    peer_id: str
    event: hp.Event


@dataclass(frozen=True)
class ProtocolBroken:
    """A connection's frame broke the protocol and the shell is closing it (`peer_id`: None
    before its hello). `flooding`: the kind of frame it sent far past its rate
    (`echo2p2p.errors.Flooding`; None: another fault); what a flood costs is the core's."""

    peer_id: str | None
    flooding: str | None = None


@dataclass(frozen=True)
class PeerStalled:
    """Joined peer `peer_id` stopped reading (a send stalled past its deadline): cut off."""

    peer_id: str


@dataclass(frozen=True)
class SentAway:
    """The hub's operator (or a test) sends peer `peer_id` away, going away, for `reason`."""

    peer_id: str
    reason: str


@dataclass(frozen=True)
class PeerLeft:
    """Joined peer `peer_id`'s connection ended (any reason)."""

    peer_id: str


@dataclass(frozen=True)
class ScoringFinished:
    """The scorer finished submission `lease_id`'s samples (`hub.core.actions.Score`).
    `error`: "over_budget" (its peer burnt the scorer's time while it waited), "failed" (a
    crash or a shutdown: not judged) or None, and then what the verifier said, per sample."""

    lease_id: str
    error: str | None = None
    rewards: tuple[float, ...] = ()
    malformed: bool = False  # ids no engine emits
    faults: tuple[str, ...] = ()  # what its environment refutes in the episode
    mismatched: bool = False  # the peer's text is not the decoding of its ids
    forged: int = 0  # completions whose program tried to forge its tests' verdict


@dataclass(frozen=True)
class SpotCheckFinished:
    """The spot-check of submission `lease_id` (`hub.core.actions.SpotCheck`) finished.
    `reason`: None (passed), "logprob" (not reproduced), "version" (never published here) or
    "failed" (a crash or a shutdown: not judged); `tokens`: how many were compared (0: a version
    too old to check); `detail`: what the run log's record says of it."""

    lease_id: str
    reason: str | None = None
    tokens: int = 0
    detail: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchWanted:
    """The learner is ready for the batch of its current step (`hub.core.actions.BatchReady`)."""


@dataclass(frozen=True)
class StepFinished:
    """The learner finished the step its batch was for: the hub is one version on.
    `stopping`: the run stops after it (no lease pass: nothing more will be trained)."""

    stopping: bool = False


@dataclass(frozen=True)
class Replanned:
    """The learner asks for `required` rollouts/s (None: all peers active; `echo2p2p.pool`)."""

    required: float | None


@dataclass(frozen=True)
class VersionPublished:
    """`version` is the newest now: announce it (`hub.core.tracker`)."""

    version: Published


@dataclass(frozen=True)
class Tick:
    """A deadline may have passed: leases expire, the rejections' summary is told, the seed
    watch looks for dealt peers silent past their grace (`hub.core.seeding`)."""


@dataclass(frozen=True)
class TurnEnded:
    """The event loop's turn ended: the lease pass asked for during it runs now, once."""


# --- what came of the overlay's actions (`hub.core.overlay_actions`), and the chunk route ----

@dataclass(frozen=True)
class DeltaBuilt:
    """The catch-up delta `key` (version, base) asked by a `BuildDelta` is built (`snapshot`),
    or failed (None: it goes in full)."""

    key: tuple[int, int]
    snapshot: object | None


@dataclass(frozen=True)
class RelayProbed:
    """The hub's probe of peer `peer_id`'s chunk server answered (`ok`), with its measured
    uplink (`rate_bps`, None: not measured)."""

    peer_id: str
    ok: bool
    rate_bps: float | None = None


@dataclass(frozen=True)
class RelayChecked:
    """The hub's own fetch of an accused relay's chunk (`CheckRelay` `check_id`) came back
    with `verdict` after `elapsed_s`."""

    check_id: int
    verdict: str
    elapsed_s: float


@dataclass(frozen=True)
class GossipChecked:
    """The hub's own gossip link to an accused peer (`CheckGossip` `check_id`) gave `verdict`."""

    check_id: int
    verdict: str


@dataclass(frozen=True)
class ChunkAsked:
    """Peer `peer_id` asked the hub for chunk `index` of manifest `key`: the seed watch's
    evidence that whoever was dealt it did not pass it on."""

    peer_id: str
    key: tuple[int, int | None]
    index: int


@dataclass(frozen=True)
class ChunkAnswered:
    """The hub answered that ask (`fetched`: with the chunk)."""

    peer_id: str
    key: tuple[int, int | None]
    index: int
    fetched: bool


@dataclass(frozen=True)
class ChunkServed:
    """The hub sent `nbytes` of version `version`'s chunks (its send rate, T_bcast)."""

    version: int
    nbytes: int


Event = (HelloReceived | FrameReceived | ProtocolBroken | PeerStalled | SentAway | PeerLeft
         | ScoringFinished
         | SpotCheckFinished | BatchWanted | StepFinished | Replanned | VersionPublished | Tick
         | TurnEnded | DeltaBuilt | RelayProbed | RelayChecked | GossipChecked | ChunkAsked
         | ChunkAnswered | ChunkServed)
