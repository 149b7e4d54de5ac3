"""What the hub counts: `Counters`, running totals the core's parts bump as things happen
(admitted groups, refusals, peers closed for protocol faults, relay reports...). The learner
loop logs them every step, and a checkpoint keeps them (`state`, `restore`), so a resumed run's
totals go on from its checkpoint's. No clock, no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Counters:
    admitted_groups: int = 0
    admitted_samples: int = 0
    stale_on_arrival: int = 0
    rejected: int = 0
    duplicates: int = 0
    closed_for_protocol: int = 0
    refused: int = 0  # joins without a valid token, or from an address with its share joined
    joins_too_often: int = 0  # connections and hellos refused by the join limits (join_limits)
    cut_off: int = 0  # peers that stopped reading
    closed_for_flooding: int = 0  # of closed_for_protocol, for a kind of frame far past its rate
    spot_checked: int = 0  # submissions whose logprobs or version tag were checked
    spot_failed: int = 0  # of those, forged (see hub.learning.spotcheck)
    withdrawn_groups: int = 0  # admitted, then taken from the queue: their peer was quarantined
    leases_expired: int = 0  # leases whose connected holder let them run out (hub.core.leasing)
    forged_passes: int = 0  # completions whose program tried to forge its tests' verdict
    scoring_refused: int = 0  # rollouts refused unscored: their peer was over its scoring budget
    relay_reports: Counter[tuple[str, str]] = field(default_factory=Counter)  # (peer, reason)
    stale_lags: Counter[int] = field(default_factory=Counter)  # lag in versions -> stale on arrival
    # Every group turned away, by reason: `rejected` ones and stale ones (`hub.core.admission`).
    rejected_by: Counter[str] = field(default_factory=Counter)
    frames_dropped: Counter[str] = field(default_factory=Counter)  # kind -> past its rate

    def totals(self) -> dict[str, int]:
        """The running totals (the histograms left out), as `HubStatistics` takes them."""
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}

    def state(self) -> dict[str, Any]:
        """Every total and histogram, as msgpack-able data (for a checkpoint)."""
        return {**self.totals(), "rejected_by": dict(self.rejected_by),
                "stale_lags": dict(self.stale_lags), "frames_dropped": dict(self.frames_dropped),
                "relay_reports": [[*key, n] for key, n in self.relay_reports.items()]}

    def restore(self, state: dict[str, Any]) -> None:
        """Take up the totals `state()` gave, in a fresh hub's counters (a name this hub no
        longer counts is passed over)."""
        for name, value in state.items():
            if name in self.totals() and isinstance(value, int):
                setattr(self, name, value)
        self.rejected_by.update(state.get("rejected_by", {}))
        self.frames_dropped.update(state.get("frames_dropped", {}))
        self.stale_lags.update({int(k): n for k, n in state.get("stale_lags", {}).items()})
        self.relay_reports.update({(peer, reason): n
                                   for peer, reason, n in state.get("relay_reports", [])})
