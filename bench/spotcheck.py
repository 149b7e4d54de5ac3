"""How far claimed behaviour logprobs land from the hub's recomputation, honest and forged.

The built-in tiny model learns the addition task with the real learner (`echo2p2p.hub.learning.learner.Learner`,
the hub's defaults: lr 1e-3, G = 8, 8 groups a step). At every version the published bf16
weights go into the hub's `SpotChecker` and into real CPU engines (`echo2p2p.policy.engines`, as peers run
them), which generate real groups; each group's claimed logprobs are then checked under the
version it is tagged with. Rows:

  honest fp32     an honest CPU peer (fp32 forward of the bf16 weights, KV-cached sampling)
  honest bf16     an honest peer computing in bf16, as GPU engines (vLLM) do: different
                  rounding and kernels from the hub's fp32 forward
  tag +1 / +S     generated with version v - 1 (v - S), tagged v: a forged version tag
  near 0          every claimed logprob -1e-3: each importance ratio becomes the token's
                  probability, whatever the policy did
  shuffled        the right logprobs in the wrong order (within each completion)
  scaled x0.5     each logprob halved (every token claimed likelier: a subtler distortion)

Each row: groups, the mean |claimed - recomputed| per group (median, p99, p99.9, max, min) and
the share the default `spot_check_tolerance` fails. Memory of the checker: (S + 1) x params x
2 bytes (bf16) of CPU RAM, ~42 GB for a 7B model at S = 2, whatever `spot_check_tokens` is.

    python bench/spotcheck.py [--steps 8] [--groups 100] [--forged 20]

Prints a table, then one JSON line:
{"bench": "spotcheck", "tolerance": ..., "honest_bf16_max": ..., "failed": {row: share}, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = ("honest fp32", "honest bf16", "tag +1", "tag +S", "near 0", "shuffled", "scaled x0.5")


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def forge(group, how: str, rng: random.Random):
    """`group` with its claimed logprobs rewritten."""
    from echo2p2p import messages as m

    samples = []
    for s in group.samples:
        lps = list(s.logprobs)
        if how == "near 0":
            lps = [-1e-3] * len(lps)
        elif how == "shuffled":
            rng.shuffle(lps)
        elif how == "scaled x0.5":
            lps = [0.5 * x for x in lps]
        samples.append(replace(s, packed_logprobs=m.pack_logprobs(lps)))
    return replace(group, samples=tuple(samples))


async def check_version(v: int, s: int, args: argparse.Namespace, generate, engines: dict,
                        spot, rng: random.Random, diffs: dict[str, list[float]]) -> list:
    """Every row's groups at version `v` (S = `s`), checked by `spot`: their differences added
    to `diffs`; the honest fp32 groups returned (the learner's next batch)."""
    honest = []
    for i in range(max(args.groups, args.forged)):
        cases = []
        if i < args.groups:  # the row that sets the tolerance: many groups, for its p99.9
            cases.append(("honest bf16", generate(engines["bf16"], v)))
        if i < args.forged:
            group = generate(engines["fp32"], v)
            honest.append(group)
            cases.append(("honest fp32", group))
            cases += [(how, forge(group, how, rng)) for how in ("near 0", "shuffled", "scaled x0.5")]
            if v >= 1:
                cases.append(("tag +1", generate(engines["v-1"], v)))
            if v >= s:
                cases.append(("tag +S", generate(engines["v-S"], v)))
        for row, g in cases:
            result = await spot.check(g)
            diffs[row].append(result.mean_abs_diff)
    return honest


async def measure(args: argparse.Namespace) -> tuple[dict[str, list[float]], float, object]:
    import torch

    from echo2p2p import messages as m
    from echo2p2p.buffer import ScoredGroup
    from echo2p2p.rows import parse_samples
    from echo2p2p.tasks import AdditionTask
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.learning.learner import Learner, encode_prompt
    from echo2p2p.hub.learning.spotcheck import SpotChecker
    from echo2p2p.policy.prompts import prompt_of
    from echo2p2p.policy.engines import TransformersEngine
    from echo2p2p.policy.model import load_policy

    torch.manual_seed(0)
    cfg = HubConfig()
    s = cfg.staleness.max_lag
    model, tokenizer = load_policy("tiny")
    learner = Learner(model, lr=cfg.grpo.lr, clip_eps=cfg.grpo.clip_eps, temperature=cfg.grpo.temperature,
                      pad_id=tokenizer.pad_token_id)
    spot = SpotChecker(learner.model, cfg.replace(max_lag=args.steps))  # keeps every version
    task = AdditionTask()
    problems = iter(task.problems("train"))
    engines = {"fp32": TransformersEngine("tiny"),
               "bf16": TransformersEngine("tiny", dtype=torch.bfloat16),
               "v-1": TransformersEngine("tiny"), "v-S": TransformersEngine("tiny")}
    rng = random.Random(0)
    diffs: dict[str, list[float]] = {row: [] for row in ROWS}
    history = []
    draw = 0

    def generate(engine, version: int):
        nonlocal draw
        p = next(problems)
        ids = encode_prompt(tokenizer, prompt_of(p), cfg.tasks.prompts)  # as the hub leases them
        draw += 1
        out = engine.generate(ids, cfg.grpo.group_size, temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p,
                              max_new_tokens=cfg.grpo.max_new_tokens, seed=draw)
        samples = parse_samples([m.Sample(m.pack_ids(c.token_ids), m.pack_logprobs(c.logprobs),
                                          c.text, 0.0, c.finish_reason) for c in out], None)
        return ScoredGroup(f"L{draw}", p.id, ids, version, samples,
                           [task.reward(p.answer, c.text) for c in out])

    for v in range(args.steps + 1):
        weights = learner.export_weights(getattr(torch, cfg.overlay.weights_dtype))
        history.append(weights)
        spot.keep(v, weights)
        engines["fp32"].load_weights(weights)
        engines["bf16"].load_weights(weights)
        engines["v-1"].load_weights(history[max(v - 1, 0)])
        engines["v-S"].load_weights(history[max(v - s, 0)])
        honest = await check_version(v, s, args, generate, engines, spot, rng, diffs)
        if v < args.steps:
            learner.step(honest[:cfg.grpo.prompts_per_step])
    return diffs, cfg.trust.spot_check_tolerance, cfg


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="learner steps (versions - 1)")
    p.add_argument("--groups", type=int, default=100, help="honest bf16 groups per version")
    p.add_argument("--forged", type=int, default=20,
                   help="honest fp32 groups per version, each also forged in every way")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    diffs, tolerance, cfg = asyncio.run(measure(args))
    elapsed = time.perf_counter() - start

    print(f"mean |claimed - recomputed| logprob per group, nats (tiny model, G = {cfg.grpo.group_size},"
          f" <= {cfg.grpo.max_new_tokens} tokens, {args.steps} learner steps at lr {cfg.grpo.lr})")
    print(f"{'row':<13}{'groups':>7}{'median':>10}{'p99':>10}{'p99.9':>10}{'max':>10}{'min':>10}"
          f"{'failed':>9}")
    for row in ROWS:
        xs = diffs[row]
        failed = sum(x > tolerance for x in xs) / max(len(xs), 1)
        print(f"{row:<13}{len(xs):>7}{quantile(xs, 0.5):>10.2e}{quantile(xs, 0.99):>10.2e}"
              f"{quantile(xs, 0.999):>10.2e}{max(xs):>10.2e}{min(xs):>10.2e}{failed:>9.1%}")
    bf16, fp32 = diffs["honest bf16"], diffs["honest fp32"]
    fabricated = min(min(diffs[row]) for row in ("near 0", "shuffled", "scaled x0.5"))
    print(f"tolerance {tolerance} (the default): {tolerance / quantile(bf16, 0.99):.1f}x the "
          f"honest bf16 p99, {tolerance / max(bf16):.1f}x its max, {tolerance / max(fp32):.0e}x "
          f"the honest fp32 max")
    params = 7e9
    print(f"memory: (S + 1) x params x 2 bytes = {(cfg.staleness.max_lag + 1) * params * 2 / 1e9:.0f} GB "
          f"for 7B params at S = {cfg.staleness.max_lag}, whatever --spot-check-tokens; {elapsed:.0f} s")
    print(json.dumps({
        "bench": "spotcheck", "tolerance": tolerance,
        "honest_fp32_max": max(fp32), "honest_bf16_p99": quantile(bf16, 0.99),
        "honest_bf16_max": max(bf16),
        "tag1_median": quantile(diffs["tag +1"], 0.5), "tagS_median": quantile(diffs["tag +S"], 0.5),
        "fabricated_min": fabricated,
        "failed": {row: sum(x > tolerance for x in diffs[row]) / max(len(diffs[row]), 1)
                   for row in ROWS},
        "seconds": round(elapsed, 1)}))


if __name__ == "__main__":
    main()
