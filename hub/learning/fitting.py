"""The hub's config fitted to its model, its disk budgets and its memory budget, before it starts.

`fit(cfg, shape, budget_bytes, peers)` is what a start does and what `--print-config` shows:
the checkpoint cadence and the catch-up depth within their disk budgets
(`checkpoint_bytes_per_version`, `catch_up_disk_bytes`), learner micro-batches within
`learner_micro_bytes`, then within the memory budget (`--max-memory`, or the memory available
at start) less the demo's local peers; the predicted footprint; and, for each field it changed,
why. A budget that even the smallest micro-batch overruns is refused (ConfigError on
"max_memory", the sentence naming what to change) when the user set it; the machine's available
memory, a snapshot on a shared machine, only earns a warning (`Fitted.warning`).

Plain arithmetic over the config and the model's shape (`echo2p2p.learner_size`): no model,
no psutil, no files; the caller reads the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from echo2p2p.errors import ConfigError
from echo2p2p.learner_size import (Footprint, ModelShape, catch_up_versions_within,
                                   checkpoint_every_within, demo_line, hub_footprint,
                                   micro_tokens_within, peer_bytes)

from ..config import HubConfig

MIN_MICRO_TOKENS = 256  # below this a step is mostly overhead: refuse rather than crawl
PROMPT_TOKENS = 64  # a spot-checked group's prompt, for its forward's logits (a guess)


@dataclass(frozen=True)
class LocalPeers:
    """The demo's peer processes on this machine (none for `serve`)."""

    count: int = 0
    engine: str = "transformers"


@dataclass(frozen=True)
class Fitted:
    """The config as the hub will run it, its footprint, and why each changed field changed."""

    cfg: HubConfig
    footprint: Footprint
    peers_bytes: float
    budget_bytes: float
    why: dict[str, str] = field(default_factory=dict)  # field -> "fitted: <why>"
    warning: str = ""  # the machine's memory is short, but the user set no budget

    @property
    def total_bytes(self) -> float:
        return self.footprint.ram_bytes + self.peers_bytes


def micro_tokens(cfg: HubConfig, shape: ModelShape) -> int:
    """Padded tokens per learner micro-batch: learner_micro_tokens, lowered to fit
    learner_micro_bytes (no budget: 0)."""
    learner = cfg.learner
    if not learner.learner_micro_bytes:
        return learner.learner_micro_tokens
    return micro_tokens_within(shape, learner.learner_micro_bytes, learner.learner_micro_tokens,
                               learner.learner_checkpointing)


def fit_to_model(cfg: HubConfig, shape: ModelShape) -> HubConfig:
    """`cfg` with the checkpoint cadence, the catch-up depth and the micro-batch within their
    budgets for a model of this shape (`checkpoint_bytes_per_version`, `catch_up_disk_bytes`,
    `learner_micro_bytes`)."""
    run, overlay = cfg.run, cfg.overlay
    every = checkpoint_every_within(shape.params, run.checkpoint_every, run.checkpoint_bytes_per_version)
    back = catch_up_versions_within(shape.params, overlay.catch_up_versions, cfg.staleness.max_lag,
                                    overlay.catch_up_disk_bytes)
    return replace(cfg, run=replace(run, checkpoint_every=every),
                   overlay=replace(overlay, catch_up_versions=back),
                   learner=replace(cfg.learner, learner_micro_tokens=micro_tokens(cfg, shape)))


def kept_streams(cfg: HubConfig) -> int:
    """Published streams kept on disk: S + 1 for the spot-checker (else one: the next delta's
    base), catch_up_versions + 1 as laggards' bases (hub.overlay.catchup)."""
    spot = cfg.trust.spot_check_fraction > 0
    return max(cfg.staleness.max_lag + 1 if spot else 1, cfg.overlay.catch_up_versions + 1)


def predicted_footprint(cfg: HubConfig, shape: ModelShape, *, resumed: bool = False) -> Footprint:
    """The hub's peak RAM and disk for this model under `cfg` (fitted: `fit_to_model`)."""
    spot = cfg.trust.spot_check_fraction > 0
    return hub_footprint(
        shape, micro_tokens(cfg, shape), checkpointing=cfg.learner.learner_checkpointing,
        kl=cfg.grpo.kl_coef > 0, spot_check=spot, kept_streams=kept_streams(cfg),
        kept_versions=cfg.overlay.keep_versions, checkpoint_every=cfg.run.checkpoint_every,
        score_workers=cfg.scoring.score_workers,
        spot_tokens=cfg.grpo.group_size * (PROMPT_TOKENS + cfg.grpo.max_new_tokens),
        read_streams=cfg.staleness.max_lag + 1 if spot else 1, resumed=resumed)


def fit(cfg: HubConfig, shape: ModelShape, budget_bytes: float, peers: LocalPeers = LocalPeers(),
        *, budget_given: bool = False, resumed: bool = False) -> Fitted:
    """`cfg` fitted to the model (`fit_to_model`) and to `budget_bytes` of RAM shared with the
    `peers` (learner micro-batches lowered, down to MIN_MICRO_TOKENS); ConfigError on
    "max_memory" if it still does not fit and `budget_given`, else a `warning`."""
    fitted = fit_to_model(cfg, shape)
    why = {name: f"fitted: {reason}" for name, reason in _disk_reasons(cfg, fitted).items()}
    peers_bytes = peers.count * peer_bytes(shape, peers.engine)
    footprint = predicted_footprint(fitted, shape, resumed=resumed)
    over = footprint.ram_bytes + peers_bytes - budget_bytes
    tokens = fitted.learner.learner_micro_tokens
    if over > 0 and tokens > MIN_MICRO_TOKENS:
        per_token = footprint.ram_parts["micro-batch"] / tokens * (1 + _slack(footprint))
        fewer = max(MIN_MICRO_TOKENS, tokens - int(over // per_token + 1))
        fitted = fitted.replace(learner_micro_tokens=fewer)
        why["learner_micro_tokens"] = (f"fitted: {tokens} -> {fewer} so that the hub"
                                       f"{' and its peers' if peers.count else ''} fit in "
                                       f"{budget_bytes / 1e9:.1f} GB of RAM")
        footprint = predicted_footprint(fitted, shape, resumed=resumed)
    result = Fitted(fitted, footprint, peers_bytes, budget_bytes, why)
    if result.total_bytes <= budget_bytes:
        return result
    sentence = refusal(result, peers)
    if budget_given:
        raise ConfigError("max_memory", sentence)
    return replace(result, warning=sentence)


def refusal(fitted: Fitted, peers: LocalPeers) -> str:
    """What does not fit, and what to change."""
    parts = fitted.footprint.ram_parts
    big = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:4])
    fixes = ["--max-memory higher (on a machine that has it)"]
    if peers.count:
        fixes.append(f"fewer local peers (--peers; {fitted.peers_bytes / peers.count / 1e9:.1f} GB each)")
    if parts["spot-checker"]:
        fixes.append(f"--spot-check-fraction 0 (saves {parts['spot-checker'] / 1e9:.2f} GB, and "
                     f"the checks of peers' logprobs)")
    if not fitted.cfg.learner.learner_checkpointing:
        fixes.append("--learner-checkpointing (slower steps, less activation memory)")
    return (f"the hub needs about {fitted.total_bytes / 1e9:.1f} GB ({big}"
            f"{f', local peers {fitted.peers_bytes / 1e9:.2f}' if peers.count else ''}) even "
            f"with {fitted.cfg.learner.learner_micro_tokens}-token micro-batches, but "
            f"{fitted.budget_bytes / 1e9:.1f} GB is all it may use: set " + ", or ".join(fixes))


def log_line(fitted: Fitted, peers: LocalPeers, shape: ModelShape) -> str:
    """The start log's lines: the predicted footprint (the demo's too) and what was fitted."""
    lines = [fitted.footprint.line()]
    if peers.count:
        lines.append(demo_line(fitted.footprint, shape, peers.count, peers.engine))
    room = fitted.budget_bytes
    within = f"within {room / 1e9:.1f} GB of RAM" if room < float("inf") else "to the model"
    lines.append(f"fitted {within}: " + (
        "; ".join(f"{k} {_value(fitted.cfg, k)} ({v})" for k, v in fitted.why.items())
        or "nothing changed"))
    return "\n".join(lines)


def _value(cfg: HubConfig, name: str) -> object:
    from echo2p2p.config import as_dict

    return as_dict(cfg)[name]


def _slack(footprint: Footprint) -> float:
    micro = footprint.ram_parts["micro-batch"]
    return footprint.ram_parts["allocator slack"] / micro if micro else 0.0


def _disk_reasons(before: HubConfig, after: HubConfig) -> dict[str, str]:
    """Why `fit_to_model` changed each field it changed."""
    reasons = {}
    if after.run.checkpoint_every != before.run.checkpoint_every:
        reasons["checkpoint_every"] = (f"{before.run.checkpoint_every} -> "
                                       f"{after.run.checkpoint_every}: checkpoints write at most "
                                       f"checkpoint_bytes_per_version a version")
    if after.overlay.catch_up_versions != before.overlay.catch_up_versions:
        reasons["catch_up_versions"] = (f"{before.overlay.catch_up_versions} -> "
                                        f"{after.overlay.catch_up_versions}: the streams kept "
                                        f"fit in catch_up_disk_bytes")
    if after.learner.learner_micro_tokens != before.learner.learner_micro_tokens:
        reasons["learner_micro_tokens"] = (f"{before.learner.learner_micro_tokens} -> "
                                           f"{after.learner.learner_micro_tokens}: one micro-batch"
                                           f" fits in learner_micro_bytes")
    return reasons
