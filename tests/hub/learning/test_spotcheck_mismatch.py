"""The spot-checker's engine-vs-learner mismatch by lag (issue 45, item 3), on real groups of the
tiny model from real CPU engines in fp32 and bf16: k3 KL and ratios at every lag, forgeries
left out, and the bf16 rule's bar against honest bf16 groups."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from echo2p2p import messages as m
from echo2p2p.buffer import ScoredGroup
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.learning.learner import Learner, encode_prompt
from echo2p2p.hub.learning.spotcheck import MismatchByLag, SpotChecker
from echo2p2p.policy.engines import TransformersEngine
from echo2p2p.policy.model import load_policy
from echo2p2p.rows import parse_samples
from echo2p2p.tasks import AdditionTask

PROBLEMS = AdditionTask().problems("train")


@pytest.fixture(scope="module")
def rig():
    """A learner on the tiny model, its published v0, and engines holding v0 in fp32 and bf16."""
    torch.manual_seed(0)
    model, tokenizer = load_policy("tiny")
    learner = Learner(model, lr=0.1, pad_id=tokenizer.pad_token_id)
    v0 = learner.export_weights(torch.bfloat16)
    engines = {"fp32": TransformersEngine("tiny"),
               "bf16": TransformersEngine("tiny", dtype=torch.bfloat16)}
    for engine in engines.values():
        engine.load_weights(v0)
    return learner, v0, engines


def generate(engine, index: int, version: int) -> ScoredGroup:
    """A real group of 4 from `engine`, tagged `version`."""
    p = PROBLEMS[index]
    ids = encode_prompt(engine.tokenizer, p.prompt)
    out = engine.generate(ids, 4, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=index)
    samples = parse_samples([m.Sample(m.pack_ids(c.token_ids), m.pack_logprobs(c.logprobs),
                                      c.text, 0.0, c.finish_reason) for c in out], None)
    return ScoredGroup(f"L{index}", p.id, ids, version, samples, [0.0] * len(samples))


def test_tally_is_k3_and_ratio_of_the_differences():
    """d = ln 2 and -ln 2: k3 (exp(d) - d - 1) and ratio exp(d) averaged; by lag; drained."""
    tally = MismatchByLag()
    d = torch.tensor([math.log(2.0), -math.log(2.0)])
    tally.add(1, d)
    tally.add(0, torch.zeros(3))
    out = tally.drain()
    lag1 = out["spot/mismatch_by_lag"]["1"]
    assert lag1["kl"] == pytest.approx(((2 - math.log(2) - 1) + (0.5 + math.log(2) - 1)) / 2)
    assert lag1["ratio_mean"] == pytest.approx(1.25) and lag1["tokens"] == 2
    assert lag1["abs_mean"] == pytest.approx(math.log(2)) and lag1["abs_max"] == pytest.approx(math.log(2))
    assert out["spot/mismatch_by_lag"]["0"]["kl"] == 0.0
    assert out["spot/mismatch_tokens"] == 5
    assert out["spot/mismatch_kl"] == pytest.approx(lag1["kl"] * 2 / 5)
    assert tally.drain() == {}


async def test_checks_report_mismatch_at_every_lag_and_leave_forgeries_out(rig):
    """A bf16 group of v0 checked while v0 is newest counts at lag 0; checked after v1 and v2
    were published, at lag 2, with the same small KL (recomputed at v0); a forged group fails
    and adds nothing."""
    learner, v0, engines = rig
    spot = SpotChecker(learner.model, HubConfig.from_flat(group_size=4))
    spot.keep(0, v0)
    assert (await spot.check(generate(engines["bf16"], 0, 0))).passed
    forged = generate(engines["bf16"], 1, 0)
    forged = replace(forged, samples=tuple(
        replace(s, packed_logprobs=m.pack_logprobs([0.0] * s.n_tokens)) for s in forged.samples))
    assert not (await spot.check(forged)).passed
    spot.keep(1, v0)
    spot.keep(2, v0)
    assert (await spot.check(generate(engines["bf16"], 2, 0))).passed
    out = spot.mismatch()
    assert sorted(out["spot/mismatch_by_lag"]) == ["0", "2"]
    for lag in out["spot/mismatch_by_lag"].values():
        assert 0 < lag["kl"] < 1e-3 and lag["abs_max"] < 0.5 and lag["ratio_mean"] == pytest.approx(1, abs=0.01)
    assert out["spot/mismatch_tokens"] == sum(
        v["tokens"] for v in out["spot/mismatch_by_lag"].values())
    assert spot.mismatch() == {}


async def test_honest_bf16_groups_pass_the_bar_and_fp32_ones_match_to_float_noise(rig):
    """The default bar passes every one of 24 honest bf16 groups with room (their worst under a
    quarter of it); fp32 groups differ by float noise only."""
    learner, v0, engines = rig
    spot = SpotChecker(learner.model, HubConfig.from_flat(group_size=4))
    spot.keep(0, v0)
    bf16 = [await spot.check(generate(engines["bf16"], i, 0)) for i in range(24)]
    assert all(r.passed for r in bf16)
    assert max(r.mean_abs_diff for r in bf16) < spot.tolerance / 4
    fp32 = await spot.check(generate(engines["fp32"], 0, 0))
    assert fp32.mean_abs_diff < 1e-4
