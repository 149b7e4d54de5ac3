"""Mismatch correction, measured: held-out accuracy with and without `grpo.mismatch_correction`,
same seeds, same steps, on data as off-policy as the hub lets it be.

One arm per correction (none, tis, mask, ...). Every arm trains the same model from the same
initial weights on the same prompt stream (the hub's task, its seed's order) with the same
sampling seeds; step t's groups are sampled from version max(0, t - lag) (lag = the hub's S by
default: every batch at the largest lag the hub admits, the case a correction is for), by a
peer's engine holding the weights the hub broadcasts (`weights_dtype`, bf16) computed in
`--engine-dtype` (float32 as every engine here so far; bfloat16 as GPU peers sample), scored by
the hub's reward in a worker process. No network, no leases: the off-policy gap is the one thing
that varies, and it is the same for every arm until their weights part. The held-out accuracy is
the learner's greedy evaluation, as the hub's.

    python -m bench.mismatch                          # tiny, the hub's defaults (S = 2, lr 1e-3)
    python -m bench.mismatch --lr 3e-3 --lag 4 --engine-dtype bfloat16   # tiny, stale batches
    python -m bench.mismatch --real --steps 12 --eval-every 12           # SmolLM2-135M, its preset

An arm of the tiny model takes about a minute of one core. With --real each step samples 64
completions of up to 32 tokens and trains on them (fp32), and each evaluation greedily completes
the preset's 200 held-out problems (minutes on 2 cores): version 0's is run once, for all arms.
Prints one line per step to stderr, then a table, then one JSON line.

Measured on a shared 2-core machine (load ~10; accuracy does not depend on it), tiny, 60 steps,
held-out 256, final accuracy on seeds 0/1/2 (the first command with --seed, and
--corrections none,tis,mask,tis+mask): none 0.793/0.789/0.777, tis 0.801/0.773/0.754, mask
0.793/0.789/0.777, tis+mask 0.789/0.773/0.750; with --lr 3e-3 --lag 4 --engine-dtype bfloat16
(9-12 % of tokens clipped), seeds 0/1: none 0.676/0.602, tis 0.465/0.336, mask 0.547/0.559; at
--lag 0 with a bf16 engine and lr 3e-3 (numerics alone, 0.1 % clipped), seed 0: none 0.738, tis
0.730, mask 0.738.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.config_presets import PRESETS
from echo2p2p.hub.config_grpo import MISMATCH_CORRECTIONS

REAL = "smollm2-135m"
HUB = HubConfig()


def hub_config(model: str, **given: Any) -> Any:
    """The hub's resolved config for `model`: its preset, then what the command line gave."""
    fields = {**PRESETS.get(model, {}), "model": model,
              **{k: v for k, v in given.items() if v is not None}}
    return HubConfig.from_flat(**fields)


def train_arm(cfg: Any, *, steps: int, lag: int, engine_dtype: str, initial: float | None = None,
              log_step=None) -> dict:
    """One arm: `steps` learner steps of `cfg` (its correction) on groups sampled `lag` versions
    behind; `initial`: version 0's accuracy if known (every arm starts from the same weights).
    Returns {"records": [...], "eval": {version: accuracy}, "wall_s": ...}."""
    import torch

    from echo2p2p.leases import shuffled_epochs
    from echo2p2p.policy.engines import TransformersEngine
    from echo2p2p.policy.model import load_policy
    from echo2p2p.scoring.scorer import Scorer

    from echo2p2p.hub.learning.learner import Learner
    from echo2p2p.hub.tasks.task_setup import open_setup

    t0 = time.perf_counter()
    torch.manual_seed(cfg.run.seed)
    setup = open_setup(cfg)
    policy, tokenizer = load_policy(cfg.run.model)
    prompts = cfg.tasks.prompts.check(tokenizer, repr(cfg.run.model))
    g = cfg.grpo
    learner = Learner(policy, lr=g.lr, clip_eps=g.clip_eps, temperature=g.temperature,
                      pad_id=tokenizer.pad_token_id or 0, **correction_of(g))
    engine = TransformersEngine(cfg.run.model, dtype=getattr(torch, engine_dtype))
    train = setup.task.problems("train")
    order = shuffled_epochs(len(train), cfg.run.seed)
    stream = [train[next(order)] for _ in range(steps * g.prompts_per_step)]
    held_out = setup.task.problems("eval")[:cfg.tasks.eval_problems]
    wire = getattr(torch, cfg.overlay.weights_dtype)
    kept = {0: learner.export_weights(wire)}  # version -> the weights a peer holds
    out: dict[str, Any] = {"records": [], "eval": {}}
    with Scorer(setup.reward, timeout_s=cfg.scoring.score_timeout_s, name="bench-scorer") as scorer:
        def score(items):
            return scorer.score_blocking(items).rewards

        def evaluate(version: int) -> None:
            out["eval"][version] = learner.evaluate(tokenizer, held_out, score,
                                                    max_new_tokens=g.max_new_tokens, prompts=prompts)

        out["eval"][0] = initial
        if initial is None:
            evaluate(0)
        for step in range(steps):
            version = max(0, step - lag)
            engine.load_weights(kept[version])
            problems = stream[step * g.prompts_per_step:(step + 1) * g.prompts_per_step]
            groups = sample_groups(engine, tokenizer, problems, step, version, cfg, score, prompts)
            stats = learner.step(groups)
            kept[step + 1] = learner.export_weights(wire)
            kept.pop(step + 1 - lag - 1, None)  # no step reads it again
            record = {"step": step, "version": step + 1, "lag": step - version,
                      "reward_mean": stats.reward_mean, **stats.metrics()}
            if cfg.tasks.eval_every and ((step + 1) % cfg.tasks.eval_every == 0 or step == steps - 1):
                evaluate(step + 1)
                record["eval_accuracy"] = out["eval"][step + 1]
            out["records"].append(record)
            if log_step:
                log_step(record)
    out["wall_s"] = time.perf_counter() - t0
    return out


def correction_of(g: Any) -> dict[str, Any]:
    """The learner's mismatch arguments from a GRPO config section, as the hub passes them."""
    return {name: getattr(g, name) for name in
            ("mismatch_correction", "mismatch_tis_cap", "mismatch_mask_bound")}


def sample_groups(engine: Any, tokenizer: Any, problems: list, step: int, version: int, cfg: Any,
                  score, prompts: Any) -> list:
    """One scored group per problem from the engine (at `version`), through the wire format and
    the hub's row parser (`sync_baseline.scored_groups`). The sampling seed depends on the step
    and the prompt only, so every arm draws with the same seeds."""
    from bench.sync_baseline import scored_groups

    g = cfg.grpo
    seeds = [cfg.run.seed * 1_000_003 + step * len(problems) + j for j in range(len(problems))]
    return scored_groups(engine, tokenizer, problems, seeds, g.group_size, score,
                         {"temperature": g.temperature, "top_p": g.top_p,
                          "max_new_tokens": g.max_new_tokens}, prompts,
                         version=version, label=f"bench-{step}")


def arm_summary(name: str, arm: dict) -> dict[str, Any]:
    """What the table and the JSON line show of one arm."""
    recs = arm["records"]
    evals = arm["eval"]
    last = max(evals)

    def mean(key: str) -> float:
        return sum(r[key] for r in recs) / max(len(recs), 1)

    return {"correction": name, "eval_initial": evals[0], "eval_final": evals[last],
            "eval_best": max(evals.values()), "evals": {str(k): v for k, v in sorted(evals.items())},
            "reward_mean": mean("reward_mean"), "clip_frac": mean("train/clip_frac"),
            "ratio_max": max(r["train/ratio_max"] for r in recs),
            "masked_samples": int(sum(r["train/masked_samples"] for r in recs)),
            "samples": int(sum(r["train/samples"] for r in recs)),
            "tis_truncated_frac": mean("train/tis_truncated_frac"),
            "tis_weight_mean": mean("train/tis_weight_mean"), "wall_s": round(arm["wall_s"], 1)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.mismatch", description=__doc__.split("\n")[0])
    p.add_argument("--real", action="store_true", help=f"train {REAL} (its preset) instead of tiny")
    p.add_argument("--model", default=None, help="any model the hub takes (default: tiny, or "
                                                 f"{REAL} with --real)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per arm (60; 8 with --real)")
    p.add_argument("--lag", type=int, default=HUB.staleness.max_lag,
                   help="versions between the sampler and the learner (default: the hub's S)")
    p.add_argument("--corrections", default="none,tis,mask",
                   help=f"comma-separated arms, of {', '.join(MISMATCH_CORRECTIONS)}")
    p.add_argument("--engine-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the sampling engine's compute dtype (bfloat16: as GPU peers)")
    p.add_argument("--seed", type=int, default=None, help="prompt order and sampling seeds")
    for flag, kind in (("--lr", float), ("--eval-every", int), ("--eval-problems", int),
                       ("--mismatch-tis-cap", float), ("--mismatch-mask-bound", float),
                       ("--prompts-per-step", int), ("--group-size", int)):
        p.add_argument(flag, type=kind, default=None, help="the hub's flag (default: the preset's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for the tiny model, whose matmuls thrash "
                        "on more threads of a shared machine; torch's own with --real)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    model = args.model or (REAL if args.real else HUB.run.model)
    steps = args.steps or (8 if args.real else 60)
    arms = [c.strip() for c in args.corrections.split(",") if c.strip()]
    given = {"lr": args.lr, "eval_every": args.eval_every or (4 if args.real else 20),
             "eval_problems": args.eval_problems, "seed": args.seed,
             "mismatch_tis_cap": args.mismatch_tis_cap,
             "mismatch_mask_bound": args.mismatch_mask_bound,
             "prompts_per_step": args.prompts_per_step, "group_size": args.group_size}
    configs = {arm: hub_config(model, mismatch_correction=arm, **given) for arm in arms}
    logging.basicConfig(level=logging.WARNING)
    import torch  # after parsing, so --help answers at once

    import echo2p2p.hub

    threads = args.threads if args.threads is not None else (0 if args.real else 1)
    if threads:
        torch.set_num_threads(threads)
    print(f"hub from {echo2p2p.hub.__file__}", file=sys.stderr)
    results = []
    for arm, cfg in configs.items():
        def show(r: dict, arm: str = arm) -> None:
            print(f"{arm:9s} step {r['step']:3d} lag {r['lag']} reward {r['reward_mean']:.3f} "
                  f"clip {r['train/clip_frac']:.3f} ratio_max {r['train/ratio_max']:.2f} "
                  f"masked {int(r['train/masked_samples'])} trunc "
                  f"{r['train/tis_truncated_frac']:.3f}"
                  + (f" eval {r['eval_accuracy']:.3f}" if "eval_accuracy" in r else ""),
                  file=sys.stderr, flush=True)

        initial = results[0]["eval_initial"] if results else None
        results.append(arm_summary(arm, train_arm(cfg, steps=steps, lag=args.lag, initial=initial,
                                                  engine_dtype=args.engine_dtype, log_step=show)))
    first = configs[arms[0]]
    print(f"\n{model}, {steps} steps, lag {args.lag}, lr {first.grpo.lr:g}, engine "
          f"{args.engine_dtype}, {first.tasks.eval_problems} held-out problems, seed {first.run.seed}")
    print(f"{'correction':10s} {'eval@0':>7s} {'final':>7s} {'best':>7s} {'reward':>7s} "
          f"{'clip':>6s} {'masked':>9s} {'trunc':>6s} {'wall_s':>7s}")
    for r in results:
        print(f"{r['correction']:10s} {r['eval_initial']:7.3f} {r['eval_final']:7.3f} "
              f"{r['eval_best']:7.3f} {r['reward_mean']:7.3f} {r['clip_frac']:6.3f} "
              f"{r['masked_samples']:4d}/{r['samples']:<4d} {r['tis_truncated_frac']:6.3f} "
              f"{r['wall_s']:7.1f}")
    print(json.dumps({"bench": "mismatch", "model": model, "steps": steps, "lag": args.lag,
                      "engine_dtype": args.engine_dtype, "lr": first.grpo.lr,
                      "seed": first.run.seed, "eval_problems": first.tasks.eval_problems,
                      "arms": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
