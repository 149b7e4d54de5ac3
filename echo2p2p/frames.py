"""Frames: how one wire record travels as one bounded msgpack frame, and the close codes.

A frame is one msgpack map ``{"p": <protocol version>, "t": <type tag>, <field>: <value>, ...}``
whose fields are a frozen dataclass's, by name. ``"p"`` is the version the connection it
travels on uses (`echo2p2p.negotiation` agrees it): a frame is encoded with one, and decoded only
if it carries one the reader accepts there (else `UnsupportedProtocol`, close code 4000).
Decoding is bounded (`Limits`, one set per direction): every string, byte string, array, map and
ext has a length cap that msgpack checks at the length header, before it allocates; and a frame
may build at most `max_objects` values in all, counted as containers complete. Each field is
type-checked against the dataclass's annotations; unknown keys are ignored. Errors are
`RemoteProtocolError` with a close code and a reason safe to send back; nothing else is ever
raised on any input.

This module knows no message types (`echo2p2p.messages` hands it its registry), no sockets and
no clock.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Union

import msgpack

from .errors import LocalProtocolError, RemoteProtocolError, UnsupportedProtocol

# The versions of the wire, newest last. 1: the first relay plan as a frame of its own; 2: it
# travels inside the version announcement; 3: a connection negotiates its version and optional
# features (the hello always framed 2, every later frame with the version agreed), the welcome
# says whether the hub deals the peer a share (`leaf`), gossip links negotiate in their upgrade.
PROTOCOL_VERSION = 3
SUPPORTED_PROTOCOLS = (2, 3)  # what this release reads and writes: 2 is the previous release
BASE_PROTOCOL = 2  # frames before a version is agreed (the hello): every hub since 2 reads it

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
CLOSE_FLOODING = 4006  # one kind of message sent far past its rate (echo2p2p.frame_budget)


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


# What the hub reads. A peer's message has at most 12 keys with the header (Hello), so 32
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


# `Any` in this module is a wire value: what msgpack decoded (hostile until `_check` types it
# against the record's dataclass) or a record's field before packing: open by nature.
def encode_frame(tag: str, record: Any, protocol: int = BASE_PROTOCOL) -> bytes:
    """One frame carrying dataclass `record` under type tag `tag`, framed with `protocol` (the
    version its connection uses; the base version until one is agreed)."""
    frame = {"p": protocol, "t": tag}
    frame.update(to_wire(record))
    return msgpack.packb(frame, use_bin_type=True)


def decode_frame(data: bytes, limits: Limits, registry: Mapping[str, type],
                 protocols: Collection[int] = SUPPORTED_PROTOCOLS) -> tuple[Any, int]:
    """The record in one frame, as the `registry` class its tag names, and how many values the
    frame built (what it cost beyond its bytes); RemoteProtocolError (with close code) if the
    frame is not valid, `UnsupportedProtocol` if its "p" is not one of `protocols` (on a
    connection: the one version it uses)."""
    record, values, _ = decode_versioned(data, limits, registry, protocols)
    return record, values


def decode_versioned(data: bytes, limits: Limits, registry: Mapping[str, type],
                     protocols: Collection[int] = SUPPORTED_PROTOCOLS) -> tuple[Any, int, int]:
    """`decode_frame`, and the protocol version the frame carries."""
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
    return _record(frame, registry, protocols), count.n, frame["p"]


def _record(frame: Any, registry: Mapping[str, type], protocols: Collection[int]) -> Any:
    if not isinstance(frame, dict):
        raise RemoteProtocolError("malformed frame: not a map", CLOSE_PROTOCOL_ERROR)
    proto = frame.get("p")
    if type(proto) is not int or proto not in protocols:
        expected = " or ".join(str(p) for p in sorted(protocols))
        raise UnsupportedProtocol(
            f"unsupported protocol version {_short(proto)}, expected {expected}",
            proto if type(proto) is int else None)
    tag = frame.get("t")
    cls = registry.get(tag) if isinstance(tag, str) else None
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
