"""`echo2-hub plan`: how much rollout capacity keeps the learner busy, and which workers to rent.

Offline and without a GPU. From the size of one version, the learner's uplink, the learner's
step time, the rollouts it eats per step, S/kappa and a TOML list of candidate workers, it
prints the required aggregate throughput (`echo2p2p.capacity`), the feasible (S, kappa), and for
each activation policy (`echo2p2p.activation`) the active set, the predicted learner busy
fraction, $/h and $ per 1,000 rollouts, beside the LP lower bound on cost.

The learner runs on --learner-ranks ranks (FSDP2): T_train scales from the rank count it was
measured on (`echo2p2p.learner_size`: each doubling keeps --learner-efficiency of the speed-up),
its memory per rank (16 bytes a parameter over W, one gathered tensor, a micro-batch's
activations) is checked against --learner-memory-gb, and each version's publication (gathered
to rank 0 over the interconnect, cast, coded on --hub-cores) is added to T_bcast: the version
is announced only once its last chunk is coded.

The broadcast time T_bcast is estimated for every candidate receiving each version (standby
workers stay warm), from the learner's uplink and theirs (`echo2p2p.capacity.broadcast_s`).

    echo2-hub plan --workers examples/workers.toml --model-bytes 16e9 --uplink-mbps 1000
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from echo2p2p.activation import (PricedWorker, Selection, activate_all, choose_active,
                                 fastest_first, lp_lower_bound)
from echo2p2p.capacity import (Reading, Workload, broadcast_s, feasible_schedules,
                               predicted_busy_fraction, predicted_stale_fraction,
                               predicted_staleness, required_throughput)
from echo2p2p.errors import ConfigError
from echo2p2p.learner_size import (ModelShape, least_ranks, memory_per_rank_bytes, publish_s,
                                   train_step_s)
from echo2p2p.relay import STRATEGIES
from echo2p2p.staleness import default_publish_every

from ..config import read_toml


@dataclass(frozen=True)
class PlanConfig:
    workers: str = ""
    """TOML file of candidate workers: [[worker]] tables with id, price_per_hour, rollouts_per_s,
    upload_mbps and optionally count (that many identical workers); the repository's
    examples/workers.toml is one. '' = none: the throughput and schedules only, no choice of
    workers (T_bcast then counts one worker)."""
    model_bytes: float = 0.0
    """Bytes of one published version (bf16: 2 per parameter); 0 = the size of --model."""
    model: str = "tiny"
    """Model whose bf16 size is used when --model-bytes is 0: "tiny", a local model directory or a
    HF hub id already in the local cache (only its config is read)."""
    uplink_mbps: float = 1000.0
    """The learner's upload bandwidth, Mbit/s."""
    train_step_s: float = 60.0
    """T_train: seconds per learner step."""
    rollouts_per_step: int = 512
    """R: completions consumed per learner step (prompts per step x G)."""
    max_lag: int = 4
    """S, the staleness bound."""
    publish_every: int = 0
    """kappa, steps between published versions; 0 = max(1, S - 1)."""
    reading: str = "sequential"
    """Which provisioning rule: sequential (workers must also fit the download into the period)
    or overlapped (workers keep generating on the old version while downloading)."""
    relay: str = "gossip"
    """How versions reach workers: gossip or pipelined (the overlay: peers relay chunks to
    each other, estimated alike), striped-chain or star."""
    margin: float = 0.1
    """Safety margin on the required throughput (0.1 = provision 10 % more)."""
    learner_ranks: int = 1
    """W, the ranks (GPUs) the learner is sharded over with FSDP2 (torchrun --nproc-per-node)."""
    train_step_ranks: int = 0
    """The rank count --train-step-s was measured on (0 = --learner-ranks: T_train as given)."""
    learner_efficiency: float = 0.9
    """Speed kept per doubling of the learner's ranks (FSDP's gathers and reductions do not
    shrink with W); bench/learner_memory.py measures it."""
    learner_memory_gb: float = 0.0
    """Memory of one learner rank (GPU), GB: the plan says whether the learner fits and the
    fewest ranks that would (0 = do not check)."""
    micro_tokens: int = 16384
    """The learner's --learner-micro-tokens: padded tokens per micro-batch (activation memory)."""
    checkpointing: bool = False
    """The learner's --learner-checkpointing: activations of one decoder layer kept, not all."""
    hub_cores: int = 8
    """CPU cores coding each version's chunks on the hub (the publication time)."""
    interconnect_gbps: float = 100.0
    """Bandwidth between the learner's ranks, Gbit/s (NVLink: ~2400, InfiniBand: 200-400): each
    version is gathered from the shards to rank 0 before it is coded."""

    def __post_init__(self) -> None:
        for name in ("uplink_mbps", "train_step_s", "rollouts_per_step", "learner_ranks",
                     "micro_tokens", "hub_cores", "interconnect_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.model_bytes < 0 or self.margin < 0 or self.max_lag < 0 or self.publish_every < 0:
            raise ConfigError("model_bytes/margin/max_lag/publish_every", "must be >= 0")
        if self.reading not in {r.value for r in Reading}:
            raise ConfigError("reading", f"sequential or overlapped, got {self.reading!r}")
        if self.relay not in STRATEGIES:
            raise ConfigError("relay", f"one of {', '.join(STRATEGIES)}, got {self.relay!r}")
        if self.train_step_ranks < 0 or self.learner_memory_gb < 0:
            raise ConfigError("train_step_ranks/learner_memory_gb", "must be >= 0")
        if not 0 < self.learner_efficiency <= 1:
            raise ConfigError("learner_efficiency", f"must be in (0, 1], got "
                                                    f"{self.learner_efficiency}")

    @property
    def t_train_s(self) -> float:
        """T_train on the learner's ranks."""
        measured = self.train_step_ranks or self.learner_ranks
        return train_step_s(self.train_step_s, measured, self.learner_ranks,
                            self.learner_efficiency)

    @property
    def kappa(self) -> int:
        return self.publish_every or default_publish_every(self.max_lag)


def load_workers(path: Path) -> list[PricedWorker]:
    """The [[worker]] tables of a TOML file, `count` expanded; ConfigError names a bad entry,
    or the file when it is missing or not TOML."""
    tables = read_toml(path, "workers").get("worker", [])
    if not tables:
        raise ConfigError("workers", f"{path}: no [[worker]] tables")
    workers = []
    for n, t in enumerate(tables):
        try:
            count = int(t.get("count", 1))
            for k in range(count):
                workers.append(PricedWorker(f"{t['id']}-{k}" if count > 1 else str(t["id"]),
                                      float(t["price_per_hour"]), float(t["rollouts_per_s"]),
                                      float(t.get("upload_mbps", 0)) * 1e6))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("workers", f"{path}: worker #{n + 1}: {exc!r}") from None
    return workers


def model_shape(cfg: PlanConfig) -> ModelShape:
    """The model's size: P from --model-bytes (bf16: 2 a parameter) if given, else counted on
    the meta device from the model's config, with the shape the learner's memory needs."""
    if cfg.model_bytes:
        return ModelShape(int(cfg.model_bytes // 2))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from echo2p2p.policy.model import model_source

    config = AutoConfig.from_pretrained(model_source(cfg.model))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sizes = [p.numel() for p in model.parameters()]
    return ModelShape(sum(sizes), max(sizes), config.hidden_size, config.num_hidden_layers,
                      config.vocab_size)


def lossless_schedules(w: Workload, reading: Reading) -> list[tuple[int, int]]:
    """The feasible (S, kappa), S <= 16, under which no rollout is predicted to be dropped as
    older than S (the rule alone allows schedules whose versions arrive too late for S)."""
    return [(s, k) for s, k in feasible_schedules(w.train_step_s, w.bcast_s, reading)
            if s == 0 or predicted_stale_fraction(replace(w, max_lag=s, kappa=k)) == 0]


def learner_facts(cfg: PlanConfig, shape: ModelShape) -> dict[str, Any]:
    """T_train and the publication time on the learner's ranks, and its memory per rank."""
    out: dict[str, Any] = {
        "learner_ranks": cfg.learner_ranks, "t_train_s": round(cfg.t_train_s, 3),
        "publish_s": round(publish_s(shape.params, cfg.learner_ranks, cfg.hub_cores,
                                     cfg.interconnect_gbps * 1e9), 2),
        "learner_shape": bool(shape.hidden),
        "learner_gb_per_rank": round(memory_per_rank_bytes(
            shape, cfg.learner_ranks, cfg.micro_tokens, cfg.checkpointing) / 1e9, 2),
    }
    if cfg.learner_memory_gb:
        out["learner_fits"] = out["learner_gb_per_rank"] <= cfg.learner_memory_gb
        out["least_learner_ranks"] = least_ranks(shape, cfg.learner_memory_gb * 1e9,
                                                 cfg.micro_tokens, cfg.checkpointing)
    return out


def plan(cfg: PlanConfig, workers: list[PricedWorker], shape: ModelShape) -> dict[str, Any]:
    """Everything `echo2-hub plan` prints, as data. The broadcast starts once the version is
    published: T_bcast here is the publication plus the spread to every worker."""
    reading = Reading(cfg.reading)
    nbytes = 2.0 * shape.params
    learner = learner_facts(cfg, shape)
    uplinks_bps = [w.upload_bps for w in workers]
    bcast = learner["publish_s"] + broadcast_s(nbytes, cfg.uplink_mbps * 1e6, uplinks_bps,
                                               cfg.relay)
    workload = Workload(cfg.rollouts_per_step, cfg.t_train_s, bcast, cfg.max_lag, cfg.kappa)
    need = required_throughput(workload, reading)
    stale = predicted_stale_fraction(workload)
    out: dict[str, Any] = {
        "reading": reading.value, "model_bytes": nbytes, "bcast_s": round(bcast, 2), **learner,
        "S": cfg.max_lag, "kappa": cfg.kappa, "feasible": need.feasible, "reason": need.reason,
        "required_rollouts_per_s": need.rollouts_per_s,
        "feasible_schedules": lossless_schedules(workload, reading)[:8],
        "mean_lag": round(sum(lag * share for lag, share in predicted_staleness(workload).items()), 2),
        "stale_frac": round(stale, 3),
        "policies": {},
    }
    if not need.feasible or not workers:
        return out
    required = need.rollouts_per_s
    out["lp_bound_per_hour"] = lp_lower_bound(workers, required * (1 + cfg.margin))
    for name, policy in (("cost-aware", choose_active), ("activate-all", activate_all),
                         ("fastest-first", fastest_first)):
        sel: Selection = policy(workers, required, cfg.margin)
        # Rollouts older than S are dropped: only the rest feeds the learner.
        busy = predicted_busy_fraction(workload, sel.rollouts_per_s * (1 - stale), reading)
        consumed_per_h = busy * cfg.rollouts_per_step / cfg.t_train_s * 3600
        out["policies"][name] = {
            **asdict(sel), "workers": len(sel.active), "busy_frac": round(busy, 3),
            "usd_per_1k_rollouts": (round(1000 * sel.price_per_hour / consumed_per_h, 4)
                                    if consumed_per_h else None),
        }
    return out


def render(p: dict[str, Any], cfg: PlanConfig) -> str:
    fits = ""
    if "learner_fits" in p:
        least = p["least_learner_ranks"]
        fits = (f" of {cfg.learner_memory_gb:g}: fits" if p["learner_fits"] else
                f" of {cfg.learner_memory_gb:g}: does not fit; " +
                (f"{least} ranks would" if least else "no rank count would"))
    lines = [
        f"one version: {p['model_bytes'] / 1e9:.2f} GB; learner uplink {cfg.uplink_mbps:g} Mbit/s; "
        f"published in ~{p['publish_s']:.1f} s, then to every worker in "
        f"~{p['bcast_s'] - p['publish_s']:.1f} s ({cfg.relay})",
        f"learner on {p['learner_ranks']} rank(s): ~{p['learner_gb_per_rank']:.1f} GB per rank"
        f"{'' if p['learner_shape'] else ' (state only: --model counts activations)'}{fits}; "
        f"T_train {p['t_train_s']:g} s",
        f"rule ({p['reading']} reading), S={p['S']}, kappa={p['kappa']}, R={cfg.rollouts_per_step}, "
        f"T_train={p['t_train_s']:g} s: " + (
            f"needs >= {p['required_rollouts_per_s']:.2f} rollouts/s (+{cfg.margin:.0%} margin)"
            if p["feasible"] else f"infeasible: {p['reason']}"),
        "feasible (S, kappa) that drop nothing as stale, smallest first: " + (
            ", ".join(f"({s}, {k})" for s, k in p["feasible_schedules"]) or "none up to S=16"),
        f"predicted lag of trained rollouts: mean {p['mean_lag']:.2f} steps; "
        f"{p['stale_frac']:.0%} would be older than S and dropped",
    ]
    if p["feasible"] and not p["policies"]:
        lines.append("which workers to rent: pass --workers FILE, a TOML file of [[worker]] "
                     "tables (the repository's examples/workers.toml is one)")
    elif p["feasible"]:
        lines.append(f"{'policy':14s} {'workers':>7s} {'rollouts/s':>10s} {'busy':>5s} "
                     f"{'$/h':>8s} {'$/1k rollouts':>13s}")
        for name, q in p["policies"].items():
            per_k = "-" if q["usd_per_1k_rollouts"] is None else f"{q['usd_per_1k_rollouts']:.4f}"
            lines.append(f"{name:14s} {q['workers']:7d} {q['rollouts_per_s']:10.1f} "
                         f"{q['busy_frac']:5.2f} {q['price_per_hour']:8.2f} {per_k:>13s}")
        bound = p["lp_bound_per_hour"]
        lines.append("LP lower bound on $/h: " + ("-" if bound is None else f"{bound:.2f}"))
    return "\n".join(lines)


def run(cfg: PlanConfig, as_json: bool) -> str:
    workers = load_workers(Path(cfg.workers)) if cfg.workers else []
    result = plan(cfg, workers, model_shape(cfg))
    return json.dumps(result, default=str) if as_json else render(result, cfg)
