"""Wire messages between hub and peers, and their msgpack codec.

Every websocket frame is one binary frame holding one msgpack map:
``{"p": PROTOCOL_VERSION, "t": <type tag>, <field>: <value>, ...}``. Fields are the dataclass
fields below, by name. Token ids and logprobs travel packed (little-endian uint32 / float32),
which keeps a 256-token rollout near 2 KiB and lets the hub validate it without touching every
element.

Decoding is bounded (`Limits`, one set per direction: `FROM_PEER` for what the hub reads,
`FROM_HUB` for what a peer reads): every string, byte string, array, map and ext has a length
cap that msgpack checks at the length header, before it allocates; and a frame may build at most
`max_objects` values in all, counted as containers complete, so a frame of many small nested
maps is refused after a few thousand values instead of after millions. Unknown keys are ignored
(a newer peer can talk to an older hub) and cost nothing beyond that: the map-length cap bounds
how many a map may carry, and their values count against `max_objects` like any other.

This module knows nothing about sockets, sessions or the clock; `docs/PROTOCOL.md` is the
human-readable form of it. `decode` raises `RemoteProtocolError` with a close code and a reason
that is safe to send back; it never raises anything else on any input. Value bounds (a price is
finite, a version is not negative) are `echo2p2p.bounds`'; this module checks wire types only.
"""

from __future__ import annotations

import dataclasses
import re
import struct
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import msgpack

from .errors import LocalProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 2  # 2: the first relay plan travels inside the version announcement

# Close codes: RFC 6455 ones where they fit, 4000-4999 (application range) for the rest.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_TOO_BIG = 1009
CLOSE_BAD_PROTOCOL_VERSION = 4000
CLOSE_UNKNOWN_TYPE = 4001
CLOSE_UNEXPECTED_MESSAGE = 4002
CLOSE_TIMEOUT = 4003
CLOSE_UNAUTHORIZED = 4004  # join refused: token missing, not recognised or revoked
CLOSE_TOO_MANY = 4005  # join refused: this address already has its share of connections

FINISH_REASONS = ("stop", "length")
ENGINES = ("transformers", "vllm", "relay")  # Hello.engine; "relay" generates nothing
RELAY_FAULTS = ("corrupt", "stall", "unreachable")
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
    progress before the deadline) or "unreachable"."""

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
    model: str  # built-in name, HF hub id or a path valid on the peer
    task: str  # task kind, selects the reward function on the peer
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


@dataclass(frozen=True)
class LeaseGrant:
    """One prompt x G samples to generate before `deadline_s` from now, with version >= min_version."""

    TYPE: ClassVar[str] = "lease"
    lease_id: str
    problem_id: str
    prompt: str
    prompt_ids: list[int]
    answer: str  # reference answer, so the peer can score without the dataset
    group_size: int
    deadline_s: float
    min_version: int


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


@dataclass(frozen=True)
class RelayPlan:
    """Where to fetch each chunk of one manifest: the hub as tracker plans, peers pull.

    `owners` is packed little-endian uint32, one per chunk: an index into `sources`, or
    HUB_OWNER. A chunk owned by the receiving peer itself is fetched from the hub; that peer
    then serves it to the others. A newer `revision` of the same manifest replaces the plan.
    """

    TYPE: ClassVar[str] = "relay_plan"
    version: int
    base_version: int | None
    revision: int
    sources: list[RelaySource]
    owners: bytes


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


def encode(msg: Message) -> bytes:
    """One frame for `msg`. Raises LocalProtocolError if `msg` is not a wire message."""
    cls = type(msg)
    if MESSAGE_TYPES.get(getattr(cls, "TYPE", None)) is not cls:
        raise LocalProtocolError(f"not a wire message: {cls.__name__}")
    frame = {"p": PROTOCOL_VERSION, "t": cls.TYPE}
    frame.update(to_wire(msg))
    return msgpack.packb(frame, use_bin_type=True)


@dataclass(frozen=True)
class Limits:
    """Caps on what decoding one frame may build. Lengths are msgpack's own (bytes for str, bin
    and ext; elements for arrays; pairs for maps), refused at the length header; `max_objects`
    bounds the values of the whole frame (each completed array or map adds its length + 1)."""

    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int
    max_objects: int
    max_ext_len: int = 0  # no message uses msgpack ext types


# What the hub reads. A peer's message has at most 10 keys with the header (Hello), so 32
# leaves a newer peer room for extra fields. The longest string is a completion's text, the
# longest bin a sample's packed logprobs: 1 MiB is 256k tokens. Arrays are G samples or one
# transfer's sources (`bounds` caps both at 1024). 16k values fit G = 1024 samples of 5 fields,
# and cost a few milliseconds at worst to build (bench: 4 MB of nested small maps took 200 ms
# without the count, 1.4 ms with it).
FROM_PEER = Limits(max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=1024, max_map_len=32,
                   max_objects=1 << 14)
# What a peer reads: manifests list every tensor and chunk (20k tensors for a large MoE model,
# ~75 bytes a chunk) and leases carry prompt ids, so arrays and the value count are large; the
# peer's frame cap (8 MiB by default) bounds the rest.
FROM_HUB = Limits(max_str_len=16 << 20, max_bin_len=16 << 20, max_array_len=1 << 20,
                  max_map_len=32, max_objects=1 << 22)


class _TooManyObjects(Exception):
    """Raised from msgpack's hooks to stop building a frame past its `max_objects`."""


class _Counter:
    """msgpack list/object hook that counts what a frame builds and stops it past a cap."""

    __slots__ = ("n", "cap")

    def __init__(self, cap: int) -> None:
        self.n, self.cap = 0, cap

    def __call__(self, container: Any) -> Any:
        self.n += len(container) + 1
        if self.n > self.cap:
            raise _TooManyObjects
        return container


def decode(data: bytes, limits: Limits = FROM_HUB) -> Message:
    """The message in one frame; RemoteProtocolError (with close code) if it is not valid."""
    return decode_counted(data, limits)[0]


def decode_counted(data: bytes, limits: Limits = FROM_HUB) -> tuple[Message, int]:
    """`decode`, and how many values the frame built (what it cost beyond its bytes)."""
    count = _Counter(limits.max_objects)
    try:
        frame = msgpack.unpackb(
            data, raw=False, strict_map_key=True, list_hook=count, object_hook=count,
            max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len, max_map_len=limits.max_map_len,
            max_ext_len=limits.max_ext_len)
    except _TooManyObjects:
        raise RemoteProtocolError(f"frame builds over {limits.max_objects} values",
                                  CLOSE_PROTOCOL_ERROR) from None
    except ValueError as exc:
        if (cap := re.search(r"exceeds (max_[a-z_]+)", str(exc))) is not None:  # msgpack's caps
            raise RemoteProtocolError(f"frame over the decoder's {cap[1]}",
                                      CLOSE_PROTOCOL_ERROR) from None
        raise RemoteProtocolError("malformed frame: not msgpack", CLOSE_PROTOCOL_ERROR) from None
    except Exception:  # msgpack raises many types for garbage; all mean the same here
        raise RemoteProtocolError("malformed frame: not msgpack", CLOSE_PROTOCOL_ERROR) from None
    return _message(frame), count.n


def _message(frame: Any) -> Message:
    if not isinstance(frame, dict):
        raise RemoteProtocolError("malformed frame: not a map", CLOSE_PROTOCOL_ERROR)
    proto = frame.get("p")
    if proto != PROTOCOL_VERSION or type(proto) is not int:
        raise RemoteProtocolError(
            f"unsupported protocol version {_short(proto)}, this side speaks {PROTOCOL_VERSION}",
            CLOSE_BAD_PROTOCOL_VERSION,
        )
    tag = frame.get("t")
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {_short(tag)}", CLOSE_UNKNOWN_TYPE)
    return _from_wire(cls, frame, cls.TYPE)


def _short(value: Any) -> str:
    """A value safe to echo in a close reason: short scalars only, never a deep structure."""
    if type(value) in (int, str):
        return repr(value)[:40]
    return f"of type {type(value).__name__}"


def to_wire(obj: Any) -> Any:
    """The plain map/list/scalar form of a message or record, fields in declaration order."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_wire(v) for v in obj]
    return obj


_HINTS: dict[type, list[tuple[str, Any, bool]]] = {}


def _fields(cls: type) -> list[tuple[str, Any, bool]]:
    """(name, type, required) per field, cached: decode runs on every frame."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = [
            (f.name, hints[f.name],
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        ]
    return _HINTS[cls]


def _from_wire(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise RemoteProtocolError(f"bad field {where}: expected a map", CLOSE_PROTOCOL_ERROR)
    kwargs = {}
    for name, typ, required in _fields(cls):
        if name not in raw:
            if required:
                raise RemoteProtocolError(f"missing field {where}.{name}", CLOSE_PROTOCOL_ERROR)
            continue
        kwargs[name] = _check(raw[name], typ, f"{where}.{name}")
    return cls(**kwargs)


_SCALARS = (int, float, str, bytes, bool)


def _check(value: Any, typ: Any, where: str) -> Any:
    if typ in _SCALARS:
        if not (type(value) is typ or (typ is float and type(value) is int)):
            raise RemoteProtocolError(
                f"bad field {where}: expected {typ.__name__}", CLOSE_PROTOCOL_ERROR)
        return float(value) if typ is float else value
    origin = typing.get_origin(typ)
    if origin in (Union, types.UnionType):  # only `X | None` is used
        if value is None:
            return None
        (inner,) = [t for t in typing.get_args(typ) if t is not type(None)]
        return _check(value, inner, where)
    if origin is list:
        if not isinstance(value, list):
            raise RemoteProtocolError(f"bad field {where}: expected a list", CLOSE_PROTOCOL_ERROR)
        (inner,) = typing.get_args(typ)
        return [_check(v, inner, where) for v in value]
    if dataclasses.is_dataclass(typ):
        return _from_wire(typ, value, where)
    raise LocalProtocolError(f"unsupported field type {typ!r} at {where}")


def pack_ids(ids: list[int]) -> bytes:
    """Token ids as little-endian uint32."""
    return struct.pack(f"<{len(ids)}I", *ids)


def unpack_ids(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def pack_logprobs(values: list[float]) -> bytes:
    """Logprobs as little-endian float32."""
    return struct.pack(f"<{len(values)}f", *values)


def unpack_logprobs(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // 4}f", data))

