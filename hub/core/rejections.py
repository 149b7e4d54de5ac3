"""Rejected groups, told to the user: the first of each reason at once, then a summary at most
every `every_s` seconds.

Every rollout the hub turns away is counted by its reason (`Counters.rejected_by`, which
`Hub.statistics()`, /metrics' `echo2_groups_rejected_total{reason=...}` and the step record
show). A run that rejects a third of its groups must say so in the terminal, but a peer that
floods bad rollouts must not flood the log: `RejectionLog` logs the first rejection of each
reason at INFO with what it means and what to do, and counts the later ones into one summary
line, written when a rejection or a `flush` (the hub's lease timer, about every second) finds
`every_s` passed since the last. The clock comes in as `now`; logging is its only I/O.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("echo2p2p.hub.serving.server")  # the hub's peer-facing logger

SUMMARY_EVERY_S = 60.0

# What a reason means, for the first line of it (a reason not here is logged as it is).
MEANINGS = {
    "expired": "its lease ran past its deadline before the group arrived (slow engine? raise "
               "lease_timeout_s)",
    "unknown_lease": "no open lease of this peer's has that id",
    "already_rejected": "a resubmission of a group rejected before",
    "stale": "its version lags the learner by more than max_lag",
    "future": "it claims a version the learner has not produced",
    "version": "it claims a version this hub never published",
    "quarantined": "its peer is quarantined",
    "unscorable": "this hub has no tokenizer to score token ids with",
    "bad_sample": "torn arrays, no tokens or impossible logprobs",
    "bad_tokens": "token ids no engine emits",
    "scoring_budget": "its peer's samples used more than their share of the scorers",
    "logprob_mismatch": "its logprobs failed the spot-check against the claimed version",
}


class RejectionLog:
    """Rate-limited INFO lines about rejected groups (see the module docstring)."""

    def __init__(self, every_s: float = SUMMARY_EVERY_S):
        self.every_s = every_s
        self.seen: set[str] = set()
        self.since: Counter[str] = Counter()  # rejections not told yet, by reason
        self.last_summary = float("-inf")

    def rejected(self, reason: str, lease_id: str, peer_id: str, now: float) -> None:
        """A group was rejected for `reason`: its first is told now, the others summed."""
        if reason not in self.seen:
            self.seen.add(reason)
            log.info("rejected %s from %s: %s%s (the first for this reason; later ones are "
                     "summed every %.0f s)", lease_id, peer_id, reason,
                     f" -- {MEANINGS[reason]}" if reason in MEANINGS else "", self.every_s)
            if self.last_summary == float("-inf"):
                self.last_summary = now
            return
        self.since[reason] += 1
        self.flush(now)

    def flush(self, now: float) -> None:
        """Write the summary of the rejections not told yet, if `every_s` passed since the last."""
        if self.since and now - self.last_summary >= self.every_s:
            told = ", ".join(f"{reason} {n}" for reason, n in self.since.most_common())
            log.info("rejected %d more groups in the last %.0f s: %s", sum(self.since.values()),
                     now - self.last_summary, told)
            self.since.clear()
            self.last_summary = now
