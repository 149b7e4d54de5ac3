"""GRPO maths: advantages, the clipped surrogate, per-token logprobs."""

from __future__ import annotations

import pytest
import torch
import transformers

from echo2p2p.hub.learning.grpo import group_advantages, policy_loss, token_logprobs


def tiny_model(vocab_size: int = 48, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )
    return transformers.Qwen3ForCausalLM(config).float()


def test_advantages_zero_mean_unit_std():
    """Advantages of varied rewards have zero mean and unit (population) std."""
    adv = group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 2.0]))
    assert abs(adv.mean().item()) < 1e-6
    assert adv.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)


def test_advantages_order_follows_rewards():
    """A higher reward never gets a lower advantage."""
    rewards = torch.tensor([0.3, -1.0, 2.0, 0.0])
    adv = group_advantages(rewards)
    assert torch.equal(torch.argsort(adv), torch.argsort(rewards))


def test_advantages_equal_rewards_are_zero():
    """All-equal rewards (and a single sample) give exact zeros, not eps noise."""
    assert torch.equal(group_advantages(torch.full((8,), 0.7)), torch.zeros(8))
    assert torch.equal(group_advantages(torch.tensor([1.0])), torch.zeros(1))


def test_ratio_one_gradient_is_reinforce():
    """With pi = behaviour the gradient is the token-mean REINFORCE gradient of -A * logp."""
    torch.manual_seed(0)
    base = torch.randn(3, 5)  # (B, T)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.5, -0.5, -1.0])  # (B,)
    logp = base.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, base.clone(), adv, mask)
    loss.backward()

    ref = base.clone().requires_grad_(True)
    (-(adv[:, None] * ref * mask).sum() / mask.sum()).backward()
    assert torch.allclose(logp.grad, ref.grad, atol=1e-6)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_frac"] == 0.0


def test_clip_blocks_gradient_past_trust_region():
    """Ratio beyond 1+eps with A > 0, or below 1-eps with A < 0, gives no gradient."""
    behaviour = torch.zeros(4, 1)
    log_ratio = torch.log(torch.tensor([[1.5], [0.5], [1.5], [0.5]]))  # (B, T)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    logp = log_ratio.clone().requires_grad_(True)
    _, stats = policy_loss(logp, behaviour, adv, torch.ones(4, 1, dtype=torch.bool),
                           clip_eps=0.2, dual_clip=None)
    loss, _ = policy_loss(logp, behaviour, adv, torch.ones(4, 1, dtype=torch.bool),
                          clip_eps=0.2, dual_clip=None)
    loss.backward()
    grad = logp.grad[:, 0]
    assert grad[0] == 0.0 and grad[1] == 0.0  # clipped in the advantage's direction
    assert grad[2] != 0.0 and grad[3] != 0.0  # moving back toward the data: not clipped
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_dual_clip_bounds_exploded_ratio():
    """A forged behaviour logprob (ratio ~ e^20) with A < 0 gives a bounded loss, no gradient."""
    logp = torch.tensor([[-0.1]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.tensor([[-1000.0]]), torch.tensor([-1.0]),
                              torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    assert loss.item() == pytest.approx(3.0)
    assert logp.grad.item() == 0.0
    assert stats["dual_clip_frac"] == 1.0


def test_mask_excludes_padding():
    """Garbage (even inf/nan) at masked positions changes neither loss nor gradient."""
    torch.manual_seed(1)
    logp = torch.randn(2, 4)
    behaviour = logp + 0.05 * torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    dirty_b = behaviour.clone()
    dirty_b[~mask] = float("nan")
    dirty_l = logp.clone()
    dirty_l[~mask] = 50.0

    a = logp.clone().requires_grad_(True)
    b = dirty_l.clone().requires_grad_(True)
    loss_a, _ = policy_loss(a, behaviour, adv, mask)
    loss_b, _ = policy_loss(b, dirty_b, adv, mask)
    loss_a.backward()
    loss_b.backward()
    assert torch.isfinite(loss_b) and loss_a.item() == pytest.approx(loss_b.item())
    assert torch.allclose(a.grad, b.grad) and torch.all(b.grad[~mask] == 0)


def test_num_tokens_makes_micro_batches_add_up():
    """Micro-batch losses normalised by the batch's token count sum to the full-batch loss."""
    torch.manual_seed(2)
    logp, behaviour = torch.randn(4, 6), torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.3
    adv = torch.randn(4)
    full, _ = policy_loss(logp, behaviour, adv, mask)
    n = int(mask.sum())
    parts = [policy_loss(logp[i:i + 2], behaviour[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                         num_tokens=n)[0] for i in (0, 2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-5)


def test_kl_term_zero_at_reference_and_positive_away():
    """The k3 KL is 0 when pi = ref and positive otherwise."""
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, same = policy_loss(logp, logp, torch.zeros(1), mask, ref_logprobs=logp, kl_coef=0.1)
    loss, off = policy_loss(logp, logp, torch.zeros(1), mask, ref_logprobs=logp - 0.5, kl_coef=0.1)
    assert same["kl"] == pytest.approx(0.0) and off["kl"] > 0
    assert loss.item() == pytest.approx(0.1 * off["kl"], rel=1e-5)


def test_token_logprobs_match_manual():
    """token_logprobs equals log_softmax(logits / T) of each token given its own prefix."""
    model = tiny_model().eval()
    ids = torch.tensor([[5, 9, 3, 7, 2, 0], [4, 4, 8, 1, 6, 11]])  # (B, T); row 0 padded at 5
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6])
    completion = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    temperature = 0.7
    with torch.no_grad():
        got = token_logprobs(model, ids, attention, completion, temperature)  # (B, T)
        for b in range(2):
            for t in range(6):
                if not completion[b, t]:
                    assert got[b, t] == 0.0
                    continue
                logits = model(input_ids=ids[b:b + 1, :t]).logits[0, -1] / temperature  # (V,)
                want = torch.log_softmax(logits.float(), dim=-1)[ids[b, t]]
                assert got[b, t].item() == pytest.approx(want.item(), abs=1e-4)
