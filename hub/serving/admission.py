"""How the hub takes a rollout submission: from lease check to admitted group (or not).

A submission's lease is closed (a resubmission hears the first's verdict, an unknown or expired
one is rejected); a quarantined peer's rollout is rejected; a version the hub never published is a
forged tag; the staleness rule judges the version. Then its samples are parsed once into rows
(`echo2p2p.rows`), and one task per submission scores every sample from its token ids, decoded
as the engines decode (`echo2p2p.completions`), with the task's verifier in the scorer's worker
processes, off the event loop and under a deadline (`echo2p2p.scoring.scorer.Scorer`); the
peer's text and reward are only checked against that. A share of submissions also have their
behaviour logprobs recomputed under the claimed version (`echo2p2p.hub.serving.spotcheck`): every one
of a peer on probation, fewer as its record grows (`echo2p2p.trust.check_fraction`). Nothing is
acknowledged before it is judged. What is admitted is journaled (`echo2p2p.hub.learning.durable`)
before the peer hears of it, so a hub killed after the ack still has it when resumed; so is
the withdrawal of a quarantined peer's groups still queued (`hub.serving.quarantine`). With a reward
that runs the completion's program, the answer leaves no earlier than a fixed time after arrival
(`echo2p2p.hub.serving.held`); a peer past its scoring budget is refused unscored.

What to do with a submission before scoring is decided by `echo2p2p.admission.decide_submission`
(a value); `Admission` executes it, over the collaborators its constructor names (lease book,
buffer, pool, trust guard, quota book, scorer, spot-checker, journal). It never grants leases:
`submit` returns whether lease budget came free, or the judging to run, whose result says so
(the hub dispatches); it never touches a socket (answers go to `PeerConn.post`). Every group it
turns away is counted by its reason (`Counters.rejected_by`) and told in the log, the first of
each reason at once and the rest in a summary at most once a minute (`hub.serving.rejections`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo2p2p import episodes
from echo2p2p import messages as m
from echo2p2p.admission import Action, decide_submission
from echo2p2p.buffer import RolloutBuffer, ScoredGroup
from echo2p2p.lease_quota import LeaseQuota
from echo2p2p.leases import Completion, LeaseBook
from echo2p2p.pool import Pool
from echo2p2p.rows import SampleRow, parse_samples
from echo2p2p.runtime.process import loop_now
from echo2p2p.scoring.scorer import OverBudget
from echo2p2p.staleness import lag_versions

from ..config import HubConfig
from ..learning.durable import group_to_wire
from .held import Held
from .peers import PeerConn
from .quarantine import TrustGuard
from .rejections import RejectionLog

if TYPE_CHECKING:  # hub.spotcheck imports torch, which `echo2-hub --help` must not wait for
    from echo2p2p.scoring.scorer import Scored, Scorer

    from .spotcheck import SpotChecker, SpotResult

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side

# Reject reasons no honest engine earns (docs/protocol/scoring.md, section 10): each costs trust.
BAD_ROLLOUTS = frozenset({"bad_tokens", "bad_turns"})


@dataclass(frozen=True)
class AdmissionRules:
    """What `Admission` reads of the run's config and task."""

    max_lag: int  # S (`echo2p2p.staleness`)
    score_sample_budget_s: float  # a peer's scoring budget per sample (0: none)
    hold_s: float  # answers wait this long after arrival (`hub.serving.held`; 0: at once)
    episodes: bool  # samples are replayed episodes
    peers_score: bool  # peers score the reward too: their claims can be checked
    vocab_size: int | None  # ids at or above it are refused (None: left to the decoder)

    @classmethod
    def of(cls, cfg: HubConfig, setup: Any, vocab_size: int | None) -> AdmissionRules:
        """The rules of a run of `cfg` on `setup` (`hub.tasks.task_setup.TaskSetup`)."""
        # A reward that runs programs: answers wait this long after arrival (`hub.serving.held`).
        hold_s = (cfg.scoring.code_answer_hold_s or cfg.grpo.group_size * cfg.scoring.score_timeout_s) \
            if setup.runs_programs else 0.0
        return cls(cfg.staleness.max_lag, cfg.scoring.score_sample_budget_s, hold_s, bool(setup.env),
                   setup.peers_score, vocab_size)


class Admission:
    """The rollout path: decide, score, spot-check, admit or refuse, over explicit parts."""

    def __init__(self, rules: AdmissionRules, leases: LeaseBook, buffer: RolloutBuffer,
                 pool: Pool, counters: Any, trust: TrustGuard, quota: LeaseQuota, *,
                 scorer: Scorer | None, spot: SpotChecker | None,
                 journal: Callable[..., None], on_event: Callable[[dict[str, Any]], None]):
        """`counters`: the hub's `Counters`; `quota`: the lease standings admissions earn;
        `journal(kind, *record)`: write to the hub's journal; `on_event`: the run log."""
        self.rules, self.leases, self.buffer, self.pool = rules, leases, buffer, pool
        self.counters, self.trust, self.quota = counters, trust, quota
        self.scorer, self.spot = scorer, spot
        self._journal, self._on_event = journal, on_event
        self.rejections = RejectionLog()  # the log lines of `_rejected` (the hub flushes it)
        self.admitted = asyncio.Event()  # set on every admission (Hub.wait_batch clears it)

    def submit(self, conn: PeerConn, msg: m.RolloutSubmission, step: int,
               newest_version: int | None, now: float
               ) -> bool | Coroutine[Any, Any, bool]:
        """Take `msg` from `conn` at learner step `step` (`newest_version`: the newest
        published, None: none yet): decide (`echo2p2p.admission`), then act on the decision.
        Returns whether lease budget came free, or the judging of the submission to run (its
        scoring is queued already), which returns whether it admitted the group."""
        outcome, lease = self.leases.complete(msg.lease_id, conn.peer_id)
        if lease is not None:
            self._measure(conn, lease.granted, len(msg.samples), now)
        decision = decide_submission(
            outcome, lease is not None, self.trust.quarantined(conn),
            conn.protocol.claims_unpublished(msg.version, newest_version),
            step, msg.version, self.rules.max_lag, self.scorer is not None,
            self.leases.verdict(msg.lease_id) or "")
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
                           if outcome is Completion.REJECTED else decision.reason)
            conn.post(m.Reject(msg.lease_id, decision.reason))
        elif action is Action.REFUSE:
            if decision.reason == "unscorable":  # a hub built without the run's tokenizer
                log.error("rollout %s refused: this hub has no decoder to score token ids",
                          msg.lease_id)
            self._refuse(conn, lease, decision.reason)
        elif action is Action.FORGED:
            self.counters.spot_checked += 1
            self._forged(conn, lease, decision.reason, {"version": msg.version})
            return True
        elif action is Action.STALE:
            self.leases.requeue(lease, decision.reason)
            self.counters.stale_on_arrival += 1
            self.counters.stale_lags[lag_versions(step, msg.version)] += 1
            self._rejected(conn, msg.lease_id, decision.reason)
            conn.post(m.Reject(msg.lease_id, decision.reason))
            return True
        else:
            return self._score(conn, lease, msg)
        return False

    def over_budget(self, conn: PeerConn) -> bool:
        """`conn`'s samples took more than `score_sample_budget_s` each lately, while other
        peers score too (`echo2p2p.scoring.fairness`): its rollouts are refused unscored, and
        the hub grants it no leases, until what it used has decayed."""
        budget_s = self.rules.score_sample_budget_s
        return bool(self.scorer is not None and budget_s
                    and self.scorer.over_budget(conn.identity, budget_s))

    def _score(self, conn: PeerConn, lease: Any, msg: m.RolloutSubmission
               ) -> bool | Coroutine[Any, Any, bool]:
        rows = parse_samples(msg.samples, self.rules.vocab_size)  # parsed and validated once
        if isinstance(rows, str):
            self._refuse(conn, lease, rows)
            return False
        if self.over_budget(conn):
            self.counters.scoring_refused += 1  # its samples burnt the scorers' time lately
            self._refuse(conn, lease, "scoring_budget")
            return False
        # Queued for scoring now (a task would start it an event loop turn later), in the
        # peer's own queue (the scorer serves the peer that used least first).
        scoring = self.scorer.submit_ids(lease.problem.problem,
                                         [s.token_ids for s in msg.samples],
                                         [s.text for s in msg.samples],
                                         [s.turns for s in msg.samples]
                                         if self.rules.episodes else None,
                                         owner=conn.identity)
        pending = None
        if self.spot is not None and self.spot.wants(
                self.trust.check_fraction(conn, self.spot.fraction)):
            # The claimed version's weights are taken now, not once scored (they may rotate out).
            pending = self.spot.check(_unscored(lease, msg, rows))
        # One judging per submission, scoring then spot-checking; no ack until both are done.
        # The hub runs it as a task, which holds lease budget meanwhile.
        hold_s = self.rules.hold_s
        return self._judge(Held(conn, hold_s) if hold_s else conn, lease, msg, rows, scoring,
                           pending)

    async def _judge(self, conn: PeerConn, lease: Any, msg: m.RolloutSubmission,
                     rows: tuple[SampleRow, ...], scoring: asyncio.Future[Scored],
                     pending: Coroutine[Any, Any, SpotResult] | None) -> bool:
        """Await `scoring`, `msg`'s samples scored from their token ids in the scorer's worker
        processes, then, if sampled, `pending`, its spot-check; admit what passes (True). The
        peer may have left meanwhile: a group that checks out is still admitted."""
        problem = lease.problem.problem
        try:
            scored = await scoring
        except OverBudget:  # its peer's samples burnt the scorer's time while this one waited
            if pending is not None:
                pending.close()
            self.counters.scoring_refused += 1
            self._refuse(conn, lease, "scoring_budget")
            return False
        except BaseException:
            if pending is not None:
                pending.close()
            self.leases.requeue(lease)  # not judged (shutdown, or a bug): the prompt goes back
            raise
        if scored.malformed or scored.faults:  # ids no engine emits (out of vocabulary, after
            if pending is not None:  # the EOS), or an episode its environment refutes
                pending.close()
            if set(scored.faults) & episodes.LIES:
                self.trust.distrust(conn, "observation_mismatch")
            self._refuse(conn, lease, scored.faults[0] if scored.faults else "bad_tokens")
            return False
        truthful = self._lies_counted(conn, msg, scored)
        if self.trust.quarantined(conn):  # by these lies, or by another submission meanwhile
            if pending is not None:
                pending.close()
            self._refuse(conn, lease, "quarantined")
            return False
        if pending is not None:
            try:
                result = await pending
            except BaseException:
                self.leases.requeue(lease)
                raise
            self.counters.spot_checked += 1
            if not result.passed:
                self._forged(conn, lease, result.reason, result.detail())
                return False
            if self.trust.quarantined(conn):  # by another of its rollouts while this one was checked
                self._refuse(conn, lease, "quarantined")
                return False
            if truthful and result.tokens:  # a version too old to check earns nothing
                self.trust.good(conn)
        self._admit(conn, ScoredGroup(msg.lease_id, problem.id, lease.problem.prompt_ids,
                                      msg.version, rows, scored.rewards))
        return True

    def _lies_counted(self, conn: PeerConn, msg: m.RolloutSubmission, scored: Scored) -> bool:
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

    def _forged(self, conn: PeerConn, lease: Any, reason: str, detail: dict[str, Any]) -> None:
        """A rollout its claimed version does not reproduce ("logprob"), or with a version this
        hub never published ("version"): rejected, its prompt re-queued, a run log record, and
        a logprob_mismatch against the peer's trust (budget came free: the hub dispatches)."""
        self.counters.spot_failed += 1
        self._refuse(conn, lease, "logprob_mismatch" if reason == "logprob" else reason)
        record = {"event": "spot_check", "peer": conn.peer_id,
                  "name": conn.hello.name, "identity": conn.identity, "lease_id": lease.lease_id,
                  "reason": reason, **detail}
        log.warning("%s (%s) failed a spot-check of %s: %s %s", conn.peer_id, conn.hello.name,
                    lease.lease_id, reason, detail)
        self._on_event(record)
        self.trust.distrust(conn, "logprob_mismatch")

    def _refuse(self, conn: PeerConn, lease: Any, reason: str) -> None:
        """Reject `lease`'s rollout for `reason`; its prompt goes back to the queue, for others.
        Ids no engine emits cost trust: a free reject would let a peer take lease after lease
        and keep the scorer busy for nothing."""
        self.leases.requeue(lease, reason)
        self.counters.rejected += 1
        self._rejected(conn, lease.lease_id, reason)
        conn.post(m.Reject(lease.lease_id, reason))
        if reason in BAD_ROLLOUTS:
            self.trust.distrust(conn, "bad_rollout")

    def _rejected(self, conn: PeerConn, lease_id: str, reason: str) -> None:
        """A group of `conn`'s was turned away for `reason`: counted by it, and told."""
        self.counters.rejected_by[reason] += 1
        self.rejections.rejected(reason, lease_id, conn.peer_id, loop_now())

    def _admit(self, conn: PeerConn, group: ScoredGroup) -> None:
        """Queue `group` for the learner and acknowledge it, journaled first."""
        self._journal("admit", group_to_wire(group), conn.identity)
        log.debug("admitted %s (v%d) from %s", group.lease_id, group.version, conn.peer_id)
        self.buffer.put(group, conn.identity)  # withdrawn if the identity is quarantined
        self.leases.admitted(group.lease_id)
        # Progress (a group that passed, not any submission: a peer cannot keep leases alive
        # by sending rubbish): its queued leases are due a timeout from now.
        self.leases.renew(conn.peer_id, loop_now())
        self.quota.delivered(conn.identity, conn.address_key)
        self.counters.admitted_groups += 1
        self.counters.admitted_samples += len(group.samples)
        self.pool.admitted(conn.peer_id, len(group.samples), loop_now())
        self.admitted.set()
        conn.post(m.Ack(group.lease_id))

    def _measure(self, conn: PeerConn, granted: float, samples: int, now: float) -> None:
        """The peer's generation rate from this submission: its samples over the time it spent
        on them. A peer works through its leases one at a time, so that time started when the
        lease was granted or when its previous submission arrived, whichever is later; idle time
        waiting for leases does not count, so the rate is what the peer can do, not what the
        hub happened to ask of it."""
        busy_s = conn.protocol.busy_s(granted, now)
        if busy_s >= 0 and samples:  # a ratio of window sums (`echo2p2p.rates`), never of one
            self.pool.rate(conn.peer_id, samples, busy_s, now)


def _unscored(lease: Any, msg: m.RolloutSubmission, rows: tuple[SampleRow, ...]) -> ScoredGroup:
    """`msg` as a group for its spot-check, which reads everything but the rewards."""
    return ScoredGroup(msg.lease_id, lease.problem.problem.id, lease.problem.prompt_ids,
                       msg.version, rows, [])

