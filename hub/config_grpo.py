"""The GRPO section of the hub's configuration: groups, batch, optimizer, sampling, and the
loss's correction for off-policy samples.

A section of `echo2p2p.hub.config.HubConfig` like those of `echo2p2p.hub.config_sections`, in a
file of its own because that one reached the 600-line limit; it checks its own fields (the error
names the field and the fix).
"""

from __future__ import annotations

from dataclasses import dataclass

from echo2p2p.errors import ConfigError

MISMATCH_CORRECTIONS = ("none", "tis", "mask", "tis+mask")  # hub.learning.grpo, item 7


@dataclass(frozen=True)
class GrpoConfig:
    """GRPO and sampling: groups, batch, optimizer, and how peers sample."""

    group_size: int = 8
    """G, completions sampled per prompt (a GRPO group)."""
    prompts_per_step: int = 8
    """Prompt groups in one learner batch."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose G rewards are all equal (no policy gradient) is
    admitted and credited to its peer but not trained on; each batch is filled with
    prompts_per_step informative groups, and more leases go out per step to find them. On: no
    learner time on groups that teach nothing, more generation per step (and with kl_coef > 0
    those groups' KL term is lost)."""
    lr: float = 1e-3
    """AdamW learning rate. Unset: the built-in model's preset, or for another model of N
    parameters 1e-6 x sqrt(1e9 / N) within 5e-7 .. 5e-6 (1e-3 below 10 M, as the built-in)."""
    clip_eps: float = 0.2
    """PPO-style clip range of the importance ratio pi_theta / pi_behaviour."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the initial policy (0 = off, no reference model kept)."""
    temperature: float = 1.0
    """Sampling temperature on peers; the learner scores logprobs at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling on peers. Below 1 the behaviour logprobs no longer match the policy."""
    max_new_tokens: int = 8
    """Cap on completion length, in tokens. Unset: the built-in model's preset, or for another
    model 256 (8 below 10 M parameters, as the built-in)."""
    mismatch_correction: str = "none"
    """How the loss corrects for samples drawn by another policy than the learner's (staleness,
    engine numerics): none (PPO's clip around the peers' logprobs), tis (truncated importance
    sampling: each token's gradient weighted by min(pi_learner / pi_peer, mismatch_tis_cap),
    no clip), mask (a sample whose geometric-mean ratio is outside 1/mismatch_mask_bound ..
    mismatch_mask_bound is dropped), or tis+mask. Off by default: on stale batches both did worse
    than none, and no better on fresh ones (bench/mismatch.py; hub.learning.grpo, item 7)."""
    mismatch_tis_cap: float = 2.0
    """C of mismatch_correction tis: the cap on a token's importance weight. Higher: less bias,
    more variance (verl's rollout_is_threshold, 2 by default)."""
    mismatch_mask_bound: float = 1.5
    """B of mismatch_correction mask: samples whose geometric-mean ratio leaves 1/B .. B are
    dropped. Lower: fewer stale or mismatched samples trained on, fewer samples trained on."""

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 2 <= self.group_size <= 1024:  # 1024: what the wire decoder takes from a peer
            raise ConfigError("group_size", f"GRPO needs 2 to 1024 samples per group, got "
                                            f"{self.group_size}")
        for name in ("lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.mismatch_correction not in MISMATCH_CORRECTIONS:
            raise ConfigError("mismatch_correction", f"must be one of {', '.join(MISMATCH_CORRECTIONS)}"
                                                     f", got {self.mismatch_correction!r}")
        for name in ("mismatch_tis_cap", "mismatch_mask_bound"):
            if not 1 < getattr(self, name) < float("inf"):
                raise ConfigError(name, f"must be finite and > 1 (1 is an on-policy token's ratio; "
                                        f"try 2), got {getattr(self, name)}")
