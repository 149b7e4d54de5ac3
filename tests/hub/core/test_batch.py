"""The learner's batch under dynamic sampling (`grpo.dynamic_sampling`), fed as event sequences
to `HubCore` with a fake clock: groups whose G rewards are all equal are admitted and acked (their
peer did honest work) but never in a `BatchReady`; a batch waits for `prompts_per_step`
informative groups; leases keep flowing while every group is filtered, and the hub says so; a
resumed hub's journal filters the same groups. With the option off, today's batch exactly."""

from __future__ import annotations

import logging

import pytest

from echo2p2p import messages as m
from echo2p2p.hub.core import actions as a
from echo2p2p.hub.core import events as ev
from echo2p2p.hub.learning.checkpoint import hub_state, restore_hub
from echo2p2p.hub.learning.durable import group_to_wire

from .rig import Rig, of, sent

UNIFORM, MIXED = (1.0, 1.0), (0.0, 1.0)  # G = 2: no gradient, and some


def judge(r: Rig, peer: str, lease_id: str, rewards: tuple[float, ...]) -> list:
    """Submit `lease_id`'s group and score it with `rewards`: the actions of the scoring."""
    r.submit(peer, lease_id)
    return r.feed(ev.ScoringFinished(lease_id, None, rewards))


def test_a_batch_waits_for_informative_groups_and_never_holds_a_uniform_one(rig):
    """On: two groups with one reward each are acked and counted but not batched; the batch
    comes with the second informative group and holds exactly the informative two."""
    r = rig(dynamic_sampling=True)
    p = r.joined()
    assert not of(r.feed(ev.BatchWanted()), a.BatchReady)
    u1, i1 = r.leases(p, 2)
    assert sent(judge(r, p, u1.lease_id, UNIFORM), p) == [m.Ack(u1.lease_id)]
    assert not of(judge(r, p, i1.lease_id, MIXED), a.BatchReady)
    u2, i2 = r.leases(p, 2)
    filtered = judge(r, p, u2.lease_id, UNIFORM)
    assert not of(filtered, a.BatchReady) and sent(filtered, p) == [m.Ack(u2.lease_id)]
    (batch,) = of(judge(r, p, i2.lease_id, MIXED), a.BatchReady)
    assert {g.lease_id for g in batch.groups} == {i1.lease_id, i2.lease_id}
    assert r.core.counters.admitted_groups == 4  # credited: the peer did the work
    assert r.core.buffer.statistics().filtered_total == 2 and len(r.core.buffer) == 0
    journaled = {x.record[1].lease_id for x in r.log
                 if isinstance(x, a.Journal) and x.record[0] == "admit"}
    assert journaled == {u1.lease_id, i1.lease_id, u2.lease_id, i2.lease_id}
    assert r.core.quotas.book.standing(r.core.peers[p].identity).delivered == 4
    r.feed(ev.StepFinished())
    assert r.core.step == 1


def test_off_a_uniform_group_is_batched_as_today(rig):
    """Off (the default): the same groups make the batch in arrival order, none filtered."""
    r = rig()
    p = r.joined()
    r.feed(ev.BatchWanted())
    u1, i1 = r.leases(p, 2)
    judge(r, p, u1.lease_id, UNIFORM)
    (batch,) = of(judge(r, p, i1.lease_id, MIXED), a.BatchReady)
    assert [g.lease_id for g in batch.groups] == [u1.lease_id, i1.lease_id]
    assert r.core.buffer.statistics().filtered_total == 0
    assert r.core.buffer.informative_frac() == 1.0 and r.core.quotas.budget == 4


def test_leases_keep_flowing_when_every_group_is_filtered_and_the_hub_says_so(rig, caplog):
    """Every group uniform: no batch ever, but each filtered group frees its lease's place (the
    budget widens, 4x at most), so the peer is never starved; at 4 batches' worth of filtered
    groups (8) the hub warns, and again at 16, not on every group."""
    r = rig(dynamic_sampling=True)
    p = r.joined()
    r.feed(ev.BatchWanted())
    leases = r.leases(p, 2)
    with caplog.at_level(logging.WARNING, logger="echo2p2p.hub.serving.server"):
        for _ in range(20):
            lease = leases.pop(0)
            assert not of(judge(r, p, lease.lease_id, UNIFORM), a.BatchReady)
            leases += r.leases(p, 1)
            assert leases, "the peer was starved of leases"
    assert r.core.buffer.statistics().filtered_total == 20
    assert r.core.quotas.budget == 16  # lease_budget(2, 2) = 4 groups, at a quarter's yield
    warned = [rec.getMessage() for rec in caplog.records if "were filtered" in rec.getMessage()]
    assert len(warned) == 2 and "8 groups" in warned[0] and "16 groups" in warned[1]


def test_a_resumed_hub_filters_the_journals_groups_as_the_run_did(rig):
    """Checkpoint after one filtered and one informative group, two more (one of each) in the
    journal: the resumed core queues the two informative ones and counts both filtered."""
    r = rig(dynamic_sampling=True)
    p = r.joined()
    u1, i1 = r.leases(p, 2)
    judge(r, p, u1.lease_id, UNIFORM)
    judge(r, p, i1.lease_id, MIXED)
    state = hub_state(r.core, None, r.now)
    mark = len(r.log)
    u2, i2 = r.leases(p, 2)
    judge(r, p, u2.lease_id, UNIFORM)
    judge(r, p, i2.lease_id, MIXED)
    journal = [[x.record[0], group_to_wire(x.record[1]), *x.record[2:]]
               if x.record[0] == "admit" else list(x.record)
               for x in r.log[mark:] if isinstance(x, a.Journal)]
    back = rig(dynamic_sampling=True)
    restore_hub(state, journal, back.core, None, back.now)
    assert [g.lease_id for g in back.core.buffer.groups()] == [i1.lease_id, i2.lease_id]
    assert back.core.buffer.statistics() == r.core.buffer.statistics()
    assert back.core.counters.admitted_groups == r.core.counters.admitted_groups == 4


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_low_yield_widens_the_leases_in_flight(rig, dynamic):
    """After eight uniform groups a quarter of groups is expected to reach a batch, and the
    budget is 16 leases (4 groups' worth at that yield): a peer asking for 8 (its quota after 8
    admissions is 10) holds 8; off, the plain budget, 4 (`lease_budget(2, 2)`)."""
    r = rig(dynamic_sampling=dynamic)
    p = r.joined()
    for _ in range(4):
        for lease in r.leases(p, 2):
            judge(r, p, lease.lease_id, UNIFORM)
    if not dynamic:  # the eight queued groups would fill any budget: the learner takes them
        for _ in range(4):
            r.feed(ev.BatchWanted())
            r.feed(ev.StepFinished())
    assert len(r.core.buffer) == 0
    r.leases(p, 8)
    assert r.core.leases.open_count == (8 if dynamic else 4)
