"""The GRPO learner: turns batches of scored groups into new policy weights.

Owns the fp32 master weights and the AdamW state; knows nothing of peers, leases, staleness
or the clock (the hub decides what goes into a batch and counts the steps: one `step` call is
one step, even when nothing in the batch could be trained on; a group's version is only the
label its `off_policy` diagnostics are tallied under: the hub turns them into lags).

Samples arrive as `echo2p2p.rows.SampleRow`s, parsed and validated once at admission (finite
logprobs <= 0, ids in the vocabulary, lengths): the learner trusts them, with cheap asserts.
A group the hub built wrong (rewards that do not match its samples, an empty or
out-of-vocabulary prompt) is dropped whole and counted in `StepStats.dropped_groups`.
Given the same inputs the learner is deterministic (no sampling, no dropout: `model.train()`
only matters for models that have them, and Qwen3's attention dropout is 0).

Memory: micro-batches are cut by a token budget (`micro_tokens`, padded tokens per forward),
so a batch of long completions takes more micro-batches, not more memory; activation
checkpointing (`checkpointing`) keeps one decoder layer's activations instead of all of them.
With `ranks` (`echo2p2p.hub.learning.ranks`) the model is sharded with FSDP2: each rank trains the
groups dealt to it (balanced by tokens), gradients are reduce-scattered, and every rank steps
its shard of the parameters and AdamW state. `iter_weights` gathers one tensor at a time, so no
rank ever holds a second full copy; checkpoints are `torch.distributed.checkpoint` directories,
sharded, and load on any rank count (a single process included).

Over 400 lines: training, publishing, checkpoints and evaluation all act on the one (possibly
sharded) model and walk its ranks in step; split, each file would re-explain the sharding.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from echo2p2p.buffer import ScoredGroup
from echo2p2p.completions import CompletionDecoder
from echo2p2p.policy.prompts import PLAIN, Prompt, PromptFormat, prompt_of

from . import grpo, off_policy
from .batches import Row, batch_rows, deal, left_padded, micro_batches, padded

if TYPE_CHECKING:
    from .ranks import Ranks

log = logging.getLogger(__name__)
# DCP on one rank says it "assumes a single process" at every save and load: it is one, on purpose.
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
# `grpo.policy_loss`'s stats as the step sums them: means over the call's tokens, means over
# its kept tokens (the mismatch mask's survivors), and counts
PER_TOKEN = ("policy_loss", "clip_frac", "dual_clip_frac", "ratio_mean", "kl")
PER_KEPT_TOKEN = ("tis_weight_mean", "tis_truncated_frac")
COUNTS = ("masked_samples", "masked_tokens", "kept_tokens")


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
    masked_samples: int  # samples the mismatch mask dropped (grpo item 7; 0 unless mask is on)
    masked_tokens: int  # their completion tokens (in `tokens`, not trained on)
    tis_weight_mean: float  # mean truncated IS weight over the kept tokens (1 without tis)
    tis_truncated_frac: float  # kept tokens whose IS weight the cap truncated (0 without tis)
    grad_norm: float  # before clipping
    tokens: int  # completion tokens in the batch (the loss denominator)
    samples: int  # samples kept
    groups: int  # groups kept, zero-variance ones included
    zero_variance_groups: int  # groups whose rewards were all equal: no policy gradient
    dropped_samples: int  # samples of the dropped groups (rows are valid by construction)
    dropped_groups: int  # groups the hub built wrong, discarded whole
    skipped: bool  # no optimiser update (nothing to train on, or a non-finite gradient)
    step_s: float  # seconds in forward, backward and the optimiser
    off_policy: off_policy.Tally | None = None  # ratios by behaviour version (trained rows)

    def metrics(self) -> dict[str, float]:
        """Flat `train/...` metrics for a logger (`off_policy` is not one: see its `summary`)."""
        out = {f"train/{k}": float(v) for k, v in asdict(self).items()
               if k not in ("loss", "off_policy")}
        out["train/loss"] = self.loss
        out["train/policy_loss"] = self.policy_loss
        return out


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
        mismatch_correction: str = "none",
        mismatch_tis_cap: float = 2.0,
        mismatch_mask_bound: float = 1.5,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        micro_tokens: int = 16384,
        pad_id: int = 0,
        ranks: Ranks | None = None,
        precision: str = "fp32",
        checkpointing: bool = False,
    ) -> None:
        """`micro_tokens`: padded tokens per micro-batch (a longer sample goes alone).
        `ranks`: shard over these (None: this process alone). `precision`: fp32, or bf16
        compute over fp32 master weights (gradients reduced in fp32). `checkpointing`:
        recompute each decoder layer's activations in the backward instead of keeping them.
        `mismatch_*`: the loss's correction for off-policy samples (`grpo.policy_loss`, item 7)."""
        if mismatch_correction not in grpo.MISMATCH_CORRECTIONS:
            raise ValueError(f"mismatch_correction must be one of {grpo.MISMATCH_CORRECTIONS}")
        self.correction = {"correction": mismatch_correction, "tis_cap": mismatch_tis_cap,
                           "mask_bound": mismatch_mask_bound}
        self.model = model.float()
        self.model.train()
        self.clip_eps = clip_eps
        self.kl_coef = kl_coef
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.micro_tokens = micro_tokens
        self.pad_id = pad_id
        self.ranks = ranks
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.reference: torch.nn.Module | None = None
        if kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        if checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self._autocast = precision == "bf16" and ranks is None  # sharded: FSDP's own policy
        if ranks is not None:
            ranks.shard(self.model, precision)
            if self.reference is not None:
                ranks.shard(self.reference, precision)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=lr, weight_decay=weight_decay, foreach=False, fused=False
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def leads(self) -> bool:
        """Whether this process is the one that publishes and scores (rank 0, or alone)."""
        return self.ranks is None or self.ranks.rank == 0

    # --- training ----------------------------------------------------------------------

    def step(self, groups: Sequence[ScoredGroup]) -> StepStats:
        """One optimiser step on `groups` (the caller counts it: `echo2p2p.hub` owns the step).
        Sharded, every rank gets the same `groups` and trains the ones dealt to it."""
        rows, info = batch_rows(groups, self.vocab_size)
        num_tokens = sum(len(r.behaviour) if r.trained is None else sum(r.trained) for r in rows)
        # A zero advantage gives exactly zero surrogate loss; without a KL term such a sample
        # has no gradient, so skip its forward. It still counts in the token denominator
        # (the batch token mean is over every sample the hub handed over).
        trainable = [r for r in rows if r.advantage != 0.0 or self.reference is not None]

        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        versions, bucket = off_policy.buckets([g.version for g in groups])  # the hub knows lags
        sums, ratio_max, trained, diag = self._accumulate(trainable, num_tokens, bucket)
        grad_norm, skipped = 0.0, True
        if trained:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded
            grad_norm = float(norm.item())
            if math.isfinite(grad_norm):
                self.optimizer.step()
                skipped = False
            else:
                log.warning("non-finite gradient norm: update skipped")
        self.optimizer.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - t0

        m, kept = max(trained, 1), sums["kept_tokens"]
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
            masked_samples=int(sums["masked_samples"]),
            masked_tokens=int(sums["masked_tokens"]),
            # means over the kept tokens; a step that kept none reports the neutral values
            tis_weight_mean=sums["tis_weight_mean"] / kept if kept else 1.0,
            tis_truncated_frac=sums["tis_truncated_frac"] / kept if kept else 0.0,
            grad_norm=grad_norm,
            tokens=num_tokens,
            samples=len(rows),
            groups=info["groups"],
            zero_variance_groups=info["zero_variance_groups"],
            dropped_samples=info["dropped_samples"],
            dropped_groups=info["dropped_groups"],
            skipped=skipped,
            step_s=step_s,
            off_policy=off_policy.Tally(tuple(versions), *diag),
        )

    def _accumulate(self, trainable: Sequence[Row], num_tokens: int, bucket: list[int]
                    ) -> tuple[dict[str, float], float, int, tuple[Tensor, Tensor]]:
        """Backward over this rank's micro-batches of `trainable`, gradients summed over all
        of them and all ranks: (token-weighted sums of the micro-batch statistics, the largest
        ratio, trained tokens, the `off_policy.tally` by `bucket[row.group]`), over all ranks."""
        keys = ("loss", *PER_TOKEN, *PER_KEPT_TOKEN, *COUNTS)
        sums, ratio_max, trained = dict.fromkeys(keys, 0.0), -math.inf, 0
        diag = off_policy.empty(max(bucket, default=-1) + 1)  # every version is some group's
        mine, runs = self._plan(trainable)
        # FSDP averages gradients over the ranks; the loss is a sum over them
        scale = 1.0 if self.ranks is None else float(self.ranks.world)
        for i in range(runs):
            if i >= len(mine):  # every rank runs as many as the busiest: a weightless one
                loss, _, _ = self._micro_step(trainable[:1], num_tokens, bucket)
                (loss * 0.0).backward()
                continue
            loss, stats, part = self._micro_step(mine[i], num_tokens, bucket)
            (loss * scale).backward()
            diag = off_policy.combined(diag, part)
            n = stats["tokens"]
            trained += int(n)
            sums["loss"] += float(loss.item())
            for k in PER_TOKEN:
                sums[k] += stats[k] * n
            for k in PER_KEPT_TOKEN:
                sums[k] += stats[k] * stats["kept_tokens"]
            for k in COUNTS:
                sums[k] += stats[k]
            ratio_max = max(ratio_max, stats["ratio_max"])
        if self.ranks is not None:
            totals, ratio_max = self.ranks.all_sum([*sums.values(), trained], ratio_max)
            sums, trained = dict(zip(keys, totals[:-1])), int(totals[-1])
            diag = self.ranks.all_sum_max(*diag)
        return sums, ratio_max, trained, diag

    def _plan(self, trainable: Sequence[Row]) -> tuple[list[list[Row]], int]:
        """This rank's micro-batches, and how many the busiest rank runs. Every rank deals the
        whole batch the same way, so each knows all the others' shares."""
        if self.ranks is None:
            mine = micro_batches(trainable, self.micro_tokens)
            return mine, len(mine)
        shares = [micro_batches(s, self.micro_tokens) for s in deal(trainable, self.ranks.world)]
        return shares[self.ranks.rank], max(len(s) for s in shares)

    def _micro_step(self, rows: Sequence[Row], num_tokens: int, bucket: list[int]
                    ) -> tuple[Tensor, dict[str, float], tuple[Tensor, Tensor]]:
        """Loss (over the whole batch's tokens), stats and `off_policy.tally` of a micro-batch."""
        dev = self.device
        input_ids, attention, completion, behaviour, advantages = (
            t.to(dev) for t in padded(rows, self.pad_id))

        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self._autocast):
            logprobs = grpo.token_logprobs(
                self.model, input_ids, attention, completion, self.temperature)  # (B, T)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = grpo.token_logprobs(
                        self.reference, input_ids, attention, completion, self.temperature)
        loss, stats = grpo.policy_loss(
            logprobs, behaviour, advantages, completion,
            clip_eps=self.clip_eps, ref_logprobs=ref, kl_coef=self.kl_coef,
            num_tokens=num_tokens, **self.correction,
        )
        return loss, stats, off_policy.tally(logprobs, behaviour, completion, torch.tensor(  # (B,)
            [bucket[r.group] for r in rows]), buckets=max(bucket) + 1, clip_eps=self.clip_eps)

    # --- publishing, checkpoints and evaluation ----------------------------------------

    def iter_weights(self, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, Tensor]]:
        """(HF state-dict name, detached contiguous CPU copy in `dtype`), one tensor at a time.

        Sharded, each tensor is gathered on every rank (all of them must iterate to the end, in
        step) and yielded on rank 0 only: no rank holds more than the model plus one full
        tensor. Integer buffers keep their dtype. A parameter shared under two names (tied
        embeddings: `lm_head.weight` is `model.embed_tokens.weight`) is given once, under its
        first name, as `save_pretrained` does; loaders of tied models do not expect the second.
        """
        unique = dict(self.model.named_parameters())
        aliases = {n for n, _ in self.model.named_parameters(remove_duplicate=False)} - set(unique)
        for name, t in self.model.state_dict().items():
            if name in aliases:
                continue
            if hasattr(t, "full_tensor"):  # a DTensor shard: gather it (a collective)
                t = t.full_tensor()
            if self.leads:
                cast = dtype if t.is_floating_point() else t.dtype
                yield name, t.detach().to("cpu", dtype=cast, copy=True).contiguous()

    def export_weights(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
        """`iter_weights` as one dict: a full copy in `dtype` (tests, the synchronous baseline)."""
        return dict(self.iter_weights(dtype))

    def save(self, where: Path) -> None:
        """Weights and AdamW state as a `torch.distributed.checkpoint` directory (every rank
        writes its shards; loadable on any rank count)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=where,
                 no_dist=self.ranks is None)

    def load(self, where: Path) -> None:
        """The state `save` wrote, whatever rank count wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optimizer": optimizer}
        dcp.load(state, checkpoint_id=where, no_dist=self.ranks is None)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    @torch.no_grad()
    def evaluate(
        self,
        tokenizer,
        problems: Sequence,
        score: Callable[[list[tuple[Any, str]]], list[float]] | None,
        *,
        max_new_tokens: int,
        batch_size: int = 64,
        prompts: PromptFormat = PLAIN,
    ) -> float:
        """Mean reward of greedy completions of `problems` (held-out accuracy). `score` maps
        a batch of (problem, completion text) to rewards (`echo2p2p.scoring.scorer.Scorer`, so that a
        verifier that hangs costs a deadline, not the run); texts follow the peers' rule, and
        prompts are rendered by `prompts` as the hub's leases are. Sharded, every rank calls it
        with the same problems and generates its share; rank 0 scores them all (the others
        pass `score` None and get 0)."""
        texts = self._completions(tokenizer, list(problems), max_new_tokens, batch_size, prompts)
        if score is None or not problems:
            return 0.0
        total = 0.0
        for start in range(0, len(problems), batch_size):
            batch = list(zip(problems[start:start + batch_size], texts[start:start + batch_size]))
            total += sum(float(r) for r in score(batch))
        return total / len(problems)

    def _completions(self, tokenizer, problems: list, max_new_tokens: int, batch_size: int,
                     prompts: PromptFormat) -> list[str]:
        """Greedy completion texts of `problems`, in order (sharded: on rank 0; the others
        get []). Each rank runs the same number of `generate` calls, in step (`synced_gpus`:
        a rank that finished keeps forwarding while the others need its shards)."""
        if not problems:
            return []
        world, rank = (1, 0) if self.ranks is None else (self.ranks.world, self.ranks.rank)
        own = list(range(rank, len(problems), world))
        calls = math.ceil(math.ceil(len(problems) / world) / batch_size)  # the same on every rank
        decoder = CompletionDecoder(tokenizer)
        done: list[tuple[int, str]] = []
        self.model.eval()
        try:
            for b in range(calls):
                picked = own[b * batch_size:(b + 1) * batch_size]
                batch = [problems[i] for i in picked] or problems[:1]  # a rank with none: a stand-in
                texts = self._generate(tokenizer, decoder, batch, max_new_tokens, prompts=prompts)
                done.extend(zip(picked, texts))
        finally:
            self.model.train()
        parts = [done] if self.ranks is None else self.ranks.gather_to_first(done)
        out = [""] * len(problems)
        for part in parts:
            for i, text in part:
                out[i] = text
        return out if self.leads else []

    def _generate(self, tokenizer, decoder: CompletionDecoder, batch: list, max_new_tokens: int,
                  *, prompts: PromptFormat) -> list[str]:
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        pad = pad if pad is not None else self.pad_id
        ids, attention = left_padded([encode_prompt(tokenizer, prompt_of(p), prompts)
                                      for p in batch], pad)  # (B, P)
        width = ids.shape[1]
        dev = self.device
        out = self.model.generate(
            input_ids=ids.to(dev), attention_mask=attention.to(dev),
            do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=pad, eos_token_id=eos, synced_gpus=self.ranks is not None,
        )  # (B, P + N)
        return [decoder.completion(row).text for row in out[:, width:].tolist()]


def encode_prompt(tokenizer, prompt: Prompt, prompts: PromptFormat = PLAIN) -> list[int]:
    """Prompt token ids (of text, or a conversation's messages) exactly as the hub leases them,
    rendered by `prompts` (the run's `TasksConfig.prompts`; default plain, no special tokens)."""
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
