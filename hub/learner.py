"""The GRPO learner: turns batches of scored groups into new policy weights.

Owns the fp32 master weights and the AdamW state; knows nothing of peers, leases, staleness,
versions or the clock (the hub decides what goes into a batch and counts the steps: one
`step` call is one step, even when nothing in the batch could be trained on).

Samples arrive as `echo2p2p.rows.SampleRow`s, parsed and validated once at admission (finite
logprobs <= 0, ids in the vocabulary, lengths): the learner trusts them, with cheap asserts.
A group the hub built wrong (rewards that do not match its samples, an empty or
out-of-vocabulary prompt) is dropped whole and counted in `StepStats.dropped_groups`.
Given the same inputs the learner is deterministic (no sampling, no dropout: `model.train()`
only matters for models that have them, and Qwen3's attention dropout is 0).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

from echo2p2p.buffer import ScoredGroup
from echo2p2p.completions import CompletionDecoder
from echo2p2p.policy.prompts import PLAIN, PromptFormat

from . import grpo

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class StepStats:
    """What one learner step did. Token-weighted means over the trained tokens."""

    loss: float  # total loss (surrogate + KL term), token mean over the batch
    policy_loss: float  # surrogate part only
    reward_mean: float  # over every sample of every kept group (hub's scores)
    reward_std: float
    clip_frac: float  # trained tokens whose gradient the ratio clip switched off
    dual_clip_frac: float
    ratio_mean: float  # mean pi_theta / pi_behaviour over trained tokens
    ratio_max: float
    kl: float  # k3 estimate against the reference (0 when kl_coef = 0)
    grad_norm: float  # before clipping
    tokens: int  # completion tokens in the batch (the loss denominator)
    samples: int  # samples kept
    groups: int  # groups kept, zero-variance ones included
    zero_variance_groups: int  # groups whose rewards were all equal: no policy gradient
    dropped_samples: int  # samples of the dropped groups (rows are valid by construction)
    dropped_groups: int  # groups the hub built wrong, discarded whole
    skipped: bool  # no optimiser update (nothing to train on, or a non-finite gradient)
    step_s: float  # seconds in forward, backward and the optimiser

    def metrics(self) -> dict[str, float]:
        """Flat `train/...` metrics for a logger."""
        out = {f"train/{k}": float(v) for k, v in asdict(self).items() if k != "loss"}
        out["train/loss"] = self.loss
        out["train/policy_loss"] = self.policy_loss
        return out


@dataclass(frozen=True)
class _Row:
    """One validated sample, ready to pad."""

    ids: list[int]  # prompt + completion
    prompt_len: int
    behaviour: list[float]  # one per completion token
    advantage: float


class Learner:
    """GRPO on fp32 master weights with AdamW; one `step` per batch of complete groups."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        temperature: float = 1.0,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        micro_batch: int = 64,
        pad_id: int = 0,
    ) -> None:
        self.model = model.float()
        self.model.train()
        self.clip_eps = clip_eps
        self.kl_coef = kl_coef
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.micro_batch = micro_batch
        self.pad_id = pad_id
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.reference: torch.nn.Module | None = None
        if kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=lr, weight_decay=weight_decay, foreach=False, fused=False
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- training ----------------------------------------------------------------------

    def step(self, groups: Sequence[ScoredGroup]) -> StepStats:
        """One optimiser step on `groups` (the caller counts it: `echo2p2p.hub` owns the step)."""
        rows, info = self._rows(groups)
        num_tokens = sum(len(r.behaviour) for r in rows)
        # A zero advantage gives exactly zero surrogate loss; without a KL term such a sample
        # has no gradient, so skip its forward. It still counts in the token denominator
        # (the batch token mean is over every sample the hub handed over).
        trainable = [r for r in rows if r.advantage != 0.0 or self.reference is not None]

        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums, ratio_max, trained = self._accumulate(trainable, num_tokens)
        grad_norm, skipped = 0.0, True
        if trained:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            grad_norm = float(norm.item())
            if math.isfinite(grad_norm):
                self.optimizer.step()
                skipped = False
            else:
                log.warning("non-finite gradient norm: update skipped")
        self.optimizer.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - t0

        m = max(trained, 1)
        return StepStats(
            loss=sums["loss"],
            # the surrogate part of the batch loss: per-token means were over trained tokens
            policy_loss=sums["policy_loss"] / max(num_tokens, 1),
            reward_mean=info["reward_mean"],
            reward_std=info["reward_std"],
            clip_frac=sums["clip_frac"] / m,
            dual_clip_frac=sums["dual_clip_frac"] / m,
            ratio_mean=sums["ratio_mean"] / m if trained else 1.0,
            ratio_max=ratio_max if trained else 1.0,
            kl=sums["kl"] / m,
            grad_norm=grad_norm,
            tokens=num_tokens,
            samples=len(rows),
            groups=info["groups"],
            zero_variance_groups=info["zero_variance_groups"],
            dropped_samples=info["dropped_samples"],
            dropped_groups=info["dropped_groups"],
            skipped=skipped,
            step_s=step_s,
        )

    def _accumulate(self, trainable: Sequence[_Row], num_tokens: int
                    ) -> tuple[dict[str, float], float, int]:
        """Backward over `trainable` in micro-batches, gradients summed: (token-weighted sums
        of the micro-batch statistics, the largest ratio, trained tokens)."""
        sums = {k: 0.0 for k in ("loss", "policy_loss", "clip_frac", "dual_clip_frac",
                                 "ratio_mean", "kl")}
        ratio_max, trained = -math.inf, 0
        for start in range(0, len(trainable), self.micro_batch):
            chunk = trainable[start:start + self.micro_batch]
            loss, stats = self._micro_step(chunk, num_tokens)
            loss.backward()
            n = stats["tokens"]
            trained += int(n)
            sums["loss"] += float(loss.item())
            for k in ("policy_loss", "clip_frac", "dual_clip_frac", "ratio_mean", "kl"):
                sums[k] += stats[k] * n
            ratio_max = max(ratio_max, stats["ratio_max"])
        return sums, ratio_max, trained

    def _micro_step(self, rows: Sequence[_Row], num_tokens: int) -> tuple[Tensor, dict[str, float]]:
        """Loss of one micro-batch, normalised by the whole batch's token count."""
        width = max(len(r.ids) for r in rows)
        b = len(rows)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)  # (B, T)
        attention = torch.zeros((b, width), dtype=torch.long)  # (B, T)
        completion = torch.zeros((b, width), dtype=torch.bool)  # (B, T)
        behaviour = torch.zeros((b, width), dtype=torch.float32)  # (B, T)
        for i, r in enumerate(rows):
            n = len(r.ids)
            input_ids[i, :n] = torch.tensor(r.ids, dtype=torch.long)
            attention[i, :n] = 1
            completion[i, r.prompt_len:n] = True
            behaviour[i, r.prompt_len:n] = torch.tensor(r.behaviour, dtype=torch.float32)
        advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)  # (B,)
        dev = self.device
        input_ids, attention, completion = input_ids.to(dev), attention.to(dev), completion.to(dev)
        behaviour, advantages = behaviour.to(dev), advantages.to(dev)

        logprobs = grpo.token_logprobs(
            self.model, input_ids, attention, completion, self.temperature)  # (B, T)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = grpo.token_logprobs(
                    self.reference, input_ids, attention, completion, self.temperature)
        return grpo.policy_loss(
            logprobs, behaviour, advantages, completion,
            clip_eps=self.clip_eps, ref_logprobs=ref, kl_coef=self.kl_coef,
            num_tokens=num_tokens,
        )

    def _rows(self, groups: Sequence[ScoredGroup]) -> tuple[list[_Row], dict]:
        """Rows to pad, with advantages from each group's rewards; groups built wrong dropped."""
        rows: list[_Row] = []
        rewards_all: list[float] = []
        kept = zero_var = dropped_samples = dropped_groups = 0
        for g in groups:
            prompt = list(g.prompt_ids)
            if (len(g.rewards) != len(g.samples) or not g.samples or not prompt
                    or not all(math.isfinite(r) for r in g.rewards)
                    or not all(0 <= t < self.vocab_size for t in prompt)):
                dropped_groups += 1
                dropped_samples += len(g.samples)
                continue
            adv = grpo.group_advantages(torch.tensor(g.rewards, dtype=torch.float32)).tolist()
            kept += 1
            zero_var += all(a == 0.0 for a in adv)
            rewards_all.extend(g.rewards)
            for sample, a in zip(g.samples, adv):
                assert sample.token_ids and max(sample.token_ids) < self.vocab_size, "unparsed row"
                # <= 0 in exact arithmetic; a float32 hair above (echo2p2p.rows.MAX_LOGPROB) is 0
                rows.append(_Row(prompt + list(sample.token_ids), len(prompt),
                                 [min(x, 0.0) for x in sample.logprobs], float(a)))
        r = torch.tensor(rewards_all, dtype=torch.float64)
        info = {
            "reward_mean": float(r.mean()) if len(rewards_all) else 0.0,
            "reward_std": float(r.std(unbiased=False)) if len(rewards_all) else 0.0,
            "groups": kept, "zero_variance_groups": zero_var,
            "dropped_samples": dropped_samples, "dropped_groups": dropped_groups,
        }
        return rows, info

    # --- publishing and evaluation -----------------------------------------------------

    def export_weights(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
        """HF state-dict names -> detached, contiguous CPU copies in `dtype`.

        A tensor shared under two names (tied embeddings: `lm_head.weight` is
        `model.embed_tokens.weight`) is exported once, under its first name, as
        `save_pretrained` does; loaders of tied models do not expect the second name.
        """
        out: dict[str, Tensor] = {}
        seen: set[int] = set()
        for name, t in self.model.state_dict().items():
            ptr = t.data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            out[name] = t.detach().to("cpu", dtype=dtype, copy=True).contiguous()
        return out

    @torch.no_grad()
    def evaluate(
        self,
        tokenizer,
        problems: Sequence,
        score: Callable[[list[tuple[str, str]]], list[float]],
        *,
        max_new_tokens: int,
        batch_size: int = 64,
        prompts: PromptFormat = PLAIN,
    ) -> float:
        """Mean reward of greedy completions of `problems` (held-out accuracy). `score` maps
        a batch of (answer, completion text) to rewards (`echo2p2p.scoring.scorer.Scorer`, so that a
        verifier that hangs costs a deadline, not the run); texts follow the peers' rule, and
        prompts are rendered by `prompts` as the hub's leases are."""
        if not problems:
            return 0.0
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        pad = pad if pad is not None else self.pad_id
        dev = self.device
        decoder = CompletionDecoder(tokenizer)
        total = 0.0
        self.model.eval()
        try:
            for start in range(0, len(problems), batch_size):
                batch = problems[start:start + batch_size]
                encoded = [encode_prompt(tokenizer, p.prompt, prompts) for p in batch]
                width = max(len(e) for e in encoded)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)  # (B, P)
                attention = torch.zeros((len(batch), width), dtype=torch.long)  # (B, P)
                for i, e in enumerate(encoded):  # left padding: generation appends on the right
                    ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
                    attention[i, width - len(e):] = 1
                out = self.model.generate(
                    input_ids=ids.to(dev), attention_mask=attention.to(dev),
                    do_sample=False, max_new_tokens=max_new_tokens,
                    pad_token_id=pad, eos_token_id=eos,
                )  # (B, P + N)
                texts = [decoder.completion(row).text for row in out[:, width:].tolist()]
                total += sum(float(r) for r in score([(p.answer, t) for p, t in zip(batch, texts)]))
        finally:
            self.model.train()
        return total / len(problems)


def encode_prompt(tokenizer, prompt: str, prompts: PromptFormat = PLAIN) -> list[int]:
    """Prompt token ids exactly as the hub leases them, rendered by `prompts` (the run's
    `HubConfig.prompts`; default plain text, no special tokens added)."""
    return prompts.encode(tokenizer, prompt)



def hold_step_time(learner: Learner, seconds: float, real_s: list[float] | None = None) -> None:
    """Make every step of `learner` last at least `seconds`: the real step, then a sleep, with
    the padded time as its `step_s` (which the hub's busy fraction and T_train estimate read).
    A stand-in for a large model's learner in benchmarks and tests; the real step times are
    appended to `real_s` if given. Call it before the first step."""
    real_step = learner.step

    def step(batch):
        start = time.perf_counter()
        stats = real_step(batch)
        if real_s is not None:
            real_s.append(stats.step_s)
        time.sleep(max(0.0, seconds - (time.perf_counter() - start)))
        return replace(stats, step_s=time.perf_counter() - start)

    learner.step = step
