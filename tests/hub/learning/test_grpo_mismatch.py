"""The loss's mismatch correction (grpo item 7): none is today's loss bit for bit, tis weights
each token's gradient by min(pi / mu, C), mask drops samples whose geometric-mean ratio is out of
bounds; in `policy_loss` and through the learner on a tiny real Qwen3."""

from __future__ import annotations

import math

import pytest
import torch

from echo2p2p.errors import ConfigError
from echo2p2p.hub.config_grpo import GrpoConfig
from echo2p2p.hub.learning.grpo import policy_loss, sequence_outliers
from echo2p2p.hub.learning.learner import Learner
from tests.hub.learning.test_learner import (COMPLETIONS, PROMPT, make_group, sequence_logprobs,
                                             tiny_model)


def clipped_surrogate(logp, behaviour, adv, mask, *, clip_eps=0.2, dual_clip=3.0, ref=None,
                      kl_coef=0.0):
    """The loss as it was before item 7, written out again: PPO's clip around the behaviour
    logprobs, the dual clip, a k3 KL term, token mean over the mask."""
    adv = adv[:, None].expand_as(logp)
    d = torch.where(mask, (logp - behaviour).clamp(-20, 20), torch.zeros_like(logp))
    r = torch.exp(d)
    obj = torch.minimum(r * adv, r.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    obj = torch.where((adv < 0) & (obj < dual_clip * adv), dual_clip * adv, obj)
    per_token = -obj
    if ref is not None:
        delta = (ref - logp).clamp(-20, 20)
        per_token = per_token + kl_coef * (torch.exp(delta) - delta - 1.0)
    return torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / mask.sum()


def batch(seed: int = 3):
    """Logprobs near their behaviour values, a few far off (some ratios past every bound)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(6, 7, generator=g) * 4  # (B, T)
    behaviour = logp + torch.randn(6, 7, generator=g) * 0.6
    mask = torch.rand(6, 7, generator=g) > 0.2
    mask[:, 0] = True
    adv = torch.randn(6, generator=g)
    return logp, behaviour, adv, mask


def grad_of(logp, *args, **kwargs):
    leaf = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(leaf, *args, **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad, stats


def test_none_is_the_clipped_surrogate_bit_for_bit():
    """correction='none' (and no correction named) gives today's loss and gradient exactly."""
    logp, behaviour, adv, mask = batch()
    ref = logp + 0.3
    for kwargs in ({}, {"correction": "none"}):
        loss, grad, stats = grad_of(logp, behaviour, adv, mask, ref_logprobs=ref, kl_coef=0.1,
                                    **kwargs)
        leaf = logp.clone().requires_grad_(True)
        expected = clipped_surrogate(leaf, behaviour, adv, mask, ref=ref, kl_coef=0.1)
        expected.backward()
        assert torch.equal(loss, expected.detach()) and torch.equal(grad, leaf.grad)
        assert stats["masked_samples"] == 0 and stats["tis_weight_mean"] == 1.0
        assert stats["tis_truncated_frac"] == 0.0 and stats["kept_tokens"] == mask.sum()


def test_tis_weights_each_token_by_its_ratio_truncated_at_the_cap():
    """Under tis d loss / d logp = -min(pi / mu, C) * A / N on every token, clipped or not."""
    logp, behaviour, adv, mask = batch()
    _, grad, stats = grad_of(logp, behaviour, adv, mask, correction="tis", tis_cap=2.0)
    ratio = torch.exp(logp - behaviour)
    expected = -ratio.clamp(max=2.0) * adv[:, None] / mask.sum()
    assert torch.allclose(grad[mask], expected[mask], rtol=1e-5)
    assert torch.all(grad[~mask] == 0)
    over = ratio[mask] > 2.0
    assert 0 < over.sum() < mask.sum()  # the batch has truncated and untruncated tokens
    assert stats["tis_truncated_frac"] == pytest.approx(over.float().mean().item())
    assert stats["tis_weight_mean"] == pytest.approx(ratio[mask].clamp(max=2.0).mean().item(),
                                                     rel=1e-5)


def test_tis_keeps_the_gradient_ppo_clips_away():
    """A token at ratio 1.5 with A > 0 gets no gradient from PPO's clip, 1.5 A from tis; one at
    ratio 5 gets the cap, 2 A, not 5 A."""
    logp = torch.tensor([[math.log(1.5)], [math.log(5.0)]])  # (B, T) over behaviour 0
    behaviour, adv, mask = torch.zeros(2, 1), torch.tensor([1.0, 1.0]), torch.ones(2, 1).bool()
    _, ppo, _ = grad_of(logp, behaviour, adv, mask)
    _, tis, stats = grad_of(logp, behaviour, adv, mask, correction="tis", tis_cap=2.0)
    assert torch.equal(ppo, torch.zeros(2, 1))
    assert tis[:, 0].tolist() == pytest.approx([-1.5 / 2, -2.0 / 2])
    assert stats["tis_truncated_frac"] == 0.5 and stats["clip_frac"] == 0.0


def test_mask_drops_a_sample_whose_geometric_mean_ratio_is_out_of_bounds():
    """A row at geometric-mean ratio 1/e (bound 1.5) contributes no loss and no gradient; the
    other rows' gradient is what it would be without it (same token denominator)."""
    logp, behaviour, adv, mask = batch()
    behaviour = logp + 0.01 * (behaviour - logp)  # every row near ratio 1 ...
    behaviour[2], adv[2] = logp[2] + 1.0, 1.0  # ... but row 2: every token at 1/e, A > 0
    _, grad, stats = grad_of(logp, behaviour, adv, mask, correction="mask", mask_bound=1.5)
    assert torch.all(grad[2] == 0)
    assert stats["masked_samples"] == 1 and stats["masked_tokens"] == mask[2].sum()
    assert stats["kept_tokens"] == mask.sum() - mask[2].sum()
    others = torch.ones(6, dtype=torch.bool)
    others[2] = False
    _, alone, _ = grad_of(logp[others], behaviour[others], adv[others], mask[others],
                          num_tokens=float(mask.sum()))
    assert torch.equal(grad[others], alone)
    _, unmasked, _ = grad_of(logp, behaviour, adv, mask)
    assert not torch.all(unmasked[2] == 0)  # without the mask, row 2 has a gradient


def test_mask_reads_the_sequence_not_its_worst_token():
    """One token at ratio 4 among nine at 1 keeps the sample (geometric mean 4^0.1 = 1.15)."""
    log_ratio = torch.zeros(2, 10)
    log_ratio[0, 3] = math.log(4.0)
    log_ratio[1] = math.log(1.6)  # every token at 1.6: out of [1/1.5, 1.5]
    mask = torch.ones(2, 10, dtype=torch.bool)
    assert sequence_outliers(log_ratio, mask, 1.5).tolist() == [False, True]
    assert sequence_outliers(-log_ratio, mask, 1.5).tolist() == [False, True]  # 1/1.6 too
    assert sequence_outliers(log_ratio, torch.zeros_like(mask), 1.5).tolist() == [False, False]


def test_tis_and_mask_together():
    """tis+mask: the dropped row has no gradient, the kept rows get the truncated weights."""
    logp, behaviour, adv, mask = batch()
    behaviour[4] = logp[4] + 2.0  # row 4: ratio e^-2 everywhere
    _, grad, stats = grad_of(logp, behaviour, adv, mask, correction="tis+mask", mask_bound=1.5)
    dropped = sequence_outliers(logp - behaviour, mask, 1.5)
    assert dropped[4] and stats["masked_samples"] == dropped.sum()
    assert torch.all(grad[dropped] == 0)
    kept = mask & ~dropped[:, None]
    expected = -torch.exp(logp - behaviour).clamp(max=2.0) * adv[:, None] / mask.sum()
    assert torch.allclose(grad[kept], expected[kept], rtol=1e-5)


def test_an_unknown_correction_is_refused():
    logp, behaviour, adv, mask = batch()
    with pytest.raises(ValueError, match="correction"):
        policy_loss(logp, behaviour, adv, mask, correction="is")
    with pytest.raises(ValueError, match="mismatch_correction"):
        Learner(tiny_model(), lr=1e-3, mismatch_correction="truncate")


@pytest.mark.parametrize(("field", "value"), [("mismatch_correction", "truncate"),
                                              ("mismatch_tis_cap", 1.0),
                                              ("mismatch_mask_bound", float("inf")),
                                              ("mismatch_mask_bound", 0.5)])
def test_config_names_the_field_and_the_fix(field, value):
    with pytest.raises(ConfigError) as err:
        GrpoConfig(**{field: value})
    assert err.value.field == field
    assert "tis+mask" in str(err.value) or "try 2" in str(err.value)


def forged_group(model, shift: float, rewards=(1.0, 0.0, 0.5, 0.0), lease: str = "forged"):
    """A group whose behaviour logprobs are the model's own plus `shift` on every token (shift
    > 0: ratios e^-shift, still valid logprobs <= 0 on the tiny model's ~uniform outputs)."""
    own = sequence_logprobs(model, PROMPT, COMPLETIONS)
    logprobs = [[min(lp + shift, 0.0) for lp in row] for row in own]
    return make_group(model, list(rewards), lease=lease, logprobs=logprobs)


def stepped(correction: str, groups_of) -> tuple[dict, object]:
    model = tiny_model()
    learner = Learner(model, lr=1e-3, mismatch_correction=correction, mismatch_mask_bound=1.5)
    stats = learner.step(groups_of(model))
    return {k: v.clone() for k, v in model.state_dict().items()}, stats


def test_learner_mask_trains_as_if_the_mismatched_group_carried_no_gradient():
    """With mask, a group at ratio e^-2 moves the weights exactly as a zero-advantage group of
    the same length does; without it, the same group moves them."""
    def good(m):
        return make_group(m, [1.0, 0.0, 0.0, 0.5])

    masked, stats = stepped("mask", lambda m: [good(m), forged_group(m, 2.0)])
    silent, _ = stepped("mask", lambda m: [good(m), forged_group(m, 2.0, rewards=[1.0] * 4)])
    plain, plain_stats = stepped("none", lambda m: [good(m), forged_group(m, 2.0)])
    assert stats.masked_samples == 4 and stats.masked_tokens == sum(map(len, COMPLETIONS))
    assert plain_stats.masked_samples == 0
    assert all(torch.allclose(masked[k], silent[k], atol=1e-6) for k in masked)
    assert any(not torch.allclose(plain[k], silent[k], atol=1e-6) for k in plain)


def test_learner_tis_on_policy_is_the_plain_step_and_truncates_a_stale_group():
    """On its own samples (ratio 1) tis updates like the clipped loss; on a group at ratio e^2
    every weight is truncated to the cap, and the step says so."""
    def own(m):
        return [make_group(m, [1.0, 0.0, 0.0, 0.5])]

    tis, stats = stepped("tis", own)
    plain, _ = stepped("none", own)
    assert all(torch.allclose(tis[k], plain[k], atol=1e-6) for k in tis)
    assert stats.tis_weight_mean == pytest.approx(1.0, abs=1e-4)
    assert stats.tis_truncated_frac == 0.0
    _, stale = stepped("tis", lambda m: [forged_group(m, -2.0)])
    assert stale.tis_truncated_frac == 1.0 and stale.tis_weight_mean == pytest.approx(2.0)
    metrics = stale.metrics()
    assert metrics["train/tis_truncated_frac"] == 1.0 and metrics["train/masked_samples"] == 0.0
