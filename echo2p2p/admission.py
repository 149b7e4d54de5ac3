"""What the hub does with a rollout submission before scoring it: a decision, as a value.

`decide_submission` is the first half of admission, pure: given what the lease book said of the
submission's lease, whether its peer is quarantined, the version it claims and the versions the
hub published, it returns one `Decision` (acknowledge a duplicate, repeat a rejection, wait for
the verdict of the first submission, reject an unknown lease, refuse, call the version tag
forged, turn it away as stale, or score it). The hub's core
(`echo2p2p.hub.core.admission`) executes it: re-queues prompts, counts, answers the peer. Checks are
made in this order, and the first that applies decides. No clock, no I/O, no scoring here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .leases import Completion
from .staleness import Verdict, judge


class Action(enum.Enum):
    ACK_DUPLICATE = "ack_duplicate"  # already admitted: acknowledge again, admit nothing
    HOLD = "hold"  # the first submission is being judged: its verdict answers this one too
    REJECT = "reject"  # no open lease of this peer's: nothing to re-queue
    REFUSE = "refuse"  # the lease was open: its prompt goes back, the rollout is rejected
    FORGED = "forged"  # a version the hub never published: rejected and held against the peer
    STALE = "stale"  # the staleness rule turns it away; its prompt goes back
    SCORE = "score"  # take it: score its samples (and perhaps spot-check it)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""  # what the Reject says (or, FORGED, what was forged)


SCORE = Decision(Action.SCORE)


def decide_submission(outcome: Completion, *, lease_open: bool, quarantined: bool,
                      unpublished: bool, step: int, version: int, max_lag: int,
                      can_score: bool, rejected_for: str = "") -> Decision:
    """The decision for one submission (every argument after `outcome` by keyword: three
    are bools, easy to swap unseen).

    `outcome`/`lease_open`: what closing its lease gave (`LeaseBook.complete`); `quarantined`:
    its peer is; `unpublished`: it claims a version the hub never published (see
    `HubProtocol.claims_unpublished`); `step`: the learner's; `can_score`: the hub has the
    run's tokenizer to score token ids with; `rejected_for`: the reason an earlier submission
    of this lease was rejected for (REJECTED: it is rejected again for it)."""
    if outcome is Completion.DUPLICATE:
        return Decision(Action.ACK_DUPLICATE)
    if outcome is Completion.JUDGING:
        return Decision(Action.HOLD)
    if outcome is Completion.REJECTED:
        return Decision(Action.REJECT, rejected_for)
    if not lease_open:
        return Decision(Action.REJECT, outcome.value)
    if quarantined:
        return Decision(Action.REFUSE, "quarantined")
    if unpublished:
        # No honest peer generated with it, so this is caught whether the rollout is sampled
        # for a check or not.
        return Decision(Action.FORGED, "version")
    verdict = judge(step, version, max_lag)
    if verdict is not Verdict.FRESH:
        return Decision(Action.STALE, verdict.value)
    if not can_score:
        return Decision(Action.REFUSE, "unscorable")
    return SCORE
