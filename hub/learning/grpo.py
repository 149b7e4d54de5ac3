"""GRPO maths: group-normalised advantages and a clipped, staleness-corrected surrogate loss.

Pure functions over tensors; no state, no optimiser, no knowledge of peers or the wire. The
learner (`echo2p2p.hub.learning.learner`) builds the batch and owns the optimiser.

Simplifications chosen (in the spirit of nanochat's `scripts/chat_rl.py`):

1. Advantage = (r - mean) / (std + eps) over the G samples of one prompt (GRPO, Shao et al.
   2024, arXiv 2402.03300), one scalar per sample broadcast to all its tokens. Population std
   (unbiased=False), so G = 2 gives +-1. A group whose rewards are all equal gets zeros and so
   no policy gradient.
2. No separate "old policy" pass. The behaviour logprobs a peer reports are the denominator of
   the importance ratio; they come from a version up to S steps behind (and from bf16-rounded
   weights), so the ratio corrects for staleness and for the rounding at once. This is PPO's
   clipped surrogate (Schulman et al. 2017, arXiv 1707.06347) with the behaviour policy as the
   anchor, i.e. a one-sided trust region around the data, not around the learner's last step.
3. Dual clip (Ye et al. 2020, arXiv 1912.09729; verl's `clip_ratio_c = 3`): for A < 0 the loss
   is capped at -c*A. Without it a single token whose ratio exploded (stale data, or a forged
   behaviour logprob) gives an unbounded loss and a gradient that grad-norm clipping can only
   rescale, not ignore. The log-ratio is also clamped to +-20 before exp so nothing overflows.
4. Token-level mean over the whole batch (DAPO, Yu et al. 2025, arXiv 2503.14476): the summed
   per-token loss is divided by the number of completion tokens in the batch, not averaged per
   sequence first. Long completions then weigh in proportion to their length and the loss of a
   micro-batch is comparable across micro-batches: pass `num_tokens` = tokens in the *whole*
   batch and sum the micro-batch losses to get exactly the full-batch loss.
5. Optional KL to a frozen reference with the k3 estimator exp(q - p) - (q - p) - 1 (Schulman,
   "Approximating KL divergence", 2020), added per token inside the same token mean. Off by
   default (kl_coef = 0), as in DAPO and Dr. GRPO.
6. No entropy bonus, no length penalty, no std-free (Dr. GRPO) variant.
7. Mismatch correction (`grpo.mismatch_correction`, off by default). The behaviour policy mu
   (a peer's engine, at the sample's version) is not the learner's pi, both by staleness and by
   numerics (bf16, kernels); item 2 anchors PPO's clip at mu, which *drops* the gradient of every
   token whose ratio left [1 - eps, 1 + eps] in the advantage's direction (6-10 % of tokens at
   one version of lag on SmolLM2-135M). The frameworks that face this offer two fixes, and so do we:
   - `tis`, truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
     secretly brings you off-policy RL training"; verl's `rollout_is` in bypass + policy
     gradient mode, slime's `--use-tis`, prime-rl's loss): the token's gradient is
     sg(min(pi / mu, C)) * A * grad log pi, with no PPO clip. This is AReaL's decoupled PPO
     (Fu et al. 2025, arXiv 2505.24298; Hilton et al. 2021, arXiv 2110.00641) with the
     proximal policy = the learner's current weights: each batch gets one optimiser update, so
     the proximal ratio is 1 where the gradient is taken and its clip never binds; the bias is
     bounded by C instead of by the clip, and no token is switched off.
   - `mask`, sequence-level masked importance sampling (verl's geometric rejection sampling,
     prime-rl's sequence masking, slime's MIS): a sample whose geometric-mean ratio
     exp(mean_t log(pi / mu)) lies outside [1/B, B] is dropped whole (no gradient, KL term
     included) and the rest keep item 2's loss. A dropped sample still counts in the token
     denominator, as a zero-advantage one does, so micro-batch losses still add up (prime-rl
     normalises the same way; verl drops it from the denominator).
   - `tis+mask`: both. The ratio is pi at the learner's current version over mu, so lag > 0
     mixes staleness with numerics: the weights correct both, as item 2's ratio does.
   Measured (bench/mismatch.py, tiny model, 60 steps, same seeds, held-out accuracy of 256):
   at the hub's defaults (S = 2, lr 1e-3, 0.5-1 % of tokens clipped) every arm ends within
   noise (none 0.79/0.79/0.78 on seeds 0-2, tis 0.80/0.77/0.75, mask = none); where staleness
   dominates (lag 4, lr 3e-3, a bf16 engine, 9-12 % clipped) none 0.68/0.60, mask 0.55/0.56,
   tis 0.47/0.34: without a clip around the data, stale samples push the policy on past where
   they were drawn. The frameworks that run tis are one step off-policy at lr ~1e-6, where the
   ratio is mostly numerics; here it is mostly staleness, and the clip is the better tool.
   Hence off by default.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config_grpo import MISMATCH_CORRECTIONS

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: far past any clip range, still finite in fp32


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """(r - mean) / (std + eps) over one group; all-equal rewards give exact zeros."""
    rewards = rewards.float()  # (G,)
    if rewards.numel() < 2 or bool((rewards == rewards[0]).all()):
        # exact test: mean() of equal floats is not always equal to them, and the rounding
        # residue divided by std + eps would become a spurious +-1 advantage
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()  # (G,)
    return centred / (rewards.std(unbiased=False) + eps)  # (G,)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    temperature: float,
) -> Tensor:
    """(B, T) logprob of each token given its prefix under softmax(logits / T); 0 where masked.

    Position t holds log p(input_ids[:, t] | input_ids[:, :t]). Position 0 has no prefix and is
    always 0, so a completion mask must never select it (a prompt has at least one token).
    Right padding is assumed: positions of real tokens then start at 0 and the causal mask keeps
    padding out of every real token's view.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    # position t predicts token t + 1; the last predicts nothing (a stand-in target, its
    # logprob dropped, so its gradient is exactly 0): no slice of the logits, whose backward
    # would allocate another (B, T, V)
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # (B, T)
    logprobs = _TargetLogprob.apply(logits, targets, temperature)[:, :-1]  # (B, T-1)
    logprobs = torch.cat([logprobs.new_zeros(logprobs.shape[0], 1), logprobs], dim=1)  # (B, T)
    return torch.where(completion_mask.bool(), logprobs, torch.zeros_like(logprobs))


class _TargetLogprob(torch.autograd.Function):
    """log softmax(logits / T)[target] over the vocabulary, in fp32. The (B, T, V) logits are
    the largest tensors of a step on a real vocabulary: this keeps them alone for the backward
    and computes the gradient, g (onehot - softmax) / T, in one more (B, T, V) buffer, where
    autograd's own graph of gather - logsumexp kept the scaled copy and made several."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
        scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
        lse = torch.logsumexp(scaled, dim=-1)  # (B, T)
        picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return picked - lse

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        scale = grad.unsqueeze(-1).float() / ctx.temperature  # (B, T, 1)
        out = logits.to(torch.float32, copy=True)  # (B, T, V): becomes the gradient in place
        if ctx.temperature != 1.0:
            out.div_(ctx.temperature)
        out.sub_(lse.unsqueeze(-1)).exp_().mul_(-scale)  # -g softmax / T
        out.scatter_add_(-1, targets.unsqueeze(-1), scale)  # + g onehot / T
        return out.to(logits.dtype), None, None


def policy_loss(
    logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_eps: float = 0.2, dual_clip: float | None = 3.0, ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0, num_tokens: float | None = None,
    correction: str = "none", tis_cap: float = 2.0, mask_bound: float = 1.5,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped importance-ratio surrogate, token mean over `num_tokens` (default: mask.sum()),
    with the mismatch `correction` of item 7 (none, tis: weights capped at `tis_cap`, mask:
    samples outside [1/`mask_bound`, `mask_bound`] dropped, tis+mask).

    logprobs, behaviour_logprobs, mask, ref_logprobs: (B, T); advantages: (B,) or (B, T).
    Returns (scalar loss, stats). Stats are means over the masked tokens of *this* call
    (weight them by stats["tokens"] to combine micro-batches): policy_loss (surrogate part,
    token mean), clip_frac (tokens whose gradient the clip switched off), dual_clip_frac,
    ratio_mean, ratio_max, kl (k3, 0 without a reference), tokens; and the correction's
    (`_correction_stats`): masked_samples, masked_tokens and kept_tokens (counts), and over the
    kept tokens tis_weight_mean and tis_truncated_frac (weight them by kept_tokens).
    """
    if correction not in MISMATCH_CORRECTIONS:
        raise ValueError(f"correction must be one of {MISMATCH_CORRECTIONS}, got {correction!r}")
    mask = mask.bool()  # (B, T)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)  # (B, T)
    advantages = advantages.to(logprobs.dtype)
    behaviour_logprobs = behaviour_logprobs.to(logprobs.dtype)

    log_ratio = (logprobs - behaviour_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    dropped = torch.zeros_like(mask[:, 0])  # (B,)
    if correction in ("mask", "tis+mask"):
        dropped = sequence_outliers(log_ratio.detach(), mask, mask_bound)
    keep = mask & ~dropped[:, None]  # (B, T)
    weight = ratio.detach().clamp(max=tis_cap) if correction in ("tis", "tis+mask") else None
    if weight is not None:
        objective = _truncated_is(weight, logprobs, advantages, mask)
        clip_active = dual_active = torch.zeros_like(mask)
    else:
        objective, clip_active, dual_active = _clipped(ratio, advantages, clip_eps, dual_clip)
    per_token = -objective  # (B, T)

    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        kl = _k3(ref_logprobs.to(logprobs.dtype), logprobs)
        per_token = per_token + kl_coef * kl

    zero = torch.zeros_like(per_token)
    denom = float(num_tokens) if num_tokens is not None else float(mask.sum().item())
    denom = max(denom, 1.0)
    loss = torch.where(keep, per_token, zero).sum() / denom
    with torch.no_grad():
        stats = _token_means(mask, torch.where(keep, objective, zero), keep & clip_active,
                             keep & dual_active, ratio=ratio, kl=kl)
        stats.update(_correction_stats(mask, keep, dropped, ratio, weight, tis_cap))
    return loss, stats


def sequence_outliers(log_ratio: Tensor, mask: Tensor, bound: float) -> Tensor:
    """(B,) bool: rows whose geometric-mean ratio exp(mean of `log_ratio` over the row's masked
    tokens) lies outside [1/bound, bound]. A row without tokens is never an outlier."""
    tokens = mask.sum(dim=1)  # (B,)
    mean = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1)  # (B,)
    mean = mean / tokens.clamp(min=1)
    return (mean.abs() > math.log(bound)) & (tokens > 0)


def _truncated_is(weight: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Item 7's tis objective (B, T): value w A, gradient w A grad log pi (w held constant)."""
    own = torch.where(mask, logprobs - logprobs.detach(), torch.zeros_like(logprobs))  # 0
    return weight * advantages * torch.exp(own)


def _clipped(ratio: Tensor, advantages: Tensor, clip_eps: float, dual_clip: float | None
             ) -> tuple[Tensor, Tensor, Tensor]:
    """Item 2-3's objective (B, T), and where the clip and the dual clip were active."""
    unclipped = ratio * advantages  # (B, T)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages  # (B, T)
    objective = torch.minimum(unclipped, clipped)  # (B, T)
    dual_active = torch.zeros_like(ratio, dtype=torch.bool)
    if dual_clip is not None:
        floor = dual_clip * advantages  # (B, T): only binds where A < 0
        dual_active = (advantages < 0) & (objective < floor)
        objective = torch.where(dual_active, floor, objective)
    # the clip switched the gradient off where min() picked the (constant) clipped branch
    return objective, clipped < unclipped, dual_active


def _correction_stats(mask: Tensor, keep: Tensor, dropped: Tensor, ratio: Tensor,
                      weight: Tensor | None, tis_cap: float) -> dict[str, float]:
    """What the correction did: samples and tokens masked, and over the kept tokens the mean IS
    weight on the policy gradient (1 without tis) and the share truncated at the cap."""
    kept = int(keep.sum().item())
    out = {"masked_samples": float(dropped.sum().item()),
           "masked_tokens": float((mask & dropped[:, None]).sum().item()),
           "kept_tokens": float(kept), "tis_weight_mean": 1.0, "tis_truncated_frac": 0.0}
    if weight is not None and kept:
        out["tis_weight_mean"] = float(weight[keep].sum().item() / kept)
        out["tis_truncated_frac"] = float((keep & (ratio > tis_cap)).sum().item() / kept)
    return out


def _k3(ref_logprobs: Tensor, logprobs: Tensor) -> Tensor:
    """(B, T) k3 estimator of KL(pi || ref) on samples drawn from (approximately) pi."""
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # (B, T)
    return torch.exp(delta) - delta - 1.0


def _token_means(mask: Tensor, objective: Tensor, clip_active: Tensor, dual_active: Tensor,
                 *, ratio: Tensor, kl: Tensor) -> dict[str, float]:
    """`policy_loss`'s stats: means over the masked tokens (all (B, T))."""
    zero = torch.zeros_like(objective)
    n = int(mask.sum().item())
    m = max(n, 1)
    return {
        "policy_loss": float(torch.where(mask, -objective, zero).sum().item() / m),
        "clip_frac": float(clip_active.sum().item() / m),
        "dual_clip_frac": float(dual_active.sum().item() / m),
        "ratio_mean": float(torch.where(mask, ratio, zero).sum().item() / m) if n else 1.0,
        "ratio_max": float(ratio[mask].max().item()) if n else 1.0,
        "kl": float(torch.where(mask, kl, zero).sum().item() / m),
        "tokens": float(n),
    }
