"""The learner's memory and speed on 1 rank and on 2 FSDP2 ranks (CPU, gloo): what sharding buys.

Models: the built-in "tiny" policy and bench/realsize.py's Qwen3-0.6B-shaped model (published
config, random weights, built once into --model-dir; nothing is downloaded). Each run is its own
process tree: `python bench/learner_memory.py --rank-worker ...` for 1 rank, under
`torch.distributed.run --nproc-per-node 2` for 2; every rank on 1 torch thread (torchrun's
OMP_NUM_THREADS=1, set_num_threads(1) alone), so 1 vs 2 ranks compares 1 core with 2. Per rank,
from /proc/self/status (batches: tiny 8 groups x 4 samples x (16 prompt + 48 completion)
tokens, 0.6B 4 x 2 x (16 + 64); rewards vary within each group, so every sample is trained):

  loaded / sharded  VmRSS after `load_policy` and after `Learner(...)` (sharded with `ranks`);
                    init peak: VmHWM then (rank 0 loads the whole model, the others build it
                    on the meta device and receive their shards, as `echo2-hub serve` does)
  step peak         VmHWM over --steps steps after a warm-up step (AdamW state exists), the peak
                    reset by writing 5 to /proc/self/clear_refs; B/param = (peak - a bare python
                    with torch imported) / P; predicted: the formula printed, over the rank's own
                    RSS before loading (python, torch, transformers, the process group)
  activations       bytes autograd saves for the backward (`saved_bytes`), in a step on half
                    the groups and in a full one (T padded tokens per micro-batch, one each): c =
                    d saved / d T / (hidden x layers), the logits' apart; the step peak's slope
                    in T; the whole batch in 2 micro-batches (gradient accumulation) above 1
  publication       VmHWM over `for _ in learner.iter_weights(torch.bfloat16): pass` on every
                    rank, above the RSS just before it and above the step peak
  speed             completion tokens of the batch / step_s (slowest rank), and 2-rank / 1-rank

    python bench/learner_memory.py [--quick] [--steps 2] [--layers 28] [--variants ckpt,bf16]

--quick: tiny only; --layers 2: a few-layer 0.6B shape, to smoke-test the bench. --variants:
the 0.6B model also at 2 ranks with checkpointing=True and with precision="bf16". Prints the
tables and the formula, then one JSON line {"bench": "learner_memory", ...}. The RSS is what
glibc keeps, freed heap included; MALLOC_MMAP_THRESHOLD_=65536 in the environment reaches the
ranks and maps every larger allocation apart, returned on free: the RSS then follows the tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.realsize_probes import table  # noqa: E402

FORMULA = """per rank bytes ~= 16 P / W          fp32 weights 4, grads 4, AdamW moments 8
                 + 4 P_largest (W > 1)  one gathered layer/tensor in flight
                 + T x hidden x layers x c   activations of a micro-batch of T padded tokens
                                             (c measured; per layer only with checkpointing)
                 + T x vocab x 4 x 3    the logits (fp32 copy, logsumexp, its gradient)
  (kl_coef > 0 adds 4 P / W for the reference; spot-checks add a 4 P copy on rank 0 only)"""


def status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) << 10
            for k in ("VmRSS", "VmHWM")}


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@contextlib.contextmanager
def saved_bytes(vocab: int):
    """[layers, logits]: bytes autograd keeps for the backward inside (`saved_tensors_hooks`),
    each storage once, parameters and their views left out; the logits' (last dim = vocab)
    apart from the rest (the layers' activations). One forward at a time: a storage freed and
    reused at the same address counts once. With checkpointing, what the recomputation keeps
    (each layer's input, T x hidden x 4 B) is the checkpoint's own and not seen here."""
    import torch

    seen, out = set(), [0, 0]

    def pack(t):
        base, storage = (t if t._base is None else t._base), t.untyped_storage()
        if not (base.is_leaf and base.requires_grad) and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[bool(t.dim()) and t.shape[-1] == vocab] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


def make_groups(vocab: int, n_groups: int, group_size: int, prompt_tokens: int,
                completion_tokens: int, seed: int = 0) -> list:
    """`n_groups` admitted groups of random ids, as the hub hands them over: rewards alternate
    1, 0 within a group (a non-zero advantage, so every sample is trained), behaviour logprobs
    -2.0 per token. The same on every rank (same seed)."""
    from echo2p2p.buffer import ScoredGroup
    from echo2p2p.messages import Sample, pack_ids, pack_logprobs
    from echo2p2p.rows import parse_samples

    draw = random.Random(seed)
    ids = lambda n: [draw.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    groups = []
    for g in range(n_groups):
        prompt, rewards = ids(prompt_tokens), [float(i % 2 == 0) for i in range(group_size)]
        samples = parse_samples([Sample(pack_ids(ids(completion_tokens)), pack_logprobs(
            [-2.0] * completion_tokens), "", r, "length") for r in rewards], vocab)
        assert not isinstance(samples, str), samples
        groups.append(ScoredGroup(f"l{g}", f"p{g}", prompt, 0, samples, rewards))
    return groups


def share_tokens(groups: list, vocab: int, world: int, rank: int, budget: int) -> tuple[int, int]:
    """(padded tokens of this rank's largest micro-batch at `budget`, rows it trains)."""
    from echo2p2p.hub.learning.batches import batch_rows, deal, micro_batches

    rows, _ = batch_rows(groups, vocab)
    mine = deal(rows, world)[rank] if world > 1 else rows
    return max(len(mb) * len(mb[0].ids) for mb in micro_batches(mine, budget)), len(mine)


def timed_steps(learner, groups: list, steps: int) -> tuple[list[float], int]:
    """Each step's seconds (the learner's step_s) and the batch's completion tokens."""
    stats = [learner.step(groups) for _ in range(steps)]
    assert not any(s.skipped for s in stats), "a step trained nothing: no update to measure"
    return [s.step_s for s in stats], sum(s.n_tokens for g in groups for s in g.samples)


def measure(learner, groups: list, args: argparse.Namespace, half: int, phases: dict) -> dict:
    """Warm-up on half the groups; with --fit a step on those again (fewer tokens, one
    micro-batch) and, after the measured steps, the whole batch in micro-batches of `half`
    tokens (gradient accumulation); one publication. Their peaks and saved activations (bytes),
    the step seconds; each phase's seconds into `phases`."""
    import torch

    def peak_of(call) -> int:
        reset_peak()
        call()
        return status()["VmHWM"]

    def phase(name: str, since: float) -> float:
        phases[name] = time.perf_counter() - since
        return time.perf_counter()

    def steps(batch: list, n: int, out: list) -> None:  # the first one's saved bytes too
        with saved_bytes(learner.vocab_size) as saved:
            first, tokens = timed_steps(learner, batch, 1)
        out += [first + timed_steps(learner, batch, n - 1)[0], tokens, saved]

    fewer = groups[:len(groups) // 2]
    t = time.perf_counter()
    timed_steps(learner, fewer, 1)  # warm-up: AdamW state exists from here on
    t = phase("warmup_s", t)
    fit, small, measured = None, [], []
    if args.fit:
        fit = {"peak": peak_of(lambda: steps(fewer, 1, small)), "saved": small[2]}
        t = phase("fit_s", t)
    step_peak = peak_of(lambda: steps(groups, args.steps, measured))
    t = phase("steps_s", t)
    if args.fit:
        learner.micro_tokens = half
        fit["accum_peak"] = peak_of(lambda: timed_steps(learner, groups, 1))
        learner.micro_tokens = args.micro_tokens
        t = phase("accum_s", t)
    before_pub = status()["VmRSS"]
    pub_peak = peak_of(lambda: [None for _ in learner.iter_weights(torch.bfloat16)])
    phase("publish_s", t)
    return {"fit": fit, "step_s": measured[0], "tokens": measured[1], "saved": measured[2],
            "step_peak": step_peak, "before_pub": before_pub, "pub_peak": pub_peak}


def worker(args: argparse.Namespace) -> None:
    """One rank (or the single process): the measures of the module docstring, one JSON line."""
    import torch

    torch.set_num_threads(1)
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.learning.learner import Learner
    from echo2p2p.hub.learning.ranks import Ranks
    from echo2p2p.policy.model import load_policy

    ranks = Ranks.from_env(HubConfig.from_flat(prompts_per_step=args.groups))
    world, rank = (1, 0) if ranks is None else (ranks.world, ranks.rank)
    imported = status()
    start = time.perf_counter()
    model, tokenizer = load_policy(args.model, weights=rank == 0)  # as `serve` loads it
    loaded, cfg = status(), model.config
    sizes = [p.numel() for p in model.parameters()]
    groups = make_groups(cfg.vocab_size, args.groups, args.group_size, args.prompt_tokens,
                         args.completion_tokens)
    full_t, rows = share_tokens(groups, cfg.vocab_size, world, rank, args.micro_tokens)
    half = max(rows // 2, 1) * full_t // rows  # micro_tokens for half this rank's rows
    learner = Learner(model, lr=1e-5, pad_id=tokenizer.pad_token_id, micro_tokens=args.micro_tokens,
                      ranks=ranks, precision=args.precision, checkpointing=args.checkpointing)
    del model
    sharded = status()
    phases = {"load_shard_s": time.perf_counter() - start}
    facts = measure(learner, groups, args, half, phases)
    if facts["fit"]:  # the fit's step: half the groups, in one micro-batch
        facts["fit"]["padded_tokens"] = share_tokens(groups[:len(groups) // 2], cfg.vocab_size,
                                                     world, rank, args.micro_tokens)[0]
    out = {"rank": rank, "world": world, "params": sum(sizes), "largest": max(sizes),
           "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
           "imported": imported["VmRSS"], "loaded": loaded["VmRSS"], "sharded": sharded["VmRSS"],
           "init_peak": sharded["VmHWM"], "padded_tokens": full_t, **facts,
           "phases_s": {k: round(v, 1) for k, v in phases.items()}}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    if ranks is not None:
        ranks.close()


def bare_torch_rss() -> int:
    """VmRSS of a bare python with torch imported (the baseline every B/param subtracts)."""
    code = "import torch; torch.set_num_threads(1); print(open('/proc/self/status').read())"
    text = subprocess.check_output([sys.executable, "-c", code], text=True)
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) << 10


def launch(args: argparse.Namespace, model: str, world: int, variant: str, batch: tuple,
           fit: bool, steps: int) -> dict:
    """One run: `world` ranks of `worker`; the per-rank JSON, or why there is none."""
    out = Path(tempfile.mkdtemp(prefix="learner-memory-"))
    spec = dict(zip(("groups", "group_size", "prompt_tokens", "completion_tokens"), batch),
                out=str(out), model=model, steps=steps, micro_tokens=args.micro_tokens,
                precision="bf16" if variant == "bf16" else "fp32",
                checkpointing=variant == "ckpt", fit=fit)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd = [sys.executable, *torchrun * (world > 1), __file__, "--rank-worker", json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    shutil.rmtree(out)
    run = {"model": Path(model).name, "world": world, "variant": variant, "batch": list(batch),
           "wall_s": round(time.perf_counter() - start, 1), "ranks": ranks,
           "load_avg_1m": round(os.getloadavg()[0], 2)}  # other work on the box skews speeds
    if proc.returncode or len(ranks) != world:
        lines = (proc.stderr.strip() or "no output").splitlines()
        run["error"] = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])[:300]
    return run


def fit_of(run: dict) -> dict | None:
    """Rank 0's activations: c (saved bytes per padded token x hidden x layer) and the logits'
    factor (saved bytes per padded token x vocab x 4), from the slope between the fit's step
    and the measured ones (one point, through 0, without --fit); the step peak's slope per
    padded token, and what 2 micro-batches (gradient accumulation) peak above 1."""
    r = run["ranks"][0] if run.get("ranks") else None
    if not r:
        return None
    small = r["fit"] or {"padded_tokens": 0, "saved": [0, 0]}
    d_t = r["padded_tokens"] - small["padded_tokens"]
    (layers, logits), (layers0, logits0) = r["saved"], small["saved"]
    out = {"c": round((layers - layers0) / d_t / (r["hidden"] * r["layers"]), 1),
           "logits_x": round((logits - logits0) / d_t / (4 * r["vocab"]), 2),
           "saved_mb": round((layers + logits) / 1e6)}
    if r["fit"]:
        out["peak_b_per_token"] = round((r["step_peak"] - small["peak"]) / d_t)
        out["accum_extra_mb"] = round((small["accum_peak"] - r["step_peak"]) / 1e6)
    return out


def predict(r: dict, c: float) -> int:
    """The formula's bytes for rank `r`, over its own RSS before the model was loaded (python,
    torch, transformers, the process group: what no formula in P describes)."""
    gathered = 4 * r["largest"] if r["world"] > 1 else 0
    act = r["padded_tokens"] * (r["hidden"] * r["layers"] * c + 12 * r["vocab"])
    return int(r["imported"] + 16 * r["params"] / r["world"] + gathered + act)


def summarise(runs: list[dict], baseline: int) -> dict:
    """The per-rank rows, speeds and fits the tables print and the JSON line carries."""
    gb, mb = (lambda b: round(b / 1e9, 3)), (lambda b: round(b / 1e6))
    fits = {(r["model"], r["variant"], r["world"]): fit_of(r) for r in runs}
    rows, speed = [], {}
    for run in runs:
        if run.get("error"):
            continue
        key = (run["model"], run["variant"], run["world"])
        c = fits[key]["c"]  # from the saved tensors, not from the peak
        step_s = [max(per_rank) for per_rank in zip(*(r["step_s"] for r in run["ranks"]))]
        mean_s = sum(step_s) / len(step_s)
        speed[key] = {"step_s": round(mean_s, 3),
                      "tokens_per_s": round(run["ranks"][0]["tokens"] / mean_s, 1)}
        for r in run["ranks"]:
            rows.append({"model": run["model"], "variant": run["variant"], "world": r["world"],
                         "rank": r["rank"], "params": r["params"],
                         "imported_gb": gb(r["imported"]), "loaded_gb": gb(r["loaded"]),
                         "sharded_gb": gb(r["sharded"]), "init_peak_gb": gb(r["init_peak"]),
                         "step_peak_gb": gb(r["step_peak"]),
                         "bytes_per_param": round((r["step_peak"] - baseline) / r["params"], 2),
                         "predicted_gb": gb(predict(r, c)),
                         "padded_tokens": r["padded_tokens"],
                         "pub_over_rss_mb": mb(r["pub_peak"] - r["before_pub"]),
                         "pub_over_step_peak_mb": mb(r["pub_peak"] - r["step_peak"])})
    for (model, variant, world), s in speed.items():
        one = speed.get((model, "base", 1))
        s["over_1_rank"] = round(s["tokens_per_s"] / one["tokens_per_s"], 3) if one else None
    return {"rows": rows, "speed": speed,
            "fits": {f"{m}/{v}/W{w}": f for (m, v, w), f in fits.items() if f}}


def report(summary: dict, runs: list[dict], baseline: int) -> dict:
    rows = summary["rows"]
    print(f"\nbaseline (bare python + torch, 1 thread): {baseline / 1e9:.3f} GB; "
          f"{os.cpu_count()} CPUs, 1 torch thread per rank\n")
    cols = ["model", "variant", "world", "rank", "params", "imported_gb", "loaded_gb", "sharded_gb",
            "init_peak_gb", "step_peak_gb", "bytes_per_param", "predicted_gb", "padded_tokens",
            "pub_over_rss_mb", "pub_over_step_peak_mb"]
    print(table(cols, [[r[c] for c in cols] for r in rows]))
    print(table(["model", "variant", "world", "step_s", "tokens/s", "over 1 rank"], [
        [m, v, w, s["step_s"], s["tokens_per_s"], s["over_1_rank"]]
        for (m, v, w), s in summary["speed"].items()]))
    cols = ["c", "logits_x", "saved_mb", "peak_b_per_token", "accum_extra_mb"]
    print(table(["activations (model/variant/W)", *cols],
                [[k, *(f.get(c) for c in cols)] for k, f in summary["fits"].items()]))
    print(FORMULA + "\n")
    for run in runs:
        if run.get("error"):
            print(f"FAILED {run['model']} {run['variant']} W={run['world']}: {run['error']}")
    return {"bench": "learner_memory", "baseline_bytes": baseline,
            "speed": {f"{m}/{v}/W{w}": s for (m, v, w), s in summary["speed"].items()},
            "fits": summary["fits"], "rows": rows,
            "runs": [{k: run[k] for k in ("model", "variant", "world", "batch", "wall_s",
                                          "load_avg_1m")}
                     | ({"phases_s": run["ranks"][0]["phases_s"]} if run["ranks"] else {})
                     | ({"error": run["error"]} if run.get("error") else {}) for run in runs]}


def short_of_memory(model_dir: Path) -> str | None:
    """Why the 0.6B runs should not start now (None: they may): ~26 B per parameter for the 2
    ranks together (measured with glibc's heap: 2 x 11 GB), against MemAvailable."""
    need = 26 * sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2  # bf16
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) << 10
    return None if need <= available else (
        f"the 0.6B runs need about {need / 1e9:.1f} GB and {available / 1e9:.1f} GB are "
        f"available: free memory, use --quick or --layers 2, or pass --force")


def plan(args: argparse.Namespace) -> list[tuple]:
    """(model, world, variant, batch, fit) of every run, in order."""
    from bench.realsize import ensure_model

    tiny = ("tiny", (8, 4, 16, 48))  # groups, samples per group, prompt, completion tokens
    runs = [] if args.no_tiny else [(tiny[0], w, "base", tiny[1], True, args.tiny_steps)
                                    for w in (1, 2)]
    if args.quick:
        return runs
    model_dir = args.model_dir
    if args.layers != 28:  # a smaller model to smoke-test the bench, in its own directory
        model_dir = model_dir.with_name(f"{model_dir.name}-{args.layers}l")
    model = str(ensure_model(model_dir, args.layers))
    if not args.force and (why := short_of_memory(model_dir)):
        raise SystemExit(f"learner_memory: {why}")
    big = (4, 2, 16, 64)
    runs += [(model, w, "base", big, True, args.steps) for w in (1, 2)]
    runs += [(model, 2, v, big, v == "ckpt", args.steps) for v in args.variants.split(",") if v]
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model only")
    ap.add_argument("--no-tiny", action="store_true", help="the 0.6B shape only")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per run (after 1 warm-up)")
    ap.add_argument("--tiny-steps", type=int, default=10, help="measured steps of the tiny runs")
    ap.add_argument("--layers", type=int, default=28,
                    help="decoder layers of the 0.6B shape (fewer only to smoke-test the bench)")
    ap.add_argument("--variants", default="ckpt,bf16",
                    help="0.6B runs at 2 ranks besides the base: ckpt (checkpointing), bf16")
    ap.add_argument("--micro-tokens", type=int, default=16384, help="the learner's micro_tokens")
    ap.add_argument("--model-dir", type=Path,
                    default=Path.home() / ".cache" / "echo2p2p" / "qwen3-0.6b-shape")
    ap.add_argument("--force", action="store_true", help="run even if memory looks short")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--rank-worker", help=argparse.SUPPRESS)  # internal: one rank, its spec
    args = ap.parse_args(argv)
    if args.rank_worker:
        worker(argparse.Namespace(**json.loads(args.rank_worker)))
        return 0
    baseline = bare_torch_rss()
    runs = []
    for model, world, variant, batch, fit, steps in plan(args):
        runs.append(launch(args, model, world, variant, batch, fit, steps))
        print(f"ran {Path(model).name} W={world} {variant}: {runs[-1]['wall_s']} s"
              + (f" FAILED {runs[-1]['error']}" if runs[-1].get("error") else ""), flush=True)
    result = report(summarise(runs, baseline), runs, baseline)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
