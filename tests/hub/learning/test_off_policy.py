"""Off-policy diagnostics (`hub.learning.off_policy`): values on hand-made tensors, and a real
learner step on a tiny model putting them into the step record."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.learning import off_policy
from echo2p2p.hub.learning.learner import Learner
from echo2p2p.hub.run.step_record import step_record
from echo2p2p.hub.serving.server import Hub, TokenizedProblem
from echo2p2p.tasks import AdditionTask

from .test_learner import COMPLETIONS, PROMPT, make_group, sequence_logprobs, tiny_model

LN2 = math.log(2.0)


def hand_made() -> off_policy.Tally:
    """Row 0 (version 5): d = 0, ln 2 and a masked token; row 1 (version 4): d = -ln 2, ln 1.1."""
    behaviour = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0 + LN2, -9.0], [-1.0 - LN2, -1.0 + math.log(1.1), 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    versions, bucket = off_policy.buckets([5, 4])
    assert versions == [4, 5] and bucket == [1, 0]
    sums, maxes = off_policy.tally(logprobs, behaviour, mask, torch.tensor(bucket), buckets=2,
                                   clip_eps=0.2)
    return off_policy.Tally(tuple(versions), sums, maxes)


def test_ratio_statistics_by_lag_and_overall_on_hand_made_tokens():
    """Ratios 1, 2 at lag 0 and 0.5, 1.1 at lag 1: means, extremes and the share outside
    [0.8, 1.2] by lag and over all four tokens; the masked token counts nowhere."""
    out = hand_made().summary(lambda version: 5 - version)
    zero, one = out["by_lag"]["0"], out["by_lag"]["1"]
    assert zero == pytest.approx({"n_tokens": 2, "ratio_mean": 1.5, "ratio_min": 1.0,
                                  "ratio_max": 2.0, "clip_frac": 0.5, "clip_low_frac": 0.0,
                                  "clip_high_frac": 0.5})
    assert one == pytest.approx({"n_tokens": 2, "ratio_mean": 0.8, "ratio_min": 0.5,
                                 "ratio_max": 1.1, "clip_frac": 0.5, "clip_low_frac": 0.5,
                                 "clip_high_frac": 0.0})
    assert out["ratio_mean"] == pytest.approx((1 + 2 + 0.5 + 1.1) / 4)
    assert (out["ratio_min"], out["ratio_max"]) == pytest.approx((0.5, 2.0))
    assert out["clip_frac"] == pytest.approx(0.5)


def test_mismatch_reads_lag_zero_tokens_only():
    """k3 = exp(d) - d - 1 over the lag-0 tokens: (0 + (1 - ln 2)) / 2; |d| mean ln2 / 2, max
    ln 2. The lag-1 token with |d| = ln 2 and the masked one (|d| = 6) do not count."""
    out = hand_made().summary(lambda version: 5 - version)
    assert out["mismatch_tokens"] == 2
    assert out["mismatch_kl"] == pytest.approx((1 - LN2) / 2)
    assert out["mismatch_abs_mean"] == pytest.approx(LN2 / 2)
    assert out["mismatch_abs_max"] == pytest.approx(LN2)


def test_without_lag_zero_tokens_the_mismatch_is_absent_and_nothing_is_nan():
    """All lags >= 1: no mismatch keys; no tokens at all: nothing; both dump as strict JSON."""
    stale = hand_made().summary(lambda version: 7 - version)
    assert not any(k.startswith("mismatch") for k in stale)
    assert set(stale["by_lag"]) == {"2", "3"}
    assert off_policy.Tally((3,), *off_policy.empty(1)).summary(lambda v: 0) == {}
    json.dumps(stale, allow_nan=False)


def test_micro_batches_combine_to_the_whole_batchs_tally():
    """Tallies of two halves, combined, are the tally of the whole (sums add, maxima max)."""
    d = torch.tensor([[0.1, -0.3], [0.5, 0.0]])
    zeros, mask = torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool)
    bucket = torch.tensor([0, 0])
    whole = off_policy.tally(d, zeros, mask, bucket, buckets=1, clip_eps=0.2)
    halves = off_policy.combined(
        off_policy.tally(d[:1], zeros[:1], mask[:1], bucket[:1], buckets=1, clip_eps=0.2),
        off_policy.tally(d[1:], zeros[1:], mask[1:], bucket[1:], buckets=1, clip_eps=0.2))
    assert torch.allclose(whole[0], halves[0]) and torch.equal(whole[1], halves[1])


def record_of(stats) -> dict:
    """The step record the loop logs for `stats` (learner at version 0); in an event loop."""
    task = AdditionTask()
    hub = Hub(HubConfig.from_flat(prompts_per_step=2), "run", task,
              [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]])
    return step_record(0, hub.statistics(), stats.metrics(), ["l0"], Counter({0: 1}), time_s=1.0,
                       rollouts_per_s=1.0, busy_frac=0.5, tokens_per_s=1.0, capacity={},
                       off_policy=stats.off_policy.summary(lambda version: 0 - version))


async def test_a_real_step_logs_no_mismatch_on_policy_and_some_when_perturbed():
    """Behaviour logprobs computed by the learner's own model at its version: mismatch ~ 0 and
    ratios 1. Shifted down by 0.1 nat: d = 0.1 on every token, k3 = e^0.1 - 1.1."""
    model = tiny_model()
    own = make_group(model, [1.0, 0.0, 0.0, 0.0])
    record = record_of(Learner(model, lr=1e-3).step([own]))
    tokens = sum(len(c) for c in COMPLETIONS)
    assert record["mismatch_tokens"] == record["by_lag"]["0"]["n_tokens"] == tokens
    assert record["mismatch_kl"] < 1e-10 and record["mismatch_abs_max"] < 1e-5
    assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and record["clip_frac"] == 0.0
    json.dumps(record, allow_nan=False)

    model = tiny_model()
    shifted = [[x - 0.1 for x in lp] for lp in sequence_logprobs(model, PROMPT, COMPLETIONS)]
    record = record_of(Learner(model, lr=1e-3).step(
        [make_group(model, [1.0, 0.0, 0.0, 0.0], logprobs=shifted)]))
    assert record["mismatch_kl"] == pytest.approx(math.exp(0.1) - 1.1, rel=1e-3)
    assert record["mismatch_abs_mean"] == pytest.approx(0.1, rel=1e-3)
    assert record["ratio_min"] == pytest.approx(math.exp(0.1), rel=1e-3)


def test_a_stale_group_counts_at_its_lag_and_not_in_the_mismatch():
    """A group of version 0 trained at step 2 has lag 2: by_lag["2"], no mismatch keys."""
    model = tiny_model()
    stats = Learner(model, lr=1e-3).step([make_group(model, [1.0, 0.0, 0.0, 0.0])])
    out = stats.off_policy.summary(lambda version: 2 - version)
    assert set(out["by_lag"]) == {"2"} and "mismatch_kl" not in out
