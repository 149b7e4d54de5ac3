"""How far honest engines' logprobs drift from the learner's fp32 recompute, per dtype, and what
forgeries look like under the same statistic: the numbers the spot-check rule is set from.

For each model (the built-in tiny one and SmolLM2-135M, with their presets' sampling values
and tasks, prompts as the hub leases them), the published bf16 weights of version 0 go into
the hub's `SpotChecker` and into real engines (`echo2p2p.policy.engines`, as peers run them).
Each engine samples groups; each sample's d = recomputed - claimed logprob is taken by
`SpotChecker.token_diffs`, the very code the hub's spot-checks run. Engines:

  transformers fp32   the CPU peer's default (fp32 forward of the bf16 weights)
  transformers bf16   `echo2-peer join --dtype bfloat16`: the model in bf16, as GPU peers run
  vllm bf16/fp32      only when this script runs under a Python with vLLM (`.venv-vllm/bin/python
                      bench/logprob_drift.py --engines ...,vllm-bf16`); skipped, and said, else

Forged rows rewrite the claims of the transformers bf16 groups (a liar announcing bf16, who
would get the loosest bar if bars were per dtype): bench/spotcheck.py's forgers (near 0,
shuffled, scaled x0.5) and "bias -0.2", every logprob lowered by 0.2 nats (each ratio x1.22:
the largest forgery a bar of 0.2 would miss).

Per engine: per-token |d| (mean, p50, p90, p99, max), per-sequence mean |d| (p50, p99, max),
per-group mean |d| (the checker's statistic: p50, p99, max), the k3 KL mean (exp(d) - d - 1),
and the share of groups the default `spot_check_tolerance` fails.

The rule set from it (hub.learning.spotcheck): the group mean, one bar (0.2) for every engine
and dtype. Measured on a shared, loaded 2-core machine (--groups 8 for SmolLM2: its bf16
engine took 106 s a group there; 24 for tiny): honest bf16 groups at most 0.033 (SmolLM2) and
0.010 (tiny), tokens up to 0.60; fp32 at most 5e-6; SmolLM2's forged groups from 0.22 up.

    python bench/logprob_drift.py [--models tiny,smollm2-135m] [--groups 24] [--threads 1]

Prints a table, then one JSON line {"bench": "logprob_drift", "rows": {...}, ...}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENGINES = ("transformers-fp32", "transformers-bf16", "vllm-fp32", "vllm-bf16")
FORGERIES = ("near 0", "shuffled", "scaled x0.5", "bias -0.2")


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def make_engine(kind: str, name: str):
    import torch

    from echo2p2p.policy.engines import TransformersEngine, VLLMEngine

    family, dtype = kind.split("-")
    if family == "transformers":
        return TransformersEngine(name, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    return VLLMEngine(name, device="cpu", dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])


def forge(group, how: str, rng: random.Random):
    """`group` with its claimed logprobs rewritten (bench/spotcheck.py's forgers, and a bias)."""
    from dataclasses import replace

    from echo2p2p import messages as m

    if how != "bias -0.2":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from spotcheck import forge as forge_spot

        return forge_spot(group, how, rng)
    samples = tuple(replace(s, packed_logprobs=m.pack_logprobs([x - 0.2 for x in s.logprobs]))
                    for s in group.samples)
    return replace(group, samples=samples)


def stats(groups: list[list]) -> dict:
    """The statistics of one row from its groups' per-sample d tensors."""
    import torch

    tokens = torch.cat([d for g in groups for d in g]).double()  # (N,)
    absd = tokens.abs().tolist()
    per_seq = [float(d.abs().mean()) for g in groups for d in g if d.numel()]
    per_group = [float(torch.cat(g).abs().mean()) for g in groups]
    return {"groups": len(groups), "sequences": len(per_seq), "tokens": len(absd),
            "tok_mean": sum(absd) / len(absd), "tok_p50": quantile(absd, 0.5),
            "tok_p90": quantile(absd, 0.9), "tok_p99": quantile(absd, 0.99), "tok_max": max(absd),
            "seq_p50": quantile(per_seq, 0.5), "seq_p99": quantile(per_seq, 0.99),
            "seq_max": max(per_seq), "group_p50": quantile(per_group, 0.5),
            "group_p99": quantile(per_group, 0.99), "group_max": max(per_group),
            "group_min": min(per_group), "signed_mean": float(tokens.mean()),
            "k3_mean": float((tokens.exp() - tokens - 1).mean()), "per_group": per_group}


def measure(name: str, engines: list[str], n_groups: int) -> dict[str, dict]:
    import torch

    from echo2p2p import messages as m
    from echo2p2p.buffer import ScoredGroup
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.config_presets import PRESETS
    from echo2p2p.hub.learning.learner import Learner, encode_prompt
    from echo2p2p.hub.learning.spotcheck import SpotChecker
    from echo2p2p.hub.tasks.task_setup import open_task
    from echo2p2p.policy.model import load_policy
    from echo2p2p.policy.prompts import prompt_of
    from echo2p2p.rows import parse_samples

    torch.manual_seed(0)
    cfg = HubConfig.from_flat(model=name, **PRESETS[name])
    g = cfg.grpo
    model, tokenizer = load_policy(name)
    learner = Learner(model, lr=g.lr, clip_eps=g.clip_eps, temperature=g.temperature,
                      pad_id=tokenizer.pad_token_id)
    weights = learner.export_weights(getattr(torch, cfg.overlay.weights_dtype))  # as published
    spot = SpotChecker(learner.model, cfg)
    spot.keep(0, weights)
    task = open_task(cfg)
    problems = list(task.problems("train"))[:n_groups]  # the same prompts for every engine
    rng = random.Random(0)
    rows: dict[str, list] = {}
    for kind in engines:
        engine = make_engine(kind, name)
        engine.load_weights(weights)
        start = time.perf_counter()
        for i, p in enumerate(problems):
            ids = encode_prompt(tokenizer, prompt_of(p), cfg.tasks.prompts)
            out = engine.generate(ids, g.group_size, temperature=g.temperature, top_p=g.top_p,
                                  max_new_tokens=g.max_new_tokens, seed=i)
            samples = parse_samples([m.Sample(m.pack_ids(c.token_ids), m.pack_logprobs(c.logprobs),
                                              c.text, 0.0, c.finish_reason) for c in out], None)
            group = ScoredGroup(f"L{i}", p.id, ids, 0, samples, [0.0] * len(out))
            with torch.no_grad():
                rows.setdefault(kind, []).append(spot.token_diffs(group, weights))
                if kind == "transformers-bf16":
                    for how in FORGERIES:
                        forged = forge(group, how, rng)
                        rows.setdefault(f"forged {how}", []).append(spot.token_diffs(forged, weights))
            print(f"  {name} {kind}: group {i + 1}/{len(problems)}, "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        print(f"  {name} {kind}: {len(problems)} groups in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)
        del engine
    return {row: stats(groups) for row, groups in rows.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2-135m", help="comma-separated model names")
    p.add_argument("--engines", default="transformers-fp32,transformers-bf16",
                   help=f"comma-separated, of {', '.join(ENGINES)} (vllm-*: needs vLLM here)")
    p.add_argument("--groups", type=int, default=24, help="groups (prompts x G) per engine")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a loaded machine 2 ran 8x slower, threads spinning)")
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    if bad := [e for e in engines if e not in ENGINES]:
        p.error(f"unknown engines {bad}; expected some of {', '.join(ENGINES)}")
    skipped = []
    if importlib.util.find_spec("vllm") is None:
        skipped = [e for e in engines if e.startswith("vllm")]
        engines = [e for e in engines if e not in skipped]
        print(f"vLLM is not installed in {sys.executable}: rows {skipped or 'vllm-*'} not measured "
              f"(run .ci/vllm-env, then .venv-vllm/bin/python {' '.join(sys.argv)} "
              "--engines transformers-fp32,transformers-bf16,vllm-fp32,vllm-bf16)")

    import torch

    from echo2p2p.hub.config import HubConfig

    torch.set_num_threads(args.threads)
    tolerance = HubConfig().trust.spot_check_tolerance
    start = time.perf_counter()
    results = {name: measure(name, engines, args.groups) for name in args.models.split(",")}
    print(f"|d| = |recomputed - claimed| logprob, nats; recompute: the hub's fp32 SpotChecker; "
          f"'fail' = groups over the default tolerance {tolerance}")
    head = (f"{'model':<14}{'row':<20}{'tokens':>7}{'tok mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}"
            f"{'max':>9}{'seq p99':>9}{'seq max':>9}{'grp p99':>9}{'grp max':>9}{'grp min':>9}"
            f"{'k3':>9}{'fail':>7}")
    print(head)
    for name, rows in results.items():
        for row, s in rows.items():
            fail = sum(x > tolerance for x in s["per_group"]) / s["groups"]
            s["failed"] = fail
            print(f"{name:<14}{row:<20}{s['tokens']:>7}" + "".join(
                f"{s[k]:>9.2e}" for k in ("tok_mean", "tok_p50", "tok_p90", "tok_p99", "tok_max",
                                          "seq_p99", "seq_max", "group_p99", "group_max",
                                          "group_min", "k3_mean")) + f"{fail:>7.0%}")
    for rows in results.values():
        for s in rows.values():
            del s["per_group"]
    print(json.dumps({"bench": "logprob_drift", "tolerance": tolerance, "skipped": skipped,
                      "rows": results, "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
