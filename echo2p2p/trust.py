"""Trust in peers: a score per identity, lowered by evidence of lying, and quarantine below a
threshold.

Pure bookkeeping; the hub decides what counts as evidence and what quarantine does (no leases,
rollouts rejected, relays avoided). A score starts at 1, loses a fixed penalty per event, and
regains a little per rollout whose logprobs a spot-check confirmed, never above 1 (only checked
rollouts earn credit: unchecked ones would let a forger caught on a small sampled share earn
back each penalty in between). Once below the threshold an
identity stays quarantined for the run: a liar that behaves for a while must not earn its way
back to poisoning batches. Identities are what the hub can tell apart: a join token's id when
tokens are required (a peer cannot shed its record by reconnecting), else a connection's id.

The record also sets how often an identity's rollouts are spot-checked (`check_fraction`): a
new identity, or one with a trust event, is checked on every rollout until it has passed a
probation of checks, then less and less often, down to the hub's base rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EVENTS = ("reward_mismatch", "logprob_mismatch", "bad_chunk", "text_mismatch", "false_report",
          "observation_mismatch", "lease_expired", "bad_rollout", "forged_pass", "flood")


@dataclass(frozen=True)
class TrustPolicy:
    threshold: float = 0.5
    """Quarantined once the score falls below this."""
    penalties: dict[str, float] = field(default_factory=lambda: {
        "reward_mismatch": 0.2,  # a claimed reward the hub's verifier disagrees with
        "logprob_mismatch": 0.3,  # behaviour logprobs the claimed version does not reproduce
        # The hub fetched the chunk from it itself and the digest failed: proof, not a report
        # (an honest relay serves only chunks it verified), so one quarantines.
        "bad_chunk": 0.6,
        "text_mismatch": 0.2,  # a sample's text is not the decoding of its token ids
        "false_report": 0.3,  # it accused a relay of a corrupt chunk the hub found intact
        # An episode its environment's replay refutes (an observation it did not say, turns
        # after done, an episode cut short): a forged reward by other means.
        "observation_mismatch": 0.2,
        # A lease it let run past its deadline while it had delivered no more groups than it
        # let expire: held from others for nothing (hoarding; see echo2p2p.lease_quota).
        "lease_expired": 0.05,
        # A rollout of ids no engine emits (`bad_tokens`, `bad_turns`): a reject that would
        # otherwise be free, lease after lease.
        "bad_rollout": 0.1,
        # A completion whose program printed its harness's decoy token or exited 0 in the
        # middle of its tests (`echo2p2p.scoring.code`): written to forge a reward.
        "forged_pass": 0.3,
        # A connection closed for sending one kind of message far past its rate
        # (`echo2p2p.frame_budget`): no honest peer comes near it. Two quarantine a token.
        "flood": 0.3,
    })
    credit: float = 0.01
    """Regained per rollout whose spot-check passed."""
    probation_checks: int = 8
    """Spot-checks an identity must pass, since its last trust event, before its rollouts are
    checked less often than every one; times (1 + its trust events so far)."""

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if set(self.penalties) != set(EVENTS) or min(self.penalties.values()) <= 0:
            raise ValueError(f"penalties must be > 0 for exactly {EVENTS}")
        if self.probation_checks < 0:
            raise ValueError(f"probation_checks must be >= 0, got {self.probation_checks}")


def check_fraction(passed: int, events: int, base: float, probation: int) -> float:
    """The share of an identity's rollouts to spot-check, given the checks it `passed` since
    its last trust event and its trust `events` so far: every one until it passed `probation`
    x (1 + events), then `due / passed` (a half after twice as many, ...), never below `base`,
    the hub's rate for peers with a long clean record. `base` 0 (checks off) stays 0.

    A forger's first rollouts are then all checked, so none is trained on unchecked, and a new
    identity (a reconnect, without join tokens) starts over; an honest peer's checks fall off
    as it proves itself: about sqrt(due / (2 n)) of its rollouts near its n-th.
    """
    if base <= 0:
        return 0.0
    due = probation * (1 + events)
    if passed < due:
        return 1.0
    return min(1.0, max(base, due / max(passed, 1)))


class TrustBook:
    """Scores, event counts and the quarantined identities."""

    def __init__(self, policy: TrustPolicy | None = None) -> None:
        self.policy = policy or TrustPolicy()
        self.scores: dict[str, float] = {}
        self.events: dict[str, dict[str, int]] = {}
        self.quarantined: set[str] = set()
        self.passed: dict[str, int] = {}  # spot-checks passed since the identity's last event

    def score(self, who: str) -> float:
        return self.scores.get(who, 1.0)

    def record(self, who: str, event: str) -> bool:
        """Count one `event` against `who`; True if this put it into quarantine."""
        if event not in EVENTS:
            raise ValueError(f"unknown trust event {event!r}")
        counts = self.events.setdefault(who, dict.fromkeys(EVENTS, 0))
        counts[event] += 1
        self.passed.pop(who, None)  # probation starts over
        self.scores[who] = self.score(who) - self.policy.penalties[event]
        if who in self.quarantined or self.scores[who] >= self.policy.threshold:
            return False
        self.quarantined.add(who)
        return True

    def good(self, who: str) -> None:
        """One rollout of `who` checked out."""
        if who in self.quarantined:
            return
        self.passed[who] = self.passed.get(who, 0) + 1
        if who in self.scores:
            self.scores[who] = min(1.0, self.scores[who] + self.policy.credit)

    def check_fraction(self, who: str, base: float) -> float:
        """The share of `who`'s rollouts to spot-check now (`check_fraction`)."""
        return check_fraction(self.passed.get(who, 0), sum(self.events.get(who, {}).values()),
                              base, self.policy.probation_checks)

    def state(self) -> dict:
        """Scores, events and quarantine as plain data (for a checkpoint)."""
        return {"scores": dict(self.scores), "quarantined": sorted(self.quarantined),
                "events": {who: dict(counts) for who, counts in self.events.items()},
                "passed": dict(self.passed)}

    def restore(self, state: dict) -> None:
        self.scores = dict(state["scores"])
        self.events = {who: dict(counts) for who, counts in state["events"].items()}
        self.quarantined = set(state["quarantined"])
        self.passed = dict(state.get("passed", {}))  # absent from checkpoints before it
