"""What the hub's overlay parts ask the shell to do beyond sending: work that waits on the world.

The tracker, the seed watch, the catch-up cache and the relay judges (`hub.core.tracker`,
`hub.core.seeding`, `hub.core.catchups`, `hub.core.accusations`) decide; what takes time or a
socket they ask for with these, next to `hub.core.actions`' `Send` and `Record`, and what came
of it comes back through a method of the part that asked:

- `BuildDelta(target, base)`: encode the catch-up delta base -> target.version in a thread
  (`hub.overlay.catchup.build_catch_up`); then `VersionTracker.delta_built(key, snapshot, now)`
  (None: it failed or would not be smaller; the shell logs a failure).
- `WakeAt(when)`: the seed watch's next deadline; call `VersionTracker.tick(now)` at or after
  `when` (an earlier tick is harmless: it looks again).
- `ProbeRelay(peer_id, server_url, version)`: ask the chunk server, then time its uplink
  (`hub.overlay.relay_checks.RelayCheck`); then `Accusations.probed(peer_id, ok, rate_bps)`.
- `CheckRelay(check_id, ...)`: fetch one chunk from an accused relay as a new receiver; then
  `Accusations.relay_checked(check_id, verdict, elapsed_s, now)`.
- `CheckGossip(check_id, ...)`: ask an accused gossip peer for one piece over a link
  (`hub.overlay.gossip_check`); then `Accusations.gossip_checked(check_id, verdict, now)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from echo2p2p import messages as m


@dataclass(frozen=True)
class BuildDelta:
    """Encode the catch-up delta from version `base` to `target` (a `Published` whose kept
    streams hold both); report it under `key` = (base, target.version)."""

    target: Any  # hub.overlay.versions.Published
    base: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.base, self.target.version)


@dataclass(frozen=True)
class WakeAt:
    """Tick the overlay at `when` (the hub's clock): a seed watch deadline falls then."""

    when: float


@dataclass(frozen=True)
class ProbeRelay:
    """Probe the chunk server `server_url` that peer `peer_id` advertised (as its server,
    for `version`), and time its uplink."""

    peer_id: str
    server_url: str
    version: int


@dataclass(frozen=True)
class CheckRelay:
    """Fetch chunk `index` of `manifest` from `accused_id`'s server `server_url` as a receiver
    that joined now; the verdict comes back under `check_id`."""

    check_id: int
    accused_id: str
    server_url: str
    manifest: m.Manifest
    index: int


@dataclass(frozen=True)
class CheckGossip:
    """Ask `accused_id`'s `/gossip` at `server_url` for chunk `index` of `manifest` as a new
    neighbour would; the verdict comes back under `check_id`."""

    check_id: int
    accused_id: str
    server_url: str
    manifest: m.Manifest
    index: int
