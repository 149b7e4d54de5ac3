"""What a peer may claim: the value bounds of every peer -> hub message.

`messages.decode` checks a frame's shape (message type, wire type of every field, decoder
limits). This module checks the values against what an honest peer can send, before the hub's
shell, its planners or its learner see them: a negative or NaN price, an infinite rate, a version
from the far future, a 2**63-byte transfer, a reason the protocol does not know. A value out of
bounds is a protocol error that closes that one connection (`RemoteProtocolError`,
CLOSE_PROTOCOL_ERROR, a reason naming the field that never echoes more than a few characters of
the peer's input). In bounds is not believed: whether a lease was granted, a chunk was corrupt or
a rate matches the bytes served is the hub's policy, on its own evidence.

No sockets, no clock. `check_from_peer(msg, welcome)` is the entry point; the session calls it on
every frame the hub receives. The bounds are generous: an honest peer is never near one.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from collections.abc import Callable

import numpy as np

from . import messages as m
from .episodes import check_layout, unpack_turns
from .errors import RemoteProtocolError
from .negotiation import MAX_FEATURES  # Hello.features: names of optional behaviour

MAX_REWARD = 1e6  # a claimed reward: any task's or environment's, with room (the hub re-scores)
MAX_NAME_CHARS = 128  # Hello.name: a hostname-pid or an operator's label
MAX_DEVICE_CHARS = 64  # "cpu", "cuda:7", "mps"
MAX_DTYPE_CHARS = 16  # Hello.dtype: "float32", "bfloat16", "float8_e4m3fn"
MAX_TOKEN_CHARS = 256  # join tokens are ~45 characters (echo2p2p.hub.serving.tokens)
MAX_URL_CHARS = 256  # Hello.listen_addr, http://HOST:PORT
MAX_ID_CHARS = 64  # peer and lease ids, which the hub itself hands out ("p12", "L345")
MAX_PRICE_PER_HOUR = 1000.0  # $/h: far above any rented GPU; also keeps the cost meter finite
NONCE_BYTES = (16, 64)  # Hello.nonce, when present
PEER_KEY_BYTES = 32  # Hello.peer_key, when present: an Ed25519 public key
MAX_VERSION = 2**31 - 1  # a step counter: 68 years at one step a second
MAX_LEASE_REQUEST = 4096  # LeaseRequest.n (the hub holds at most 64 credits per peer anyway)
MAX_SECONDS = 86_400.0  # durations (download_s, span_s): one day
MAX_BYTES = 2**48  # byte counts: 256 TiB, a thousand times the largest open model
MAX_SOURCES = 1024  # TransferReport.sources: one per relay a peer pulled from
MAX_CHUNK_INDEX = 2**32 - 2  # RelayReport.index; RelayPlan owners are uint32 (HUB_OWNER is the max)
MAX_LOGPROB = 1e-3  # a logprob is <= 0; float32 rounding of a near-certain token lands a hair above
MAX_REASON_CHARS = 256  # Goodbye.reason
MAX_PROTOCOL = 2**16  # Hello.protocol: a version number, never near it
MAX_FEATURE_CHARS = 32  # one feature's name


def check_from_peer(msg: m.Message, welcome: m.Welcome | None) -> None:
    """Raise RemoteProtocolError if a field of `msg`, sent by a peer, is out of bounds.
    `welcome`: what the hub told this peer (None before its welcome), for G and the token cap."""
    check = _CHECKS.get(type(msg))
    if check is not None:
        check(msg, welcome)


def _bad(where: str, why: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"bad field {where}: {why}", m.CLOSE_PROTOCOL_ERROR)


def _text(value: str, where: str, max_chars: int, empty: bool = True) -> None:
    """A short single-line string: it goes into logs, and control characters forge log lines."""
    if len(value) > max_chars:
        raise _bad(where, f"longer than {max_chars} characters")
    if not value and not empty:
        raise _bad(where, "empty")
    if not value.isprintable():
        raise _bad(where, "not printable")


def _number(value: float, where: str, lo: float, hi: float) -> None:
    if not lo <= value <= hi:  # also False for NaN
        raise _bad(where, f"must be finite and in [{lo:g}, {hi:g}]")


def _version(value: int | None, where: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    _number(value, where, 0, MAX_VERSION)


def _hello(msg: m.Hello, welcome: m.Welcome | None) -> None:
    _text(msg.name, "hello.name", MAX_NAME_CHARS)
    if msg.engine not in m.ENGINES:
        raise _bad("hello.engine", f"not one of {', '.join(m.ENGINES)}")
    _text(msg.device, "hello.device", MAX_DEVICE_CHARS)
    _text(msg.dtype, "hello.dtype", MAX_DTYPE_CHARS)
    _number(msg.price_per_hour, "hello.price_per_hour", 0.0, MAX_PRICE_PER_HOUR)
    _text(msg.token, "hello.token", MAX_TOKEN_CHARS)
    if msg.nonce and not NONCE_BYTES[0] <= len(msg.nonce) <= NONCE_BYTES[1]:
        raise _bad("hello.nonce", f"must be {NONCE_BYTES[0]}-{NONCE_BYTES[1]} bytes")
    if msg.peer_key and len(msg.peer_key) != PEER_KEY_BYTES:
        raise _bad("hello.peer_key", f"must be {PEER_KEY_BYTES} bytes")
    if msg.listen_addr is not None:
        _listen_addr(msg.listen_addr)
    _number(msg.protocol, "hello.protocol", 1, MAX_PROTOCOL)
    if len(msg.features) > MAX_FEATURES:
        raise _bad("hello.features", f"more than {MAX_FEATURES}")
    for name in msg.features:
        _text(name, "hello.features", MAX_FEATURE_CHARS, empty=False)


def _listen_addr(url: str) -> None:
    """http(s)://HOST:PORT: no credentials, query or fragment (a path is ignored by the hub)."""
    where = "hello.listen_addr"
    _text(url, where, MAX_URL_CHARS, empty=False)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise _bad(where, "not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _bad(where, "expected http://HOST:PORT")
    if port is None or port == 0 or parts.username is not None or parts.query or parts.fragment:
        raise _bad(where, "expected http://HOST:PORT with a port, no user, query or fragment")


def _lease_request(msg: m.LeaseRequest, welcome: m.Welcome | None) -> None:
    _number(msg.n, "lease_request.n", 0, MAX_LEASE_REQUEST)


def _rollout(msg: m.RolloutSubmission, welcome: m.Welcome | None) -> None:
    """Structurally impossible rollouts: wrong G, ragged or non-finite arrays, over the token cap
    (per model turn for an episode), episode turns that do not add up, a claimed reward that is
    no number (the hub re-scores every one; a claim only checks the peer's honesty)."""

    def bad(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"bad rollout {msg.lease_id[:40]!r}: {why}", m.CLOSE_PROTOCOL_ERROR)

    _text(msg.lease_id, "rollout.lease_id", MAX_ID_CHARS)
    if welcome is not None and len(msg.samples) != welcome.group_size:
        raise bad(f"{len(msg.samples)} samples, expected {welcome.group_size}")
    if msg.version < 0:
        raise bad("negative version")
    _version(msg.version, "rollout.version")
    cap = welcome.max_new_tokens if welcome is not None else None
    for s in msg.samples:
        if welcome is not None and bool(s.turns) != bool(welcome.env):
            raise bad("episode turns in a single-turn run" if s.turns
                      else "a multi-turn run's sample needs its turns")
        if s.turns:
            _episode(s, cap, bad)
        elif len(s.token_ids) % 4 or len(s.logprobs) != len(s.token_ids):
            raise bad("token_ids and logprobs must be packed arrays of equal length")
        elif s.n_tokens == 0 or (cap is not None and s.n_tokens > cap):
            raise bad(f"{s.n_tokens} completion tokens")
        if s.finish_reason not in m.FINISH_REASONS:
            raise bad(f"finish_reason {s.finish_reason[:20]!r}")
        if not -MAX_REWARD <= s.reward <= MAX_REWARD:  # also refuses NaN
            raise bad(f"reward is not a number within +-{MAX_REWARD:g}")
    # One vectorised pass over every sample's logprobs: ~5 us for G = 8 x 256 tokens, where a
    # Python loop over the unpacked floats took ~80 us (bench/ingest.py admits ~1000 groups/s).
    lps = np.frombuffer(b"".join(s.logprobs for s in msg.samples), dtype="<f4")
    if lps.size and not (np.isfinite(lps).all() and lps.max() <= MAX_LOGPROB):
        raise bad(f"logprobs must be finite and <= {MAX_LOGPROB:g}")


def _episode(s: m.Sample, cap: int | None, bad: Callable[[str], RemoteProtocolError]) -> None:
    """An episode's layout (`echo2p2p.episodes`): segments that add up, model turns within the
    per-turn token cap."""
    lengths = unpack_turns(s.turns)
    if len(s.token_ids) % 4 or len(s.logprobs) % 4 or not check_layout(
            lengths, s.n_tokens, len(s.logprobs) // 4):
        raise bad("an episode's turns must describe its token_ids and model logprobs")
    if cap is not None and max(lengths[0::2]) > cap:
        raise bad(f"a model turn of {max(lengths[0::2])} tokens")


def _version_held(msg: m.VersionHeld, welcome: m.Welcome | None) -> None:
    _version(msg.version, "version_held.version")


def _transfer_report(msg: m.TransferReport, welcome: m.Welcome | None) -> None:
    _version(msg.version, "transfer_report.version")
    _version(msg.base_version, "transfer_report.base_version", optional=True)
    _number(msg.download_s, "transfer_report.download_s", 0.0, MAX_SECONDS)
    _number(msg.bytes_from_hub, "transfer_report.bytes_from_hub", 0, MAX_BYTES)
    _number(msg.bytes_from_peers, "transfer_report.bytes_from_peers", 0, MAX_BYTES)
    if len(msg.sources) > MAX_SOURCES:
        raise _bad("transfer_report.sources", f"more than {MAX_SOURCES}")
    for src in msg.sources:
        _text(src.peer_id, "transfer_report.sources.peer_id", MAX_ID_CHARS)
        _number(src.nbytes, "transfer_report.sources.nbytes", 0, MAX_BYTES)
        _number(src.span_s, "transfer_report.sources.span_s", 0.0, MAX_SECONDS)


def _relay_report(msg: m.RelayReport, welcome: m.Welcome | None) -> None:
    _version(msg.version, "relay_report.version")
    _version(msg.base_version, "relay_report.base_version", optional=True)
    _text(msg.peer_id, "relay_report.peer_id", MAX_ID_CHARS)
    if msg.reason not in m.RELAY_FAULTS:
        raise _bad("relay_report.reason", f"not one of {', '.join(m.RELAY_FAULTS)}")
    _number(msg.index, "relay_report.index", -1, MAX_CHUNK_INDEX)


def _goodbye(msg: m.Goodbye, welcome: m.Welcome | None) -> None:
    _number(msg.code, "goodbye.code", 1000, 4999)
    _text(msg.reason, "goodbye.reason", MAX_REASON_CHARS)


_CHECKS = {
    m.Hello: _hello, m.LeaseRequest: _lease_request, m.RolloutSubmission: _rollout,
    m.VersionHeld: _version_held, m.TransferReport: _transfer_report,
    m.RelayReport: _relay_report, m.Goodbye: _goodbye,
}
