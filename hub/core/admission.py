"""How the hub takes a rollout submission: from lease check to admitted group (or not).

A submission's lease is closed (a resubmission hears the first's verdict, an unknown or expired
one is rejected); a quarantined peer's rollout is rejected; a version the hub never published is a
forged tag; the staleness rule judges the version. Then its samples are parsed once into rows
(`echo2p2p.rows`) and the core asks the shell to score every sample from its token ids with the
task's verifier (a `Score` action: the scorer's worker processes, off the event loop and under a
deadline); the peer's text and reward are only checked against that. A share of submissions
also have their behaviour logprobs recomputed under the claimed version (a `SpotCheck`): every
one of a peer on probation, fewer as its record grows (`echo2p2p.trust.check_fraction`).

A submission being judged is state here, keyed by its lease id (`Judging`), until both its
`ScoringFinished` and (if sampled) its `SpotCheckFinished` came: nothing is acknowledged before
it is judged. What is admitted is journaled (a `Journal` action) before the peer hears of it, so
a hub killed after the ack still has it when resumed. With a reward that runs the completion's
program, every answer to a judged submission carries `not_before` = its arrival + `hold_s`: an
answer sent as soon as judged would tell its sender how long its programs ran (a program that
sleeps on one bit of something it read leaks that bit per rollout). A peer past its scoring
budget is refused unscored.

What to do with a submission before scoring is decided by `echo2p2p.admission.decide_submission`
(a value); `Admission` carries it out. Its methods return whether lease budget came free (the
core then runs a lease pass). Every group it turns away is counted by its reason
(`Counters.rejected_by`) and told in the log, the first of each reason at once and the rest in a
summary at most once a minute (`hub.core.rejections`).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Protocol

from echo2p2p import episodes
from echo2p2p import messages as m
from echo2p2p.admission import Action, decide_submission
from echo2p2p.buffer import RolloutBuffer, ScoredGroup
from echo2p2p.lease_quota import LeaseQuota
from echo2p2p.leases import Completion, Lease, LeaseBook
from echo2p2p.pool import Pool
from echo2p2p.rows import SampleRow, parse_samples
from echo2p2p.staleness import lag_versions
from echo2p2p.tasks import Problem

from ..config import HubConfig
from .actions import Journal, Outbox, Record, Score, SpotCheck, SpotCheckDropped
from .counters import Counters
from .events import ScoringFinished, SpotCheckFinished
from .peer import Peer
from .quarantine import TrustGuard
from .rejections import RejectionLog

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side

# Reject reasons no honest engine earns (docs/protocol/scoring.md, section 10): each costs trust.
BAD_ROLLOUTS = frozenset({"bad_tokens", "bad_turns"})


class Prompt(Protocol):
    """What a lease hands out (`hub.tasks.task_setup.TokenizedProblem`): the task's problem and
    its prompt's token ids."""

    problem: Problem
    prompt_ids: list[int]


class ScoringLedger(Protocol):
    """How much of the scorers' time each owner used lately (`echo2p2p.scoring.scorer.Scorer`)."""

    def over_budget(self, owner: str, per_item_s: float) -> bool: ...


@dataclass(frozen=True)
class AdmissionRules:
    """What `Admission` reads of the run's config and task."""

    max_lag: int  # S (`echo2p2p.staleness`)
    score_sample_budget_s: float  # a peer's scoring budget per sample (0: none)
    hold_s: float  # answers to a judged rollout leave this long after arrival (0: at once)
    episodes: bool  # samples are replayed episodes
    peers_score: bool  # peers score the reward too: their claims can be checked
    vocab_size: int | None  # ids at or above it are refused (None: left to the decoder)
    spot_fraction: float | None  # a clean record's share of spot-checks (None: no checker)
    spot_tolerance: float = 0.0  # the bar a checked group stays under (0: no checker), told peers

    @classmethod
    def of(cls, cfg: HubConfig, *, runs_programs: bool, episodes: bool, peers_score: bool,
           vocab_size: int | None, spot_checks: bool) -> AdmissionRules:
        """The rules of a run of `cfg` on a task that `runs_programs` (its answers are held),
        replays `episodes`, whose `peers_score`; `spot_checks`: the hub has a checker."""
        hold_s = (cfg.scoring.code_answer_hold_s
                  or cfg.grpo.group_size * cfg.scoring.score_timeout_s) if runs_programs else 0.0
        return cls(cfg.staleness.max_lag, cfg.scoring.score_sample_budget_s, hold_s, episodes,
                   peers_score, vocab_size,
                   cfg.trust.spot_check_fraction if spot_checks else None,
                   cfg.trust.spot_check_tolerance if spot_checks else 0.0)


@dataclass
class Judging:
    """A submission being judged: what came in, and what came of it so far."""

    peer: Peer
    lease: Lease[Prompt]
    msg: m.RolloutSubmission
    rows: tuple[SampleRow, ...]
    not_before: float  # its answers leave no earlier (`AdmissionRules.hold_s`)
    spot: bool  # a spot-check was asked for
    scored: ScoringFinished | None = None
    checked: SpotCheckFinished | None = None
    truthful: bool = True  # its texts and claims matched the verifier's


class Admission:
    """The rollout path: decide, ask for scoring and a spot-check, admit or refuse."""

    def __init__(self, rules: AdmissionRules, leases: LeaseBook[Prompt], buffer: RolloutBuffer,
                 pool: Pool, counters: Counters, trust: TrustGuard, quota: LeaseQuota,
                 outbox: Outbox, *, scoring: ScoringLedger | None, seed: int):
        """`quota`: the lease standings admissions earn; `scoring`: the scorer's ledger (None:
        a hub that cannot score, e.g. a broadcast bench); `seed`: the spot-checks' draw."""
        self.rules, self.leases, self.buffer, self.pool = rules, leases, buffer, pool
        self.counters, self.trust, self.quota, self.outbox = counters, trust, quota, outbox
        self.scoring = scoring
        self.judging: dict[str, Judging] = {}  # by lease id
        self.rejections = RejectionLog()  # the log lines of `_rejected` (the core flushes it)
        self._draw = random.Random(seed)  # which submissions are spot-checked

    def submit(self, conn: Peer, msg: m.RolloutSubmission, step: int,
               newest_version: int | None, now: float) -> bool:
        """Take `msg` from `conn` at learner step `step` (`newest_version`: the newest
        published, None: none yet): decide (`echo2p2p.admission`), then act on the decision.
        Returns whether lease budget came free."""
        outcome, lease = self.leases.complete(msg.lease_id, conn.peer_id)
        if lease is not None:
            self._measure(conn, lease.granted, len(msg.samples), now)
        decision = decide_submission(
            outcome, lease_open=lease is not None, quarantined=self.trust.quarantined(conn),
            unpublished=conn.protocol.claims_unpublished(msg.version, newest_version),
            step=step, version=msg.version, max_lag=self.rules.max_lag,
            can_score=self.scoring is not None,
            rejected_for=self.leases.verdict(msg.lease_id) or "")
        action = decision.action
        if action is Action.ACK_DUPLICATE:
            self.counters.duplicates += 1
            conn.post(m.Ack(msg.lease_id, duplicate=True))
        elif action is Action.HOLD:  # no answer now: the first submission's verdict is it
            self.counters.duplicates += 1
        elif action is Action.REJECT:
            self.counters.rejected += 1
            # A resubmission hears the first one's reason again, but that group was counted.
            self._rejected(conn, msg.lease_id, "already_rejected"
                           if outcome is Completion.REJECTED else decision.reason, now)
            conn.post(m.Reject(msg.lease_id, decision.reason))
        elif action is Action.REFUSE:
            if decision.reason == "unscorable":  # a hub built without the run's tokenizer
                log.error("rollout %s refused: this hub has no decoder to score token ids",
                          msg.lease_id)
            self._refuse(conn, lease, decision.reason, now)
        elif action is Action.FORGED:
            self.counters.spot_checked += 1
            self._forged(conn, lease, decision.reason, {"version": msg.version}, now)
            return True
        elif action is Action.STALE:
            self.leases.requeue(lease, decision.reason)
            self.counters.stale_on_arrival += 1
            self.counters.stale_lags[lag_versions(step, msg.version)] += 1
            self._rejected(conn, msg.lease_id, decision.reason, now)
            conn.post(m.Reject(msg.lease_id, decision.reason))
            return True
        else:
            self._score(conn, lease, msg, now)
        return False

    def over_budget(self, conn: Peer) -> bool:
        """`conn`'s samples took more than `score_sample_budget_s` each lately, while other
        peers score too (`echo2p2p.scoring.fairness`): its rollouts are refused unscored, and
        the hub grants it no leases, until what it used has decayed."""
        budget_s = self.rules.score_sample_budget_s
        return bool(self.scoring is not None and budget_s
                    and self.scoring.over_budget(conn.identity, budget_s))

    def _score(self, conn: Peer, lease: Lease[Prompt], msg: m.RolloutSubmission,
               now: float) -> None:
        rows = parse_samples(msg.samples, self.rules.vocab_size)  # parsed and validated once
        if isinstance(rows, str):
            return self._refuse(conn, lease, rows, now)
        if self.over_budget(conn):
            self.counters.scoring_refused += 1  # its samples burnt the scorers' time lately
            return self._refuse(conn, lease, "scoring_budget", now)
        # Scored in the peer's own queue (the scorer serves the peer that used least first).
        self.outbox.emit(Score(lease.lease_id, conn.identity, lease.item.problem,
                               tuple(s.token_ids for s in msg.samples),
                               tuple(s.text for s in msg.samples),
                               tuple(s.turns for s in msg.samples)
                               if self.rules.episodes else None))
        fraction = self.rules.spot_fraction
        spot = fraction is not None and \
            self._draw.random() < self.trust.check_fraction(conn, fraction)
        if spot:  # the claimed version's weights are taken now, not once scored (they rotate)
            self.outbox.emit(SpotCheck(lease.lease_id, ScoredGroup(
                msg.lease_id, lease.item.problem.id, lease.item.prompt_ids, msg.version, rows, [])))
        self.judging[lease.lease_id] = Judging(conn, lease, msg, rows, now + self.rules.hold_s,
                                               spot)

    def scored(self, event: ScoringFinished, now: float) -> bool:
        """Submission `event.lease_id`'s samples were scored: judge on; whether budget came
        free. (A judged submission's peer may have left: a group that checks out is still
        admitted.)"""
        judging = self.judging.get(event.lease_id)
        if judging is None or judging.scored is not None:
            return False
        judging.scored = event
        conn, lease = judging.peer, judging.lease
        if event.error == "failed":  # not judged (shutdown, or a bug): the prompt goes back
            self._drop(judging)
            self.leases.requeue(lease)
            return True
        if event.error == "over_budget":  # its peer's samples burnt the scorers' time meanwhile
            self.counters.scoring_refused += 1
            return self._refused(judging, "scoring_budget", now)
        if event.malformed or event.faults:  # ids no engine emits (out of vocabulary, after
            if set(event.faults) & episodes.LIES:  # the EOS), or an episode its environment refutes
                self.trust.distrust(conn, "observation_mismatch")
            return self._refused(judging, event.faults[0] if event.faults else "bad_tokens", now)
        judging.truthful = self._lies_counted(conn, judging.msg, event)
        if self.trust.quarantined(conn):  # by these lies, or by another submission meanwhile
            return self._refused(judging, "quarantined", now)
        return self._verdict(judging, now)

    def spot_checked(self, event: SpotCheckFinished, now: float) -> bool:
        """Submission `event.lease_id`'s spot-check finished: judge on if it was scored."""
        judging = self.judging.get(event.lease_id)
        if judging is None or not judging.spot or judging.checked is not None:
            return False
        judging.checked = event
        return self._verdict(judging, now) if judging.scored is not None else False

    def _verdict(self, judging: Judging, now: float) -> bool:
        """Scored and truthful: admit, unless a spot-check is still to come or failed."""
        conn, lease, checked = judging.peer, judging.lease, judging.checked
        if judging.spot:
            if checked is None:
                return False  # its spot-check decides
            if checked.reason == "failed":
                self.judging.pop(lease.lease_id)
                self.leases.requeue(lease)
                return True
            self.counters.spot_checked += 1
            if checked.reason is not None:
                self.judging.pop(lease.lease_id)
                self._forged(conn, lease, checked.reason, checked.detail, now, judging.not_before)
                return True
            if self.trust.quarantined(conn):  # by another of its rollouts meanwhile
                return self._refused(judging, "quarantined", now)
            if judging.truthful and checked.tokens:  # a version too old to check earns nothing
                self.trust.good(conn)
        self.judging.pop(lease.lease_id)
        self._admit(judging, now)
        return False

    def _refused(self, judging: Judging, reason: str, now: float) -> bool:
        """Refuse a submission being judged (its spot-check, if any, is no longer wanted)."""
        self._drop(judging)
        self._refuse(judging.peer, judging.lease, reason, now, judging.not_before)
        return True

    def _drop(self, judging: Judging) -> None:
        self.judging.pop(judging.lease.lease_id, None)
        if judging.spot and judging.checked is None:
            self.outbox.emit(SpotCheckDropped(judging.lease.lease_id))

    def _lies_counted(self, conn: Peer, msg: m.RolloutSubmission, scored: ScoringFinished) -> bool:
        """Distrust `conn` for each lie `scored` shows; whether it told none. The hub scores the
        decoding of the ids it will train on: a peer's text and claimed reward are never used.
        A text that is not that decoding is a lie (once per submission), and so is a claim
        above the verifier's. (A claim below it is no gain to a liar, and an honest peer whose
        checker lacks math-verify can make one.)"""
        honest = not scored.mismatched
        if not honest:
            self.trust.distrust(conn, "text_mismatch")
        fair = not self.rules.peers_score or not any(s.reward > r + 1e-6
                                                     for s, r in zip(msg.samples, scored.rewards))
        if not fair:
            self.trust.distrust(conn, "reward_mismatch")
        if scored.forged:  # a program written to forge its tests' verdict: scored 0 already
            self.counters.forged_passes += scored.forged
            self.trust.distrust(conn, "forged_pass")
        return honest and fair

    def _forged(self, conn: Peer, lease: Lease[Prompt], reason: str, detail: dict[str, object],
                now: float, not_before: float = 0.0) -> None:
        """A rollout its claimed version does not reproduce ("logprob"), or with a version this
        hub never published ("version"): rejected, its prompt re-queued, a run log record, and
        a logprob_mismatch against the peer's trust."""
        self.counters.spot_failed += 1
        self._refuse(conn, lease, "logprob_mismatch" if reason == "logprob" else reason, now,
                     not_before)
        record = {"event": "spot_check", "peer": conn.peer_id,
                  "name": conn.hello.name, "identity": conn.identity, "lease_id": lease.lease_id,
                  "reason": reason, **detail}
        log.warning("%s (%s) failed a spot-check of %s: %s %s", conn.peer_id, conn.hello.name,
                    lease.lease_id, reason, detail)
        self.outbox.emit(Record(record, dated=True))
        self.trust.distrust(conn, "logprob_mismatch")

    def _refuse(self, conn: Peer, lease: Lease[Prompt], reason: str, now: float,
                not_before: float = 0.0) -> None:
        """Reject `lease`'s rollout for `reason`; its prompt goes back to the queue, for others.
        Ids no engine emits cost trust: a free reject would let a peer take lease after lease
        and keep the scorer busy for nothing."""
        self.leases.requeue(lease, reason)
        self.counters.rejected += 1
        self._rejected(conn, lease.lease_id, reason, now)
        conn.post(m.Reject(lease.lease_id, reason), not_before)
        if reason in BAD_ROLLOUTS:
            self.trust.distrust(conn, "bad_rollout")

    def _rejected(self, conn: Peer, lease_id: str, reason: str, now: float) -> None:
        """A group of `conn`'s was turned away for `reason`: counted by it, and told."""
        self.counters.rejected_by[reason] += 1
        self.rejections.rejected(reason, lease_id, conn.peer_id, now)

    def _admit(self, judging: Judging, now: float) -> None:
        """Queue the judged group for the learner and acknowledge it, journaled first."""
        conn, lease, msg = judging.peer, judging.lease, judging.msg
        group = ScoredGroup(msg.lease_id, lease.item.problem.id, lease.item.prompt_ids,
                            msg.version, judging.rows, list(judging.scored.rewards))
        self.outbox.emit(Journal(("admit", group, conn.identity)))  # the shell writes it as wire
        log.debug("admitted %s (v%d) from %s", group.lease_id, group.version, conn.peer_id)
        self.buffer.put(group, conn.identity)  # withdrawn if the identity is quarantined
        self.leases.admitted(group.lease_id)
        # Progress (a group that passed, not any submission: a peer cannot keep leases alive
        # by sending rubbish): its queued leases are due a timeout from now.
        self.leases.renew(conn.peer_id, now)
        self.quota.delivered(conn.identity, conn.address_key)
        self.counters.admitted_groups += 1
        self.counters.admitted_samples += len(group.samples)
        self.pool.admitted(conn.peer_id, len(group.samples), now)
        conn.post(m.Ack(group.lease_id), judging.not_before)

    def _measure(self, conn: Peer, granted: float, samples: int, now: float) -> None:
        """The peer's generation rate from this submission: its samples over the time it spent
        on them. A peer works through its leases one at a time, so that time started when the
        lease was granted or when its previous submission arrived, whichever is later; idle time
        waiting for leases does not count, so the rate is what the peer can do, not what the
        hub happened to ask of it."""
        busy_s = conn.protocol.busy_s(granted, now)
        if busy_s >= 0 and samples:  # a ratio of window sums (`echo2p2p.rates`), never of one
            self.pool.rate(conn.peer_id, samples, busy_s, now)

