"""Logprob spot-checks: the checker on real groups of the tiny model, and forgers caught by a
live hub (a peer rewriting its logprobs, a peer tagging rollouts with an unpublished version)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import pytest
import torch

from echo2p2p import messages as m
from echo2p2p.buffer import ScoredGroup
from echo2p2p.rows import parse_samples
from echo2p2p.session import Session, Side
from echo2p2p.tasks import AdditionTask
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.learning.learner import Learner, encode_prompt
from echo2p2p.hub.learning.spotcheck import SpotChecker
from echo2p2p.hub.run.start import start_hub
from echo2p2p.policy.engines import Completion, TransformersEngine
from echo2p2p.policy.model import load_policy

from tests.conftest import running_peers

TASK = AdditionTask()
PROBLEMS = TASK.problems("train")


@pytest.fixture(scope="module")
def rig():
    """A learner on the tiny model, its published v0, and a CPU engine holding v0."""
    torch.manual_seed(0)
    model, tokenizer = load_policy("tiny")
    learner = Learner(model, lr=0.1, pad_id=tokenizer.pad_token_id)
    v0 = learner.export_weights(torch.bfloat16)
    engine = TransformersEngine("tiny")
    engine.load_weights(v0)
    return learner, v0, engine


def checker(learner, **overrides) -> SpotChecker:
    return SpotChecker(learner.model, HubConfig.from_flat(group_size=4).replace(**overrides))


def generate(engine, index: int, version: int, top_p: float = 1.0) -> ScoredGroup:
    """A real group of 4 from `engine`, tagged `version`."""
    p = PROBLEMS[index]
    ids = encode_prompt(engine.tokenizer, p.prompt)
    out = engine.generate(ids, 4, temperature=1.0, top_p=top_p, max_new_tokens=8, seed=index)
    samples = parse_samples([m.Sample(m.pack_ids(c.token_ids), m.pack_logprobs(c.logprobs),
                                      c.text, 0.0, c.finish_reason) for c in out], None)
    return ScoredGroup(f"L{index}", p.id, ids, version, samples, [0.0] * len(samples))


def shifted(group: ScoredGroup, by: float) -> ScoredGroup:
    """`group` claiming every token `by` nats likelier or less likely than it was."""
    return replace(group, samples=tuple(
        replace(s, packed_logprobs=m.pack_logprobs([x + by for x in s.logprobs]))
        for s in group.samples))


async def test_honest_group_passes_and_fabricated_logprobs_fail(rig):
    """Logprobs of the claimed version pass with a difference of float noise; the same tokens
    claimed e times less likely (ratios inflated e-fold) fail with reason logprob."""
    learner, v0, engine = rig
    spot = checker(learner)
    spot.keep(0, v0)
    group = generate(engine, 0, 0)
    honest = await spot.check(group)
    assert honest.passed and honest.mean_abs_diff < 1e-4
    assert honest.tokens == sum(s.n_tokens for s in group.samples)
    forged = await spot.check(shifted(group, -1.0))
    assert forged.reason == "logprob" and forged.mean_abs_diff == pytest.approx(1.0, abs=1e-3)


async def test_claimed_version_not_kept_fails_with_reason_version(rig):
    """Only the last S + 1 published versions are kept: one dropped since, or never published,
    is a forged tag; one from before the first kept (a resumed hub) cannot be checked."""
    learner, v0, engine = rig
    spot = checker(learner, max_lag=1)
    for version in (2, 3, 4):
        spot.keep(version, v0)
    assert sorted(spot._versions) == [3, 4]
    for claimed in (2, 9):
        result = await spot.check(generate(engine, 1, claimed))
        assert result.reason == "version" and result.tokens == 0
    before = await spot.check(generate(engine, 1, 1))
    assert before.passed and before.tokens == 0
    assert (await spot.check(generate(engine, 1, 4))).tokens > 0


async def test_token_sampling_checks_k_positions_per_sample(rig):
    """With spot_check_tokens = 2 each sample is checked at 2 random positions (all of a
    shorter one), the forward cut at the last: an honest group passes, a forged one fails."""
    learner, v0, engine = rig
    spot = checker(learner, spot_check_tokens=2)
    spot.keep(0, v0)
    group = generate(engine, 2, 0)
    honest = await spot.check(group)
    assert honest.passed and honest.tokens == sum(min(s.n_tokens, 2) for s in group.samples)
    assert (await spot.check(shifted(group, 0.5))).reason == "logprob"


async def test_nucleus_sampled_logprobs_are_recomputed_as_the_engine_reports_them(rig):
    """With top_p < 1 peers report renormalised nucleus logprobs: an honest group passes."""
    learner, v0, engine = rig
    spot = checker(learner, top_p=0.8)
    spot.keep(0, v0)
    result = await spot.check(generate(engine, 3, 0, top_p=0.8))
    assert result.passed and result.mean_abs_diff < 1e-4


async def test_version_tag_forged_onto_older_logprobs_fails_after_a_real_step(rig):
    """Groups generated with v0 but tagged v1 (a real learner step later) fail; v1's own pass."""
    learner, v0, engine = rig
    spot = checker(learner)
    spot.keep(0, v0)
    batch = [generate(engine, i, 0) for i in range(8)]
    batch = [replace(g, rewards=[TASK.reward(PROBLEMS[i].answer, s.text) for s in g.samples])
             for i, g in enumerate(batch)]
    assert not learner.step(batch).skipped
    v1 = learner.export_weights(torch.bfloat16)
    spot.keep(1, v1)
    stale = [await spot.check(replace(generate(engine, i, 0), version=1)) for i in range(20, 24)]
    assert all(r.reason == "logprob" for r in stale), stale
    fresh = TransformersEngine("tiny")
    fresh.load_weights(v1)
    assert (await spot.check(generate(fresh, 20, 1))).passed


def test_wants_draws_the_configured_fraction(rig):
    """0 checks nothing, 1 everything, 0.3 about three in ten (a seeded draw)."""
    draws = {f: checker(rig[0], spot_check_fraction=f) for f in (0.0, 0.3, 1.0)}
    assert [sum(draws[f].wants() for _ in range(300)) for f in (0.0, 1.0)] == [0, 300]
    assert 60 < sum(draws[0.3].wants() for _ in range(300)) < 120


class ForgingEngine:
    """The real engine, but it claims every token e times less likely than it was, so each
    importance ratio the learner computes would be e times too large."""

    def __init__(self):
        self.inner = TransformersEngine("tiny")
        self.tokenizer = self.inner.tokenizer

    def load_weights(self, state):
        self.inner.load_weights(state)

    def generate(self, prompt_ids, n, **kw):
        return [Completion(c.token_ids, [x - 1.0 for x in c.logprobs], c.text, c.finish_reason)
                for c in self.inner.generate(prompt_ids, n, **kw)]


def run_log(run) -> list[dict]:
    return [json.loads(line) for line in
            (run.runlog.run_dir / "metrics.jsonl").read_text().splitlines()]


async def test_logprob_forger_is_quarantined_and_honest_peer_trains_on(hub_cfg):
    """Every group checked: the peer whose engine rewrites logprobs fails its checks and is
    quarantined; the honest peer is never distrusted and training reaches max_steps."""
    cfg = hub_cfg.replace(max_steps=4, spot_check_fraction=1.0)
    async with start_hub(cfg) as run:
        async with running_peers(run.url, 2, engines=[None, ForgingEngine()]) as peers:
            await asyncio.wait_for(run.finished.wait(), 120)
            await asyncio.wait_for(run.hub.until(lambda: bool(run.hub.statistics().quarantined)), 60)
    records = run_log(run)
    checks = [r for r in records if r.get("event") == "spot_check"]
    quarantine = [r for r in records if r.get("event") == "quarantine"]
    assert len(quarantine) == 1 and quarantine[0]["name"] == "test-1"
    assert quarantine[0]["events"]["logprob_mismatch"] >= 2
    assert checks and all(r["name"] == "test-1" and r["reason"] == "logprob"
                          and r["mean_abs_diff"] == pytest.approx(1.0, abs=0.01) for r in checks)
    honest = peers[0].welcome.peer_id
    stats = run.hub.statistics()
    assert honest not in stats.trust_events and honest not in stats.quarantined
    assert peers[1].statistics().rejected.get("logprob_mismatch", 0) >= 1
    steps = [r for r in records if "step" in r and "train/loss" in r]
    assert len(steps) == 4 and steps[-1]["rollout/spot_failed_total"] >= 2
    assert steps[-1]["rollout/spot_checked_total"] >= steps[-1]["rollout/admitted_groups_total"]


async def submit(ws, session: Session, version: int, group_size: int) -> m.Message:
    """Take one lease and answer it tagged `version`."""
    await ws.send_bytes(session.send(m.LeaseRequest(1)))
    while not isinstance(msg := session.receive((await ws.receive()).data, 0.0), m.LeaseGrant):
        pass
    sample = m.Sample(m.pack_ids([5]), m.pack_logprobs([-1.0]), "1", 0.0, "stop")
    await ws.send_bytes(session.send(m.RolloutSubmission(msg.lease_id, version, [sample] * group_size)))
    while not isinstance(reply := session.receive((await ws.receive()).data, 0.0), (m.Ack, m.Reject)):
        pass
    return reply


async def test_version_tag_newer_than_published_is_caught_unsampled(hub_cfg):
    """Spot-checks off: a rollout tagged with a version the hub has not published is rejected
    as "version" and counts against the peer; twice, and it is quarantined."""
    cfg = hub_cfg.replace(spot_check_fraction=0.0)
    async with start_hub(cfg) as run:
        assert not run.hub.statistics().spot_checking and run.hub.statistics().newest_version == 0
        async with aiohttp.ClientSession() as http, http.ws_connect(run.url) as ws:
            s = Session(Side.PEER, 0.0)
            await ws.send_bytes(s.send(m.Hello("tagger", "transformers", "cpu")))
            welcome = s.receive((await ws.receive()).data, 0.0)
            replies = [await submit(ws, s, 1, welcome.group_size) for _ in range(2)]
        assert [r.reason for r in replies] == ["version", "version"]
        assert run.hub.statistics().quarantined == {welcome.peer_id}
        stats = run.hub.statistics()
        assert stats.spot_failed == 2 and stats.requeued_leases >= 2
    records = run_log(run)
    assert [r["reason"] for r in records if r.get("event") == "spot_check"] == ["version"] * 2
    assert [r["events"]["logprob_mismatch"] for r in records if r.get("event") == "quarantine"] == [2]
