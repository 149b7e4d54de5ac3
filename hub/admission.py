"""How the hub takes a rollout submission: from lease check to admitted group (or not).

A submission's lease is closed (a duplicate is acknowledged again, an unknown or expired one
rejected); a quarantined peer's rollout is rejected; a version the hub never published is a
forged tag; the staleness rule judges the version. Then one task per submission scores every
sample from its token ids, decoded as the engines decode (`echo2p2p.completions`), with the
task's verifier in the scorer's worker processes, off the event loop and under a deadline
(`echo2p2p.scoring.scorer.Scorer`); the peer's text and reward are only checked against that. A share
of submissions also have their behaviour logprobs recomputed under the claimed version
(`echo2p2p.hub.spotcheck`). Nothing is acknowledged before it is judged. What is admitted is journaled
(`echo2p2p.hub.durable`) before the peer hears of it, so a hub killed after the ack still has it when
resumed.

`Admission` is a part of `echo2p2p.hub.server.Hub`, kept apart so that each file reads as one concern; it
uses the hub's lease book, buffer, trust book, pool, scorer, spot-checker and journal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from echo2p2p import messages as m
from echo2p2p.buffer import ScoredGroup
from echo2p2p.leases import Completion
from echo2p2p.staleness import Verdict, judge

from .durable import group_from_wire, group_to_wire
from .peers import PeerConn

if TYPE_CHECKING:  # hub.spotcheck imports torch, which `echo2-hub --help` must not wait for
    from echo2p2p.scoring.scorer import Scored

    from .spotcheck import SpotResult

log = logging.getLogger("echo2p2p.hub.server")  # one logger for the hub's peer-facing side


class Admission:
    """The rollout path and the checkpointed state of `echo2p2p.hub.server.Hub`."""

    def _on_rollout(self, conn: PeerConn, msg: m.RolloutSubmission) -> None:
        outcome, lease = self.leases.complete(msg.lease_id, conn.peer_id)
        if outcome is Completion.DUPLICATE:
            self.counters.duplicates += 1
            conn.post(m.Ack(msg.lease_id, duplicate=True))
            return
        if lease is None:
            self.counters.rejected += 1
            conn.post(m.Reject(msg.lease_id, outcome.value))
            return
        self._measure(conn, lease.granted, len(msg.samples))
        if self._quarantined(conn):
            self._refuse(conn, lease, "quarantined")
            return
        newest = self.newest
        if newest is not None and msg.version > max(newest.version, conn.held_max):
            # Never published: no honest peer generated with it, so this is caught whether the
            # rollout is sampled for a check or not. (A version the peer said it holds may be
            # one a hub resumed from an older checkpoint had published: staleness judges it.)
            self.counters.spot_checked += 1
            self._forged(conn, lease, "version", {"version": msg.version})
            return
        verdict = judge(self.step, msg.version, self.cfg.max_lag)
        if verdict is not Verdict.FRESH:
            self.leases.requeue(lease)
            self.counters.stale_on_arrival += 1
            conn.post(m.Reject(msg.lease_id, verdict.value))
            self.dispatch()
            return
        if self.scorer is None:  # a hub built without the run's tokenizer cannot score ids
            log.error("rollout %s refused: this hub has no decoder to score token ids",
                      msg.lease_id)
            self._refuse(conn, lease, "unscorable")
            return
        # Queued for scoring now (a task would start it an event loop turn later).
        scoring = self.scorer.submit_ids(lease.problem.problem.answer,
                                         [s.token_ids for s in msg.samples],
                                         [s.text for s in msg.samples])
        pending = None
        if self.spot is not None and self.spot.wants():
            # The claimed version's weights are taken now, not once scored (they may rotate out).
            pending = self.spot.check(_unscored(lease, msg))
        # One task per submission, scoring then spot-checking; no ack until both are done. It
        # holds lease budget meanwhile (`Hub.dispatch` counts `_checks`).
        task = asyncio.create_task(self._judge(conn, lease, msg, scoring, pending))
        self._checks.add(task)
        task.add_done_callback(self._check_done)

    async def _judge(self, conn: PeerConn, lease: Any, msg: m.RolloutSubmission,
                     scoring: asyncio.Future[Scored],
                     pending: Coroutine[Any, Any, SpotResult] | None) -> bool:
        """Await `scoring`, `msg`'s samples scored from their token ids in the scorer's worker
        processes, then, if sampled, `pending`, its spot-check; admit what passes (True). The
        peer may have left meanwhile: a group that checks out is still admitted."""
        problem = lease.problem.problem
        try:
            scored = await scoring
        except BaseException:
            if pending is not None:
                pending.close()
            self.leases.requeue(lease)  # not judged (shutdown, or a bug): the prompt goes back
            raise
        if scored.malformed:  # ids no engine emits: out of vocabulary, or after the EOS
            if pending is not None:
                pending.close()
            self._refuse(conn, lease, "bad_tokens")
            return False
        # The hub scores the decoding of the ids it will train on: a peer's text and claimed
        # reward are never used. A text that is not that decoding is a lie (once per
        # submission), and so is a claim above the verifier's. (A claim below it is no gain to
        # a liar, and an honest peer whose checker lacks math-verify can make one.)
        rewards = scored.rewards
        honest = not scored.mismatched
        if not honest:
            self._distrust(conn, "text_mismatch")
        fair = not any(s.reward > r + 1e-6 for s, r in zip(msg.samples, rewards))
        if not fair:
            self._distrust(conn, "reward_mismatch")
        if self._quarantined(conn):  # by these lies, or by another submission meanwhile
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
            if self._quarantined(conn):  # by another of its rollouts while this one was checked
                self._refuse(conn, lease, "quarantined")
                return False
            if fair and honest:
                self.trust.good(conn.identity)
        self._admit(conn, ScoredGroup(msg.lease_id, problem.id, lease.problem.prompt_ids,
                                      msg.version, msg.samples, rewards))
        return True

    def _check_done(self, task: asyncio.Task) -> None:
        """A submission was judged. Admitted, it holds the same lease budget in the buffer;
        otherwise the budget it held is free again (a crash is logged; its prompt went back)."""
        self._checks.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("judging a rollout failed", exc_info=task.exception())
        elif task.result():
            return
        self.dispatch()

    def _forged(self, conn: PeerConn, lease: Any, reason: str, detail: dict[str, Any]) -> None:
        """A rollout its claimed version does not reproduce ("logprob"), or with a version this
        hub never published ("version"): rejected, its prompt re-queued, a run log record, and
        a logprob_mismatch against the peer's trust."""
        self.counters.spot_failed += 1
        self._refuse(conn, lease, "logprob_mismatch" if reason == "logprob" else reason)
        record = {"event": "spot_check", "step": self.step, "peer": conn.peer_id,
                  "name": conn.hello.name, "identity": conn.identity, "lease_id": lease.lease_id,
                  "reason": reason, **detail}
        log.warning("%s (%s) failed a spot-check of %s: %s %s", conn.peer_id, conn.hello.name,
                    lease.lease_id, reason, detail)
        self.on_event(record)
        self._distrust(conn, "logprob_mismatch")
        self.dispatch()

    def _refuse(self, conn: PeerConn, lease: Any, reason: str) -> None:
        """Reject `lease`'s rollout for `reason`; its prompt goes back to the queue, for others."""
        self.leases.requeue(lease)
        self.counters.rejected += 1
        conn.post(m.Reject(lease.lease_id, reason))

    def _admit(self, conn: PeerConn, group: ScoredGroup) -> None:
        """Queue `group` for the learner and acknowledge it, journaled first."""
        self._journal("admit", group_to_wire(group))
        log.debug("admitted %s (v%d) from %s", group.lease_id, group.version, conn.peer_id)
        self.buffer.put(group)
        self.counters.admitted_groups += 1
        self.counters.admitted_samples += len(group.samples)
        if (account := self.pool.accounts.get(conn.peer_id)) is not None:  # None: it left
            account.admitted += len(group.samples)
        self._admitted.set()
        conn.post(m.Ack(group.lease_id))

    def _measure(self, conn: PeerConn, granted: float, samples: int) -> None:
        """The peer's generation rate from this submission: its samples over the time it spent
        on them. A peer works through its leases one at a time, so that time started when the
        lease was granted or when its previous submission arrived, whichever is later; idle time
        waiting for leases does not count, so the rate is what the peer can do, not what the
        hub happened to ask of it."""
        now = _now()
        busy_s = now - max(granted, conn.last_done)
        conn.last_done = now
        if busy_s > 0 and samples:
            self.pool.rate(conn.peer_id, samples / busy_s)

    # --- durability (echo2p2p.hub.durable) ------------------------------------------------------

    def _journal(self, kind: str, *record: Any) -> None:
        if self.journal is not None:
            self.journal.write([kind, *record])

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the hub, as plain data."""
        return {"run_id": self.run_id, "step": self.step, "next_peer": self._next_peer,
                "leases": self.leases.state(),
                "buffer": [group_to_wire(g) for g in self.buffer.groups()],
                "trust": self.trust.state()}

    def restore(self, state: dict[str, Any], journal: list[list]) -> None:
        """Come back to `state` plus the journal after it: the lease table, the data cursor,
        every admitted group not yet trained on, and trust. The caller restores the learner
        at `state["step"]`; groups it can no longer train on wait for the staleness rule."""
        now = _now()
        self.step, self._next_peer = state["step"], state["next_peer"]
        self.leases.restore(state["leases"], now)
        for wire in state["buffer"]:
            self.buffer.put(group_from_wire(wire))
        self.trust.restore(state["trust"])
        for kind, *record in journal:
            if kind == "lease":
                self.leases.replay(tuple(record), now)
            elif kind == "peer":
                self._next_peer = max(self._next_peer, record[0])
            elif kind == "admit":
                group = group_from_wire(record[0])
                self.leases.replay(("done", group.lease_id), now)
                self.buffer.put(group)


def _unscored(lease: Any, msg: m.RolloutSubmission) -> ScoredGroup:
    """`msg` as a group for its spot-check, which reads everything but the rewards."""
    return ScoredGroup(msg.lease_id, lease.problem.problem.id, lease.problem.prompt_ids,
                       msg.version, msg.samples, [])


def _now() -> float:
    return asyncio.get_running_loop().time()
