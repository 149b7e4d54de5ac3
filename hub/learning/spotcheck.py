"""Logprob spot-checks: recompute a peer's behaviour logprobs under the version it claims.

The learner divides by the behaviour logprobs a peer reports, so a peer that forges them, or
tags its rollout with a newer version than it used (to dodge the staleness rule), steers the
importance ratio. For a sampled share of groups (every one of a new or distrusted peer's: the
share is its trust record's, `echo2p2p.trust.check_fraction`) the hub loads the claimed version
as peers load it (the published bf16 state cast into an fp32 model) and recomputes each
completion token's logprob with `grpo.token_logprobs`, the learner's own function.

The rule: one statistic over the sequences, one bar for every engine and dtype. A group fails
when the mean |claimed - recomputed| over its checked tokens, the mean |log-ratio| a forgery
adds, exceeds `spot_check_tolerance` (0.2 nats; the welcome announces it). Measured by
bench/logprob_drift.py (real CPU engines, the presets' sampling; a loaded 2-core machine):

  per token, nats                   median   p99    max  | per group: max   forgeries' min
  SmolLM2-135M fp32 (912 tokens)    1.5e-6   2e-5   5e-5 |            5e-6
  SmolLM2-135M bf16 (887 tokens)    6.4e-3   0.20   0.60 |            0.033  near 0 0.44,
                                                         |   shuffled 0.62, scaled x0.5 0.22
  tiny bf16 (721 tokens)            1.4e-4   0.04   0.10 |            0.010  near 0 0.15

A per-token bound would have to clear bf16's 0.6 outliers, which every forgery hides under;
over a group the noise averages out (bench/spotcheck.py, tiny model, 900 bf16 groups over 8
real steps: p99 0.03, max 0.11), the forgeries do not. 0.2 is 6x the SmolLM2 bf16 worst, 2x
the tiny model's, 4e4x fp32's, and near log(1 + clip_eps) = 0.18, so a forgery slipping under
it moves the ratios about as much as the PPO clip bounds anyway. On SmolLM2 it fails every
near-0, shuffled and halved group (bench/spotcheck.py's forgers); on the tiny model, sure of
its answers, 67 % of near-0 and 83 % of shuffled ones (its halved ones, 8 %, move ratios by
0.13), and trust quarantines a peer failing twice (tests/hostile/test_bf16_peers.py: within
its probation). Why not a bar per dtype (fp32 could be held to 1e-3): the dtype is the
peer's word (`hello.dtype`), free to claim, so a liar would claim bf16 and get the loosest bar
anyway; one bar is that loosest bar, and it still catches the forgeries. vLLM in bf16 differs
from transformers by 1e-3 to 0.3 a token, ~0.05 over a sequence (vLLM issue #18352), inside
it. MoE or FP8 peers differ more: raise the tolerance (~0.5).
Real logprobs of an older published version under a newer tag fail only once the policy moved
more than the bar (tiny model: median 0.008 a step back): as harmless as staleness within S. A
tag never published fails always: the hub rejects one newer than its newest, and here one not
kept fails with reason "version".

Memory, for P parameters: one fp32 model copy, 4P bytes on the learner's device, plus the last
S + 1 published versions as the publisher hands them over. A hub started by `start_hub` keeps
those on disk, memory-mapped (`hub.overlay.versions.VersionFiles`: (S + 1) x 2P bytes of files in bf16,
~42 GB for a 7B model at S = 2, read back through the page cache when a check needs a version),
so they cost no RAM the hub holds; given tensors in RAM (tests), they cost (S + 1) x 2P of it.
`spot_check_tokens` = k compares k random tokens per sample and cuts the forward at the last:
less compute, the same memory. For a large model: a small fraction, k of 16 to 64, a small S.
Versions older than the first this process kept (a resumed hub) cannot be checked and pass.
Knows nothing of peers, trust or sockets; the hub decides what a failed check costs.

Every passed check also measures the engine-vs-learner mismatch, at the sample's own version
whatever its lag (`MismatchByLag`): per-token ratios and the k3 KL the step record carries as
`spot/mismatch_kl` and `spot/mismatch_by_lag`, where the learner's own `mismatch_kl` sees only
lag-0 tokens.
"""

from __future__ import annotations

import asyncio
import copy
import random
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from echo2p2p.buffer import ScoredGroup
from echo2p2p.policy.sampling import copy_state, nucleus_logprobs

from . import grpo
from ..config import HubConfig


@dataclass(frozen=True)
class SpotResult:
    """What one check found; `reason` None means the claim held (or could not be checked)."""

    version: int  # the version the peer claimed
    reason: str | None  # None | "logprob" (not reproduced) | "version" (never published here)
    tokens: int = 0  # completion tokens compared
    mean_abs_diff: float = 0.0  # nats, over those tokens
    max_abs_diff: float = 0.0

    @property
    def passed(self) -> bool:
        return self.reason is None

    def detail(self) -> dict[str, Any]:
        """What a run log record says of the check."""
        return {"version": self.version, "tokens": self.tokens,
                "mean_abs_diff": round(self.mean_abs_diff, 6),
                "max_abs_diff": round(self.max_abs_diff, 6)}


class MismatchByLag:
    """Sums of the passed checks' d = recomputed - claimed, by lag, until drained.

    The recompute is at the sample's own version, so d is the engine-vs-learner mismatch alone
    (bf16 kernels, the wire's rounding), whatever the lag; the learner's own `mismatch_kl`
    (`hub.learning.off_policy`) sees it only on lag-0 tokens. Lag: the newest published version
    when the check ran minus the sample's. KL: the k3 estimator exp(d) - d - 1 (Schulman 2020),
    as off_policy computes it; ratio exp(d), the importance ratio at lag 0. Failed checks
    (forgeries) are left out: they are refused, never trained.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # added to from the checks' thread, drained by the loop
        self._sums: dict[int, list[float]] = {}  # lag -> [tokens, k3, |d|, ratio, max |d|]

    def add(self, lag: int, d: torch.Tensor) -> None:
        """Tokens of one passed check at `lag`: d (N,), nats."""
        d = d.double()
        k3, ratio = float((d.exp() - d - 1).sum()), float(d.exp().sum())
        with self._lock:
            s = self._sums.setdefault(max(lag, 0), [0, 0.0, 0.0, 0.0, 0.0])
            s[0] += d.numel()
            s[1] += k3
            s[2] += float(d.abs().sum())
            s[3] += ratio
            s[4] = max(s[4], float(d.abs().max()))

    def drain(self) -> dict[str, Any]:
        """`spot/mismatch_kl`, `_abs_mean`, `_abs_max`, `_tokens` over every lag and
        `spot/mismatch_by_lag` {"lag": {kl, abs_mean, abs_max, ratio_mean, tokens}}; then
        start over. {} when no check passed since the last call."""
        with self._lock:
            sums, self._sums = self._sums, {}
        if not sums:
            return {}
        by_lag = {str(lag): {"kl": s[1] / s[0], "abs_mean": s[2] / s[0], "abs_max": s[4],
                             "ratio_mean": s[3] / s[0], "tokens": int(s[0])}
                  for lag, s in sorted(sums.items())}
        n = sum(s[0] for s in sums.values())
        return {"spot/mismatch_kl": sum(s[1] for s in sums.values()) / n,
                "spot/mismatch_abs_mean": sum(s[2] for s in sums.values()) / n,
                "spot/mismatch_abs_max": max(s[4] for s in sums.values()),
                "spot/mismatch_tokens": int(n), "spot/mismatch_by_lag": by_lag}


class SpotChecker:
    """The published weights of the last S + 1 versions and one model to recompute with."""

    def __init__(self, model: torch.nn.Module, cfg: HubConfig):
        """`model`: the learner's (copied, so its training is untouched)."""
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.keep_n = cfg.staleness.max_lag + 1  # every version a fresh rollout can carry
        self.fraction, self.sample_tokens = cfg.trust.spot_check_fraction, cfg.trust.spot_check_tokens
        self.tolerance, self.temperature, self.top_p = (
            cfg.trust.spot_check_tolerance, cfg.grpo.temperature, cfg.grpo.top_p)
        self._versions: dict[int, Mapping[str, torch.Tensor]] = {}
        self._since: int | None = None  # the first version kept by this process
        self._loaded: Mapping[str, torch.Tensor] | None = None  # the weights in self.model
        self._draw = random.Random(cfg.run.seed)
        self._positions = random.Random(cfg.run.seed + 1)
        self._book = threading.Lock()  # _versions: written from the publisher's thread
        # The model and the position draw: one check at a time, even when a cancelled check's
        # thread still runs.
        self._model_lock = threading.Lock()
        self._turn = asyncio.Lock()  # checks queue here, not as threads in the executor
        self._mismatch = MismatchByLag()

    @property
    def newest(self) -> int:
        """The newest version kept (the learner's latest published step), -1 before any."""
        with self._book:
            return max(self._versions, default=-1)

    def mismatch(self) -> dict[str, Any]:
        """The engine-vs-learner mismatch of the checks passed since the last call, by lag
        (`MismatchByLag.drain`): for the step record."""
        return self._mismatch.drain()

    def keep(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """`weights` (what peers load for `version`) become checkable; the oldest beyond S + 1
        go. The tensors are kept as they are, not copied: the caller must not modify them."""
        with self._book:
            self._versions[version] = weights
            self._since = version if self._since is None else min(self._since, version)
            for old in sorted(self._versions)[:-self.keep_n]:
                del self._versions[old]

    def wants(self, fraction: float | None = None) -> bool:
        """Whether to check the next submission (a seeded draw), of a peer whose record calls
        for checking `fraction` of its groups (None: `spot_check_fraction`, a clean record's)."""
        return self._draw.random() < (self.fraction if fraction is None else fraction)

    def check(self, group: ScoredGroup) -> Coroutine[Any, Any, SpotResult]:
        """Recompute `group`'s logprobs under its claimed version; await the result. The
        weights are looked up now, so a version dropped while the check waits still counts."""
        with self._book:
            weights, since = self._versions.get(group.version), self._since
        return self._check(group, weights, since)

    async def _check(self, group: ScoredGroup, weights: Mapping[str, torch.Tensor] | None,
                     since: int | None) -> SpotResult:
        if weights is None:
            unknowable = since is None or group.version < since
            return SpotResult(group.version, None if unknowable else "version")
        async with self._turn:
            return await asyncio.to_thread(self._compare, group, weights)

    def _compare(self, group: ScoredGroup, weights: Mapping[str, torch.Tensor]) -> SpotResult:
        with self._model_lock, torch.no_grad():
            diffs = self.token_diffs(group, weights)
        if not diffs:
            return SpotResult(group.version, None)
        diff = torch.cat(diffs).abs()  # (N,)
        mean, worst = float(diff.mean()), float(diff.max())
        result = SpotResult(group.version, "logprob" if mean > self.tolerance else None,
                            int(diff.numel()), mean, worst)
        if result.passed:  # a forgery's gap is not the engines' mismatch
            self._mismatch.add(self.newest - group.version, torch.cat(diffs))
        return result

    def token_diffs(self, group: ScoredGroup, weights: Mapping[str, torch.Tensor]
                    ) -> list[torch.Tensor]:
        """Per sample, d = recomputed - claimed logprob at its checked tokens, in nats, clamped
        to +-`grpo.LOG_RATIO_LIMIT` as the learner clamps a log-ratio (one token cannot make a
        mean infinite): (n_i,) each, [] for an empty group. exp(d) is the ratio the learner
        would apply at lag 0. Call under the model lock (bench/logprob_drift.py: alone)."""
        prompt = list(group.prompt_ids)
        # (ids, claimed logprobs, completion positions to check); rows were validated at
        # admission (echo2p2p.rows): non-empty, finite, ids in the vocabulary
        rows = [(list(r.token_ids), r.behaviour(), self._pick(r.trained()))
                for r in group.samples]
        if not rows or not prompt:
            return []
        p = len(prompt)
        width = p + max(pos[-1] for _, _, pos in rows) + 1  # nothing after the last position
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T), right-padded
        attention = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
        checked = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, T)
        claimed_t = torch.zeros((len(rows), width), dtype=torch.float32)  # (B, T)
        for i, (ids, claimed, pos) in enumerate(rows):
            n = min(len(ids), width - p)
            input_ids[i, :p + n] = torch.tensor(prompt + ids[:n])
            attention[i, :p + n] = 1
            checked[i, [p + j for j in pos]] = True
            claimed_t[i, p:p + n] = torch.tensor(claimed[:n])
        if self._loaded is not weights:
            copy_state(self.model, weights)
            self._loaded = weights
        dev = next(self.model.parameters()).device
        recomputed = self._logprobs(input_ids.to(dev), attention.to(dev), checked.to(dev))
        d = (recomputed.cpu() - claimed_t).clamp(-grpo.LOG_RATIO_LIMIT, grpo.LOG_RATIO_LIMIT)
        return [d[i][checked[i]] for i in range(len(rows))]  # (B, T) -> B x (n_i,)

    def _pick(self, trained: list[bool]) -> list[int]:
        """Sorted completion positions to check, among the model's (an episode's observation
        tokens have no behaviour logprob): all, or `sample_tokens` drawn at random."""
        mine = [j for j, t in enumerate(trained) if t]
        if not self.sample_tokens or self.sample_tokens >= len(mine):
            return mine
        return sorted(self._positions.sample(mine, self.sample_tokens))

    def _logprobs(self, input_ids: torch.Tensor, attention: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
        """(B, T) logprobs of the sampling distribution, as the peer's engine defines them."""
        if self.top_p >= 1:
            return grpo.token_logprobs(self.model, input_ids, attention, mask, self.temperature)
        # Nucleus sampling renormalises over the top-p set: the learner's plain softmax would
        # fail every honest peer, so recompute what the peer's engine reports.
        logits = self.model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
        b, t, v = logits.shape  # (B, T-1, V)
        lp = nucleus_logprobs(logits.reshape(b * t, v), self.temperature, self.top_p)
        picked = lp.view(b, t, v).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
        picked = torch.cat([picked.new_zeros(b, 1), picked], dim=1)  # (B, T)
        return torch.where(mask, picked, torch.zeros_like(picked))
