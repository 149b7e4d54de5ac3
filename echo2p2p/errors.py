"""The one exception tree of echo2p2p.

    Echo2Error
    ├── ConfigError            a config field is missing or out of range (names the field)
    ├── ProtocolError          a frame or message broke the wire protocol
    │   ├── LocalProtocolError   we broke it: a bug on our side
    │   └── RemoteProtocolError  the other side broke it: close that one connection
    │       ├── Flooding             it sent one kind of message far past its rate
    │       └── UnsupportedProtocol  a frame of a protocol version this connection does not use
    ├── JoinRefused            a peer may not join, and retrying cannot help (its token, its env)
    │   └── HubNotFound          no hub at the URL given (unknown host, not a peer endpoint)
    ├── SnapshotError          a weight snapshot or chunk failed verification
    └── ScoringError           the reward function's worker process cannot run (or was closed)

Outcomes of policy (a stale rollout, an unknown lease) are values, not exceptions:
see `echo2p2p.staleness.Verdict` and the `Reject` message.
"""

from __future__ import annotations


class Echo2Error(Exception):
    """Base of every error echo2p2p raises on purpose."""


class ConfigError(Echo2Error, ValueError):
    """A configuration value is invalid; `field` names it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"config field {field!r}: {problem}")
        self.field = field
        self.problem = problem


class ProtocolError(Echo2Error):
    """A frame or message broke the wire protocol.

    `code` is the websocket close code to send, `reason` a short text that is safe to show the
    other side (no internal details).
    """

    def __init__(self, reason: str, code: int = 1002) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol forbids: a bug on our side."""


class RemoteProtocolError(ProtocolError):
    """The other side sent something the protocol forbids: close its connection."""


class Flooding(RemoteProtocolError):
    """The other side kept sending one `kind` of message far past its rate
    (`echo2p2p.frame_budget`): close it, and count it against its identity."""

    def __init__(self, kind: str, code: int) -> None:
        super().__init__(f"too many {kind} frames", code)
        self.kind = kind


class UnsupportedProtocol(RemoteProtocolError):
    """A frame carried a protocol version (`theirs`: None when it is not an integer) that the
    connection does not use: close 4000 (`echo2p2p.frames`)."""

    def __init__(self, reason: str, theirs: int | None) -> None:
        super().__init__(reason, 4000)
        self.theirs = theirs


class JoinRefused(Echo2Error):
    """This peer cannot join, and retrying cannot help: the hub refused its join token, the run
    needs an environment it lacks, or there is no hub at its URL (`HubNotFound`)."""


class HubNotFound(JoinRefused):
    """No hub a peer can join at the URL given, and retrying cannot help: its host name does not
    resolve, what answers there is not a hub's peer endpoint (a wrong path, the dashboard's
    port), or it has no TLS or a certificate we do not trust. The message is one sentence with
    the fix."""


class SnapshotError(Echo2Error):
    """A snapshot, manifest or chunk did not verify (hash, size or layout mismatch)."""


class ScoringError(Echo2Error):
    """A `echo2p2p.scoring.scorer.Scorer` cannot score: its worker does not start, or it was closed.
    (A completion that overruns its deadline is not an error: it scores 0 and is counted.)"""
