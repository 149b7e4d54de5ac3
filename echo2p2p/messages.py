"""Wire messages between hub and peers: what each says, and `encode` / `decode` for them.

Every websocket frame is one binary frame holding one message, laid out by `echo2p2p.frames`
(which also owns the protocol version, the close codes and the decoding limits; their names are
re-exported here, where callers reach the wire). Token ids and logprobs travel packed
(little-endian uint32 / float32), which keeps a 256-token rollout near 2 KiB and lets the hub
validate it without touching every element.

It knows nothing about sockets, sessions or the clock; `docs/protocol/` is its human-readable
form. `decode` raises `RemoteProtocolError` with a close code and a reason safe to send back,
never anything else, on any input. Value bounds (a price is finite, a version is not negative)
are `echo2p2p.bounds`'; the wire types only are checked here. Over 400 lines: every wire
message in one file, its fields' meanings beside them, as `docs/protocol/wire.md` lists them.
"""

from __future__ import annotations

import struct
import typing
from dataclasses import dataclass, field
from typing import ClassVar, Union

from .errors import LocalProtocolError
from .frames import decode_versioned, encode_frame
from .frames import (  # noqa: F401  re-exported: the wire's names, reached as m.X
    PROTOCOL_VERSION, SUPPORTED_PROTOCOLS, BASE_PROTOCOL, CLOSE_NORMAL, CLOSE_GOING_AWAY,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_UNSUPPORTED_DATA, CLOSE_TOO_BIG, CLOSE_BAD_PROTOCOL_VERSION, CLOSE_UNKNOWN_TYPE,
    CLOSE_UNEXPECTED_MESSAGE, CLOSE_TIMEOUT, CLOSE_UNAUTHORIZED, CLOSE_TOO_MANY, CLOSE_FLOODING,
    FROM_HUB, FROM_PEER, Limits, to_wire,
)

FINISH_REASONS = ("stop", "length")
ENGINES = ("transformers", "vllm", "relay")  # Hello.engine; "relay" generates nothing
RELAY_FAULTS = ("corrupt", "stall", "unreachable", "slow")
HUB_OWNER = 0xFFFFFFFF  # in RelayPlan.owners: fetch this chunk from the hub


# --- peer -> hub ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """First frame a peer sends: who it is and what it runs."""

    TYPE: ClassVar[str] = "hello"
    name: str
    engine: str  # one of ENGINES
    device: str  # "cpu", "cuda", "cuda:1", ...
    price_per_hour: float = 0.0
    listen_addr: str | None = None  # http://HOST:PORT of the peer's chunk server, if it serves
    token: str = ""  # join token, when the hub requires one
    nonce: bytes = b""  # 16-64 fresh random bytes: the hub proves its key by signing them
    peer_key: bytes = b""  # the peer's Ed25519 public key (32 bytes): signs its chunk requests
    # Protocol 3: the highest protocol version the peer speaks (absent: 2) and the optional
    # features it speaks (`echo2p2p.negotiation`); the welcome answers with what this connection
    # uses.
    protocol: int = BASE_PROTOCOL
    features: list[str] = field(default_factory=list)
    # What the engine computes in ("float32", "bfloat16"; '' = not said): for logs and the
    # hub's mismatch figures only. A claim: the hub's spot-check bar never depends on it.
    dtype: str = ""


@dataclass(frozen=True)
class Heartbeat:
    """Keep-alive, either direction."""

    TYPE: ClassVar[str] = "heartbeat"


@dataclass(frozen=True)
class LeaseRequest:
    """The peer asks for `n` more prompt leases (credits, not a total)."""

    TYPE: ClassVar[str] = "lease_request"
    n: int


@dataclass(frozen=True)
class Sample:
    """One completion: packed token ids (<u4) and per-token behaviour logprobs (<f4)."""

    token_ids: bytes
    logprobs: bytes
    text: str
    reward: float  # the peer's claim; the hub re-scores
    finish_reason: str  # one of FINISH_REASONS
    # An episode of a multi-turn environment: its segment lengths, packed <u4 (model turn,
    # observation, model turn, ...; `echo2p2p.episodes`); the logprobs are the model tokens'.
    # b"": a single-turn completion.
    turns: bytes = b""

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids) // 4


@dataclass(frozen=True)
class RolloutSubmission:
    """The G completions of one lease, all generated with policy `version`."""

    TYPE: ClassVar[str] = "rollout"
    lease_id: str
    version: int
    samples: list[Sample]


@dataclass(frozen=True)
class VersionHeld:
    """The peer has every chunk of `version` verified and swapped in."""

    TYPE: ClassVar[str] = "version_held"
    version: int


@dataclass(frozen=True)
class SourceRate:
    """What one peer received from one source: bytes, and seconds from first to last byte."""

    peer_id: str
    nbytes: int
    span_s: float


@dataclass(frozen=True)
class TransferReport:
    """The peer has every chunk of one manifest verified, and how it got them.

    Every receiver of an owner's share pulls it over about the same span, so the hub estimates
    that owner's upload bandwidth as the bytes all receivers got from it over their median span.
    """

    TYPE: ClassVar[str] = "transfer_report"
    version: int
    base_version: int | None
    download_s: float
    bytes_from_hub: int
    bytes_from_peers: int
    sources: list[SourceRate]


@dataclass(frozen=True)
class RelayReport:
    """A source misbehaved: `reason` is "corrupt" (a chunk failed its digest), "stall" (no
    progress before the deadline), "unreachable" or "slow" (a chunk came whole, but far slower
    than its `RelaySource.rate_bps` allows: `echo2p2p.pace`)."""

    TYPE: ClassVar[str] = "relay_report"
    version: int
    peer_id: str
    reason: str
    index: int = -1  # the chunk (of manifest (version, base_version)) that failed, if known
    base_version: int | None = None


# --- hub -> peer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Welcome:
    """The hub's answer to Hello: the run, the model, the sampling settings."""

    TYPE: ClassVar[str] = "welcome"
    peer_id: str
    run_id: str
    model: str  # the model's name, for logs: never a path to open (its files: model_digest)
    task: str  # the task's kind, not the task ("addition", "rg:<generator>"): read as `task_kind`
    version: int  # newest published version; its announcement and relay plan follow
    max_lag: int  # S
    group_size: int  # G
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int  # this peer's sampling seed: peers must not sample identical completions
    hub_key: bytes = b""  # the hub's Ed25519 public key; every manifest is signed with it
    ticket: bytes = b""  # the hub's signature admitting (peer_id, peer_key) to run_id
    proof: bytes = b""  # the hub's signature over the hello's nonce, run_id, peer_id, peer_key
    # The model's non-weight files: blake2b-256 of the exact bytes GET /model/ answers, and
    # the hub's signature over it (signing.sign_model_files). Empty: an older hub.
    model_digest: bytes = b""
    model_signature: bytes = b""
    # A multi-turn run: the environment (an installed package's entry point in the group
    # "echo2p2p.environments") and its version; a peer without it refuses to join. '' = none.
    env: str = ""
    env_version: str = ""
    # Text around each of its observations, when they are user turns of a chat template
    # (`episodes.in_turn`): the template's turn markup. '' = the observation as it is.
    env_turn_before: str = ""
    env_turn_after: str = ""
    # Protocol 3: the version and optional features this connection uses (absent: 2, none), and
    # whether the hub deals this peer no share of any version (a leaf: no chunk server, or one
    # that failed the hub's probe; it takes every chunk from links or the hub).
    protocol: int = BASE_PROTOCOL
    features: list[str] = field(default_factory=list)
    leaf: bool = False
    # The spot-check bar: a checked group fails when the mean |claimed - recomputed| logprob
    # over its tokens exceeds this many nats (hub.learning.spotcheck). 0: not said (an older hub).
    spot_check_tolerance: float = 0.0

    @property
    def task_kind(self) -> str:
        """The run's task kind (what the wire calls `task`): selects the peer's reward."""
        return self.task


@dataclass(frozen=True)
class LeaseGrant:
    """One prompt x G samples to generate before `deadline_s` from now, with version >= min_version."""

    TYPE: ClassVar[str] = "lease"
    lease_id: str
    problem_id: str
    prompt: str
    prompt_ids: list[int]
    answer: str  # reference answer, so the peer can score without the dataset; with an
    # environment (Welcome.env), the episode's seed in decimal: read it as `episode_seed`
    group_size: int
    deadline_s: float
    min_version: int

    @property
    def episode_seed(self) -> int | None:
        """The episode's seed in an environment run, which the wire carries in `answer` (where
        older peers read it); None when `answer` is no decimal."""
        return int(self.answer) if self.answer.isascii() and self.answer.isdigit() else None


@dataclass(frozen=True)
class Ack:
    """A rollout submission was taken (or had been taken already: `duplicate`)."""

    TYPE: ClassVar[str] = "ack"
    lease_id: str
    duplicate: bool = False


@dataclass(frozen=True)
class Reject:
    """A rollout submission was not taken; `reason` is a short word (stale, unknown_lease, ...)."""

    TYPE: ClassVar[str] = "reject"
    lease_id: str
    reason: str


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a snapshot's flat byte stream."""

    name: str
    dtype: str  # "bfloat16", "float32", ...
    shape: list[int]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk: raw (uncompressed) size, size on the wire, hash of the wire bytes."""

    raw_bytes: int
    wire_bytes: int
    digest: bytes


@dataclass(frozen=True)
class Manifest:
    """Everything needed to fetch, verify and rebuild one policy version."""

    version: int
    base_version: int | None  # set when the chunks are a delta against that version
    codec: str  # "zstd" (full) or "delta" (against base_version)
    hash_algo: str  # "blake2b-256"
    chunk_bytes: int  # raw bytes per chunk (the last may be shorter)
    total_bytes: int
    tensors: list[TensorEntry]
    chunks: list[ChunkEntry]
    digest: bytes = b""  # hash of the whole raw stream, checked once every chunk is in


@dataclass(frozen=True)
class VersionAnnouncement:
    """A new version exists, and `plan` (revision 1 or later, for this very manifest) says where
    to fetch its chunks; later revisions come as `RelayPlan` messages."""

    TYPE: ClassVar[str] = "version"
    manifest: Manifest
    plan: RelayPlan
    signature: bytes = b""  # Ed25519 by the hub's key over signing.manifest_bytes(manifest)


@dataclass(frozen=True)
class RelaySource:
    """A peer that serves chunks: GET {url}/chunk/{version}/{base}/{index}."""

    peer_id: str
    url: str  # http://HOST:PORT
    # What each receiver may expect from it, bits/s: its measured upload shared among the members
    # that pull from it (`echo2p2p.pace`); 0 = not measured. A chunk far slower is reported "slow".
    rate_bps: float = 0.0


@dataclass(frozen=True)
class RelayPlan:
    """How a peer gets one manifest's chunks, whatever the run's `--relay`: one of two things.

    A tracker's plan (pipelined, striped-chain): `owners` is packed little-endian uint32, one
    per chunk: an index into `sources`, or HUB_OWNER. A chunk owned by the receiving peer itself
    is fetched from the hub; that peer then serves it to the others. `window`: the requests to
    keep in flight per source (0: the peer's own default); the striped chain asks for more,
    since one source serves nearly every chunk. Under gossip, no plan: `gossip` (read it as
    `swarm`) is the peer's part in the swarm, and peers route themselves (`echo2p2p.gossip`);
    it rides here since the plan is how a peer learns the run's strategy (and old peers ignore
    it). A newer `revision` of the same manifest replaces the plan.
    """

    TYPE: ClassVar[str] = "relay_plan"
    version: int
    base_version: int | None
    revision: int
    sources: list[RelaySource]
    owners: bytes
    gossip: GossipPlan | None = None  # set: the gossip strategy (then sources and owners are empty)
    window: int = 0

    @property
    def swarm(self) -> GossipPlan | None:
        """Under gossip, this peer's part in the swarm (the wire's `gossip`); else None."""
        return self.gossip


@dataclass(frozen=True)
class GossipPlan:
    """A peer's part in a gossip broadcast (`relay_plan.gossip`): the chunks it fetches from the
    hub, `seed` (packed little-endian uint32; every chunk has one seeder), and the peers it
    dials, `neighbours` (a random sample; at most 32). Everything else it learns from its links."""

    version: int
    base_version: int | None
    seed: bytes
    neighbours: list[RelaySource]


# --- either way ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Goodbye:
    """Sent just before closing on purpose, with the same code and reason as the close."""

    TYPE: ClassVar[str] = "goodbye"
    code: int
    reason: str


Message = Union[
    Hello, Heartbeat, LeaseRequest, RolloutSubmission, VersionHeld, TransferReport, RelayReport,
    Welcome, LeaseGrant, Ack, Reject, VersionAnnouncement, RelayPlan, Goodbye,
]
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in typing.get_args(Message)}


# --- codec ---------------------------------------------------------------------------------


def encode(msg: Message, protocol: int = BASE_PROTOCOL) -> bytes:
    """One frame for `msg`, framed with `protocol`: the version its connection uses (a
    `Session` passes it; the base version, 2, is what a connection uses until one is agreed,
    and what a hello is always framed with). Raises LocalProtocolError if `msg` is not a wire
    message."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TYPE", None)) is not cls:
        raise LocalProtocolError(f"not a wire message: {cls.__name__}")
    return encode_frame(cls.TYPE, msg, protocol)


def decode(data: bytes, limits: Limits = FROM_HUB,
           protocols: tuple[int, ...] = SUPPORTED_PROTOCOLS) -> Message:
    """The message in one frame; RemoteProtocolError (with close code) if it is not valid,
    `UnsupportedProtocol` if it is framed with a version not in `protocols`."""
    return decode_counted(data, limits, protocols)[0]


def decode_counted(data: bytes, limits: Limits = FROM_HUB,
                   protocols: tuple[int, ...] = SUPPORTED_PROTOCOLS) -> tuple[Message, int]:
    """`decode`, and how many values the frame built (what it cost beyond its bytes)."""
    return decode_versioned(data, limits, MESSAGE_TYPES, protocols)[:2]


def decode_versioned_message(data: bytes, limits: Limits,
                             protocols: tuple[int, ...]) -> tuple[Message, int, int]:
    """`decode_counted`, and the protocol version the frame was framed with."""
    return decode_versioned(data, limits, MESSAGE_TYPES, protocols)


def pack_ids(ids: list[int]) -> bytes:
    """Ids (token ids, chunk indices) as little-endian uint32."""
    return struct.pack(f"<{len(ids)}I", *ids)


def unpack_ids(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def pack_logprobs(values: list[float]) -> bytes:
    """Logprobs as little-endian float32."""
    return struct.pack(f"<{len(values)}f", *values)


def unpack_logprobs(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // 4}f", data))

