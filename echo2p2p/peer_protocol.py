"""The peer's side of one hub connection, sans-IO (h11 `Connection` style): frames in, events out.

`PeerProtocol` owns the connection's `Session`: `hello()` and `send(msg)` give frames,
`receive_welcome(frame, now)` checks the welcome (pinned key, proof over our nonce), and
`receive(frame, now)` turns each message into an event (a fact): `LeaseGranted`, `RolloutAcked`,
`RolloutRejected`, `VersionAnnounced` (fetch it now: it supersedes any older download under way),
`PlanRevised` (a relay plan matching the download under way; others are dropped here), `HubLeft`.
The hello offers the newest protocol version and the features we speak; the welcome says what
the connection uses (`agreed`; absent: 2, an older hub). A goodbye refusing our token or our
protocol version (close 4000, the hub's one sentence), or a welcome in a version we do not
speak, raises `JoinRefused`: no retry can help. An unsigned manifest raises `SnapshotError`,
an announcement with another version's plan `RemoteProtocolError`. `adoption()` decides what a
welcome means for what the peer holds. Never touches a socket, a file, an engine or the clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import messages as m
from . import signing
from .errors import JoinRefused, RemoteProtocolError, UnsupportedProtocol
from .negotiation import SPEAKS, Agreed, Speaks
from .session import Session, Side

Key = tuple[int, int | None]  # (version, base_version) of one manifest
# After a refusal for our join token (the hub's reason says what was wrong with it): the fix.
TOKEN_FIX = "; the hub's operator makes tokens (`echo2-hub token create`): pass yours with --token"


@dataclass(frozen=True)
class LeaseGranted:
    grant: m.LeaseGrant
    deadline: float  # `now` when received + the grant's deadline_s


@dataclass(frozen=True)
class RolloutAcked:
    lease_id: str


@dataclass(frozen=True)
class RolloutRejected:
    lease_id: str
    reason: str


@dataclass(frozen=True)
class VersionAnnounced:
    """Fetch this version now; a download under way (of an older version) is superseded."""

    manifest: m.Manifest
    plan: m.RelayPlan


@dataclass(frozen=True)
class PlanRevised:
    """A newer relay plan for the download under way."""

    plan: m.RelayPlan


@dataclass(frozen=True)
class HubLeft:
    code: int
    reason: str


Event = LeaseGranted | RolloutAcked | RolloutRejected | VersionAnnounced | PlanRevised | HubLeft


@dataclass(frozen=True)
class Adoption:
    """What a welcome means for what the peer holds (applied by the shell, in this order)."""

    build_model: str | None  # build an engine from the welcome's model files (this is the
    # model's name, for logs; None: keep the engine we have)
    new_run: bool  # another run: drop the version, staged weights, store, leases and outbox
    resumed_behind: bool  # the hub resumed behind our version: drop it, newer rollouts, store


def adoption(previous: m.Welcome | None, welcome: m.Welcome, *, held_version: int | None,
             has_engine: bool, relay: bool) -> Adoption:
    """Decide what `welcome` (after `previous`, None on the first) changes. A pure relay never
    builds an engine; a new engine holds no version, so it cannot be behind the hub."""
    new_model = not has_engine or (previous is not None and (
        previous.model, previous.model_digest) != (welcome.model, welcome.model_digest))
    build = welcome.model if new_model and not relay else None
    version = None if build is not None else held_version
    new_run = previous is not None and previous.run_id != welcome.run_id
    behind = not new_run and version is not None and welcome.version < version
    return Adoption(build, new_run, behind)


class PeerProtocol:
    """One connection to the hub, seen from the peer. `hub_url` only names the hub in errors."""

    def __init__(self, now: float, *, hub_url: str, peer_key: bytes, nonce: bytes,
                 pinned_hub_key: bytes | None = None, speaks: Speaks = SPEAKS):
        self.session = Session(Side.PEER, now, protocols=speaks.protocols)
        self.hub_url, self.peer_key, self.nonce = hub_url, peer_key, nonce
        self.pinned_hub_key = pinned_hub_key
        self.speaks = speaks
        self.welcome: m.Welcome | None = None
        self.agreed: Agreed | None = None  # the version and features the welcome says we use
        self.downloading: Key | None = None  # the manifest being fetched on this connection

    def hello(self, hello: m.Hello) -> bytes:
        """The Hello frame; `hello` must carry our `nonce` and `peer_key`. It offers the newest
        version and the features we speak, whatever `hello` says."""
        if hello.nonce != self.nonce or hello.peer_key != self.peer_key:
            raise ValueError("the hello must carry this protocol's nonce and peer key")
        return self.session.send(dataclasses.replace(
            hello, protocol=self.speaks.newest, features=sorted(self.speaks.features)))

    def receive_welcome(self, data: bytes, now: float) -> m.Welcome:
        """The hub's answer to our hello: a welcome whose key is the pinned one (if pinned) and
        that proves it holds that key by signing our fresh nonce (echoing a key proves nothing)."""
        try:
            welcome = self.session.receive(data, now)
        except UnsupportedProtocol as exc:
            if exc.theirs is None:
                raise
            raise JoinRefused(self.speaks.cannot_speak(exc.theirs, f"hub {self.hub_url}")) from None
        if isinstance(welcome, m.Goodbye):
            if welcome.code == m.CLOSE_UNAUTHORIZED:
                raise JoinRefused(f"hub {self.hub_url} refused us: {welcome.reason}{TOKEN_FIX}")
            if welcome.code == m.CLOSE_BAD_PROTOCOL_VERSION:  # its one sentence, as it says it
                raise JoinRefused(welcome.reason)
            raise RemoteProtocolError(f"hub refused us: {welcome.reason}")
        if not isinstance(welcome, m.Welcome):  # the session's table allows nothing else
            raise RemoteProtocolError(f"unexpected {welcome.TYPE} before the welcome",
                                      m.CLOSE_UNEXPECTED_MESSAGE)
        pinned = self.pinned_hub_key
        if pinned is not None and welcome.hub_key != pinned:
            raise RemoteProtocolError(f"hub {self.hub_url} signs with key "
                                      f"{welcome.hub_key.hex() or '(none)'}, not the pinned --hub-key")
        if (pinned is not None or welcome.hub_key) and not signing.verify_welcome(
                welcome.hub_key, self.nonce, welcome.run_id, welcome.peer_id, self.peer_key,
                welcome.proof):
            raise RemoteProtocolError(f"hub {self.hub_url} cannot prove it holds key "
                                      f"{welcome.hub_key.hex()[:16]}...: its welcome is not signed by it")
        self.welcome = welcome
        self.agreed = self.speaks.check(welcome.protocol, welcome.features)
        return welcome

    def receive(self, data: bytes, now: float) -> Event | None:
        """One frame from the hub as an event (None: nothing for the shell to do)."""
        msg = self.session.receive(data, now)
        if isinstance(msg, m.Goodbye):
            if msg.code == m.CLOSE_UNAUTHORIZED:
                raise JoinRefused(f"hub {self.hub_url} sent us away: {msg.reason}{TOKEN_FIX}")
            return HubLeft(msg.code, msg.reason)
        if isinstance(msg, m.LeaseGrant):
            return LeaseGranted(msg, now + msg.deadline_s)
        if isinstance(msg, m.Ack):
            return RolloutAcked(msg.lease_id)
        if isinstance(msg, m.Reject):
            return RolloutRejected(msg.lease_id, msg.reason)
        if isinstance(msg, m.VersionAnnouncement):
            return self._announced(msg)
        if isinstance(msg, m.RelayPlan):
            if self.downloading == (msg.version, msg.base_version):
                return PlanRevised(msg)
        return None  # a heartbeat, or a plan for a download no longer under way

    def _announced(self, msg: m.VersionAnnouncement) -> VersionAnnounced | None:
        manifest = msg.manifest
        if self.welcome.hub_key:  # a manifest we cannot trust is never assembled
            signing.verify_manifest(self.welcome.hub_key, manifest, msg.signature)
        if (msg.plan.version, msg.plan.base_version) != (manifest.version, manifest.base_version):
            raise RemoteProtocolError("a version announced with another's relay plan")
        if self.downloading is not None and self.downloading[0] >= manifest.version:
            return None  # that one, or a newer one, is under way
        self.downloading = None  # the shell drops the older download
        return VersionAnnounced(manifest, msg.plan)

    def download_started(self, manifest: m.Manifest) -> None:
        """The shell is fetching `manifest` (after a `VersionAnnounced`)."""
        self.downloading = (manifest.version, manifest.base_version)

    def download_ended(self, manifest: m.Manifest) -> None:
        """The download of `manifest` ended (complete or given up); a newer one may be under way."""
        if self.downloading == (manifest.version, manifest.base_version):
            self.downloading = None

    def send(self, msg: m.Message) -> bytes:
        """The frame for `msg`, after checking the session allows it."""
        return self.session.send(msg)
