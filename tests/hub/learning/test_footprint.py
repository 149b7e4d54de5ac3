"""The hub's footprint for a model: logprobs whose gradient keeps one logits buffer, micro-batches
within a memory budget, checkpoint cadence and kept streams fitted to the model, and the
prediction against a measured learner step (system tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.learning.grpo import token_logprobs
from echo2p2p.hub.run.start import fit_to_model, kept_streams, make_learner, predicted_footprint
from echo2p2p.learner_size import ModelShape

from .test_learner import tiny_model

ROOT = Path(__file__).resolve().parents[3]
SMOL = ModelShape(134_515_008, 28_311_552, 576, 30, 49152)


def autograd_logprobs(model, ids, attention, completion, temperature):
    """token_logprobs as it was before `_TargetLogprob`: autograd's gather - logsumexp."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / temperature
    targets = ids[:, 1:]
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    lp = torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)
    return torch.where(completion.bool(), lp, torch.zeros_like(lp))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_target_logprob_gives_autograds_values_and_gradients(temperature):
    """The same logprobs and the same gradient of every parameter as autograd's own graph."""
    torch.manual_seed(1)
    ids = torch.randint(0, 48, (3, 9))
    attention = torch.ones_like(ids)
    attention[2, 7:] = 0  # right padding
    completion = torch.zeros_like(ids)
    completion[:, 4:7] = 1
    weights = torch.randn(3, 9)
    grads = []
    for fn in (token_logprobs, autograd_logprobs):
        model = tiny_model()
        lp = fn(model, ids, attention, completion, temperature)
        (lp * weights).sum().backward()
        grads.append((lp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ours, g_ours), (theirs, g_theirs) = grads
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert ours[:, 4:7].abs().min() > 0  # real logprobs, not the masked zeros
    for name, g in g_theirs.items():
        assert torch.allclose(g_ours[name], g, rtol=1e-4, atol=1e-6), (name, (g_ours[name] - g).abs().max())


def test_defaults_fit_a_real_model_and_leave_the_tiny_one():
    """SmolLM2-135M: a checkpoint every 7th version, catch-up from 4 versions back (5 streams
    kept), micro-batches of 801 tokens, 8-9 GB predicted (issue 45 measured 8.2-9.4); the tiny
    model keeps 1, 16, 16384."""
    cfg = fit_to_model(HubConfig(), SMOL)
    assert (cfg.run.checkpoint_every, cfg.overlay.catch_up_versions, kept_streams(cfg)) == (7, 4, 5)
    assert cfg.learner.learner_micro_tokens == 801
    footprint = predicted_footprint(cfg, SMOL)
    assert 8e9 < footprint.ram_bytes < 9e9
    assert footprint.disk_bytes < 12 * SMOL.params * 2 + 2 * SMOL.params * 12
    tiny = tiny_model()
    fitted = fit_to_model(HubConfig(), ModelShape.of(tiny))
    assert (fitted.run.checkpoint_every, fitted.overlay.catch_up_versions,
            fitted.learner.learner_micro_tokens) == (1, 16, 16384)
    exact = HubConfig.from_flat(checkpoint_bytes_per_version=0, catch_up_disk_bytes=0,
                                learner_micro_bytes=0)
    assert fit_to_model(exact, SMOL) == exact


def test_learner_micro_batches_within_the_memory_budget():
    model = tiny_model()

    class Tok:
        pad_token_id = 0

    per_token = 64 * 121.0 * 2 + 48 * 12.0
    learner = make_learner(HubConfig.from_flat(learner_micro_bytes=int(100 * per_token)), model, Tok(), None)
    assert learner.micro_tokens == 100
    assert make_learner(HubConfig.from_flat(learner_micro_bytes=0), model, Tok(), None).micro_tokens == 16384


@pytest.mark.system
def test_predicted_ram_within_a_factor_of_two_of_a_measured_step():
    """A learner step of the built-in model on a batch that fills its micro-batch (4096 padded
    tokens): the process's peak RSS is within a factor 2 of the prediction's learner parts
    (runtime, learner state, micro-batch)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hub_footprint.py"), "--model", "tiny", "--steps", "2",
         "--prompt-tokens", "16", "--completion-tokens", "48", "--micro-tokens", "4096"],
        capture_output=True, text=True, timeout=600, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["micro_tokens"] == 4096
    assert 0.5 <= result["peak_rss"] / result["predicted_learner"] <= 2.0, result
