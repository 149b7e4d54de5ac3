"""The hub's decisions, fed as event sequences to `HubCore` with a fake clock, synchronously:
joins and refusals, leases and their per-turn dispatch, admission (ack, duplicate, reject,
stale, forged version, scoring, spot-checks), quotas for unproven peers, lease expiry by Tick,
trust and quarantine, held answers of code rewards, the learner's batch."""

from __future__ import annotations

import pytest

from echo2p2p import messages as m
from echo2p2p.hub.core import actions as a
from echo2p2p.hub.core import events as ev
from echo2p2p.hub.core.core import RunFacts

from .rig import of, sent


def scored(lease_id: str, n: int = 2, reward: float = 1.0, **kw) -> ev.ScoringFinished:
    return ev.ScoringFinished(lease_id, None, (reward,) * n, **kw)


def test_a_hello_is_joined_and_welcomed_with_the_runs_settings(rig):
    r = rig()
    actions = r.join("alice")
    (joined,) = of(actions, a.Joined)
    assert joined.conn_id == "c-alice" and joined.peer_id == "p1"
    (welcome,) = sent(actions, "p1", m.Welcome)
    assert (welcome.peer_id, welcome.run_id, welcome.task, welcome.group_size) == \
        ("p1", "run", "addition", 2)
    assert actions.index(joined) < [i for i, x in enumerate(actions) if isinstance(x, a.Send)][0]
    assert of(actions, a.Journal)[0].record == ("peer", 1)  # ids never handed out twice
    assert list(r.core.peers) == ["p1"]


def test_a_crowded_address_and_a_bad_token_are_refused_before_any_work(rig):
    r = rig(max_peers_per_address=1)
    r.joined("first", "10.0.0.7")
    crowded = r.join("second", "10.0.0.7")
    assert of(crowded, a.Refused) == [a.Refused("c-second", m.CLOSE_TOO_MANY,
                                                "too many connections from this address")]
    assert not of(crowded, a.Send) and not of(crowded, a.Joined)
    bad = r.join("third", "10.0.0.8", token="x.y", token_refusal="unknown join token")
    assert of(bad, a.Refused) == [a.Refused("c-third", m.CLOSE_UNAUTHORIZED, "unknown join token")]
    assert r.core.counters.refused == 2 and list(r.core.peers) == ["p1"]


def test_credits_are_served_once_per_turn_up_to_a_new_peers_start(rig):
    """Credits ask for one lease pass at the end of the loop's turn (EndTurn, once); a new,
    unproven peer gets its start (2), however many it asks for."""
    r = rig()
    p = r.joined()
    first = r.frame(p, m.LeaseRequest(3))
    second = r.frame(p, m.LeaseRequest(3))
    assert len(of(first + second, a.EndTurn)) == 1 and not sent(first + second, p, m.LeaseGrant)
    grants = sent(r.feed(ev.TurnEnded()), p, m.LeaseGrant)
    assert len(grants) == 2 and len({g.lease_id for g in grants}) == 2
    assert sent(r.feed(ev.TurnEnded()), p, m.LeaseGrant) == []  # its probation's share is out


def test_an_admitted_group_is_journaled_before_its_ack_and_renews_the_peers_standing(rig):
    r = rig()
    p = r.joined()
    lease, _ = r.leases(p, 2)
    asked = r.submit(p, lease.lease_id)
    (score,) = of(asked, a.Score)
    assert score.lease_id == lease.lease_id and score.owner == p and len(score.token_ids) == 2
    assert not sent(asked, p)  # nothing acknowledged before it is judged
    judged = r.feed(scored(lease.lease_id))
    journal = [i for i, x in enumerate(judged) if isinstance(x, a.Journal)
               and x.record[0] == "admit"]
    ack = [i for i, x in enumerate(judged) if isinstance(x, a.Send)
           and isinstance(x.message, m.Ack)]
    assert journal and ack and journal[0] < ack[0]
    assert r.core.counters.admitted_groups == 1 and len(r.core.buffer) == 1
    again = r.submit(p, lease.lease_id)  # a resubmission: acked again, admitted once
    assert sent(again, p) == [m.Ack(lease.lease_id, duplicate=True)]
    assert r.core.counters.duplicates == 1 and len(r.core.buffer) == 1


def test_a_resubmission_while_judged_waits_and_an_unknown_lease_is_rejected(rig):
    r = rig()
    p = r.joined()
    lease, _ = r.leases(p, 2)
    r.submit(p, lease.lease_id)
    assert sent(r.submit(p, lease.lease_id), p) == []  # the first one's verdict answers it
    assert sent(r.submit(p, "nope"), p) == [m.Reject("nope", "unknown_lease")]
    assert r.core.counters.rejected_by["unknown_lease"] == 1


def test_a_stale_rollout_is_rejected_and_its_prompt_goes_back(rig):
    r = rig()
    p = r.joined()
    lease, _ = r.leases(p, 2)
    for _ in range(3):
        r.feed(ev.StepFinished())
    requeued = r.core.leases.statistics().requeued_total
    assert sent(r.submit(p, lease.lease_id, version=0), p) == [m.Reject(lease.lease_id, "stale")]
    assert r.core.counters.stale_on_arrival == 1 and r.core.counters.stale_lags == {3: 1}
    assert r.core.leases.statistics().requeued_total == requeued + 1


def test_a_version_never_published_is_forged_and_costs_trust(rig):
    r = rig()
    r.publish(0)
    p = r.joined()
    lease, _ = r.leases(p, 2)
    actions = r.submit(p, lease.lease_id, version=1)
    assert sent(actions, p, m.Reject) == [m.Reject(lease.lease_id, "version")]
    (record,) = [x.record for x in of(actions, a.Record) if x.record["event"] == "spot_check"]
    assert record["reason"] == "version" and record["step"] == 0
    assert r.core.counters.spot_failed == 1
    assert r.core.trust.events[r.core.peers[p].identity]["logprob_mismatch"] == 1


def test_lies_and_bad_tokens_cost_trust_and_are_refused(rig):
    r = rig()
    p = r.joined()
    first, second = r.leases(p, 2)
    r.submit(p, first.lease_id)
    assert sent(r.feed(scored(first.lease_id, malformed=True)), p) == \
        [m.Reject(first.lease_id, "bad_tokens")]
    r.submit(p, second.lease_id)
    r.feed(scored(second.lease_id, mismatched=True))  # a text that is not its ids' decoding
    events = r.core.trust.events[r.core.peers[p].identity]
    assert events["bad_rollout"] == 1 and events["text_mismatch"] == 1


def test_a_failed_spot_check_rejects_and_repeated_ones_quarantine_and_withdraw(rig):
    """A peer on probation has every rollout spot-checked; the ack waits for the check. A
    failed check rejects with logprob_mismatch; enough of them quarantine the identity: its
    leases go back, its queued groups are withdrawn (journaled), a dated record goes to the
    run log, and it is granted nothing more."""
    r = rig(spot_checks=True)
    p = r.joined()
    lease, spare = r.leases(p, 2)
    (check,) = of(r.submit(p, lease.lease_id), a.SpotCheck)
    assert check.group.lease_id == lease.lease_id and check.group.rewards == []
    assert not sent(r.feed(scored(lease.lease_id)), p)  # scored: its check still decides
    assert sent(r.feed(ev.SpotCheckFinished(lease.lease_id, None, 8)), p) == [m.Ack(lease.lease_id)]
    assert r.core.counters.spot_checked == 1 and len(r.core.buffer) == 1
    quarantined = []
    for _ in range(8):
        r.submit(p, spare.lease_id)
        r.feed(scored(spare.lease_id))
        judged = r.feed(ev.SpotCheckFinished(spare.lease_id, "logprob", 8, {"max_diff": 3.0}))
        assert sent(judged, p, m.Reject) == [m.Reject(spare.lease_id, "logprob_mismatch")]
        quarantined = [x.record for x in of(judged, a.Record) if x.record["event"] == "quarantine"]
        if quarantined:
            break
        r.feed(ev.TurnEnded())
        (spare,) = r.leases(p, 1) or [None]
        if spare is None:  # its quota shrank: wait for the lease to be dealt again
            break
    assert quarantined and quarantined[0]["groups_withdrawn"] == 1 and "step" in quarantined[0]
    assert any(x.record[0] == "withdraw" for x in of(r.log, a.Journal))
    assert len(r.core.buffer) == 0 and r.core.counters.withdrawn_groups == 1
    assert r.leases(p, 4) == []  # a quarantined peer is granted nothing


def test_a_dropped_spot_check_is_said_when_scoring_refuses_first(rig):
    r = rig(spot_checks=True)
    p = r.joined()
    lease, _ = r.leases(p, 2)
    r.submit(p, lease.lease_id)
    refused = r.feed(ev.ScoringFinished(lease.lease_id, "over_budget"))
    assert of(refused, a.SpotCheckDropped) == [a.SpotCheckDropped(lease.lease_id)]
    assert sent(refused, p) == [m.Reject(lease.lease_id, "scoring_budget")]
    assert r.core.counters.scoring_refused == 1
    assert r.feed(ev.SpotCheckFinished(lease.lease_id, None, 8)) == []  # too late: ignored


def test_a_scoring_that_failed_puts_the_prompt_back_without_an_answer(rig):
    r = rig()
    p = r.joined()
    lease, _ = r.leases(p, 2)
    r.submit(p, lease.lease_id)
    requeued = r.core.leases.statistics().requeued_total
    failed = r.feed(ev.ScoringFinished(lease.lease_id, "failed"))
    assert sent(failed, p) == [] and of(failed, a.EndTurn)
    assert r.core.leases.statistics().requeued_total == requeued + 1 and not r.core.admission.judging


def test_a_code_rewards_answers_leave_no_earlier_than_the_hold(rig):
    r = rig(facts=RunFacts("code", runs_programs=True), code_answer_hold_s=30.0)
    p = r.joined()
    lease, _ = r.leases(p, 2)
    arrived = r.now
    r.submit(p, lease.lease_id)
    r.now += 2.0
    (ack,) = [x for x in r.feed(scored(lease.lease_id)) if isinstance(x, a.Send)]
    assert ack.message == m.Ack(lease.lease_id) and ack.not_before == arrived + 30.0


def test_a_lease_past_its_deadline_expires_by_tick_and_is_dealt_again(rig):
    """The first of two leases is due a timeout after its grant (the second waits its turn
    behind it first); a Tick past that expires it, charges its holder and asks for a pass."""
    r = rig(lease_timeout_s=10.0)
    r.publish(0)
    p = r.joined()
    r.frame(p, m.VersionHeld(0))  # it holds a version: expiry costs it trust
    assert r.core.peers[p].held_version == 0
    lease, other = r.leases(p, 2)
    r.now += 5.0
    assert not of(r.feed(ev.Tick()), a.EndTurn)  # not yet
    r.now += 10.0
    ticked = r.feed(ev.Tick())
    assert of(ticked, a.EndTurn) and r.core.counters.leases_expired == 1
    assert r.core.trust.events[r.core.peers[p].identity]["lease_expired"] == 1
    assert sent(r.submit(p, lease.lease_id), p) == [m.Reject(lease.lease_id, "expired")]


def test_the_learner_gets_its_batch_once_enough_groups_are_admitted(rig):
    r = rig()
    p = r.joined()
    first, second = r.leases(p, 2)
    assert not of(r.feed(ev.BatchWanted()), a.BatchReady)
    r.submit(p, first.lease_id)
    assert not of(r.feed(scored(first.lease_id)), a.BatchReady)
    r.submit(p, second.lease_id)
    (batch,) = of(r.feed(scored(second.lease_id)), a.BatchReady)
    assert batch.step == 0 and {g.lease_id for g in batch.groups} == {first.lease_id,
                                                                      second.lease_id}
    assert r.core.training
    r.feed(ev.StepFinished())
    assert r.core.step == 1 and not r.core.training


def test_a_peer_that_left_has_its_leases_back_and_gets_no_more_sends(rig):
    r = rig()
    p = r.joined()
    r.leases(p, 2)
    assert r.core.leases.open_count == 2
    left = r.feed(ev.PeerLeft(p))
    assert r.core.leases.open_count == 0 and p not in r.core.peers and of(left, a.EndTurn)
    assert r.feed(ev.TurnEnded()) == []


def test_a_flood_costs_its_sender_trust_and_the_close_is_counted(rig):
    r = rig()
    p = r.joined()
    r.feed(ev.ProtocolBroken(p, "lease_request"))
    r.feed(ev.ProtocolBroken(None))  # before any hello: counted only
    assert r.core.counters.closed_for_protocol == 2 and r.core.counters.closed_for_flooding == 1
    assert r.core.trust.events[r.core.peers[p].identity]["flood"] == 1
    assert sent(r.feed(ev.TurnEnded()), p) == []  # it is being closed: nothing more
