"""The Qwen3-0.6B-shaped model on one GPU: engine tokens/s, reload time, a learner step, memory.

For a lent CUDA machine (issue 13, part 5). The model is bench/realsize.py's (published config,
random weights, built locally into --model-dir with `save_pretrained`; no download). Measured:

  transformers  `TransformersEngine` in bf16 on --device: sampled tokens/s over --batch rows of
                --new-tokens (the KV-cached loop peers run), and `load_weights` of a full bf16
                state, as a peer reloads each version (CUDA synchronised)
  vllm          the same through `make_engine("vllm", ...)`, wherever vLLM is installed (the GPU
                image has none, and its wheel is more than a device call may carry: not run there)
  learner       one `Learner.step` on --groups groups of the engine's own samples (scored by a
                coin, as random weights solve nothing), fp32 weights and AdamW as the hub trains;
                tokens/s and seconds; then the bf16 export and `Publisher.build` (CPU side)
  memory        peak CUDA memory allocated per part (torch.cuda.max_memory_allocated; for vLLM,
                device memory in use from torch.cuda.mem_get_info, as it reserves its own)

    python bench/gpu_realsize.py [--device cuda] [--engines transformers,vllm] [--batch 16]
    python bench/gpu_realsize.py --device cpu --tiny     # a smoke test of the script itself

Prints a table, then one JSON line {"bench": "gpu_realsize", ...}. A part that cannot run (no
vLLM, no CUDA) is a row saying why, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.realsize import ensure_model  # noqa: E402
from bench.realsize_probes import CoinTask, table  # noqa: E402

PROMPT = "12+34="


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_reset(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.startswith("cuda") else None


def used_gb(device: str) -> float | None:
    import torch

    if not device.startswith("cuda"):
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 1e9, 2)


def full_state(model_dir: Path) -> dict:
    """The model's own weights, as a peer receives a version: CPU tensors in bf16."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def measure_engine(kind: str, args: argparse.Namespace, state: dict) -> tuple[dict, object]:
    """tokens/s, reload seconds (median of 3) and memory of engine `kind`; and the engine."""
    import torch

    from echo2p2p.policy.engines import TransformersEngine, make_engine

    peak_reset(args.device)
    start = time.perf_counter()
    engine = (TransformersEngine(str(args.model_dir), device=args.device, dtype=torch.bfloat16)
              if kind == "transformers" else make_engine(kind, str(args.model_dir), args.device))
    built_s = time.perf_counter() - start
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    engine.generate(prompt, 2, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)  # warm-up
    sync(args.device)
    start = time.perf_counter()
    out = engine.generate(prompt, args.batch, temperature=1.0, top_p=1.0,
                          max_new_tokens=args.new_tokens, seed=1)
    sync(args.device)
    gen_s = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in out)
    reloads = []
    for i in range(3):
        version = {k: v + (i + 1) * 1e-3 if v.is_floating_point() else v for k, v in state.items()}
        sync(args.device)
        start = time.perf_counter()
        engine.load_weights(version)
        sync(args.device)
        reloads.append(time.perf_counter() - start)
        del version
    row = {"part": kind, "build_s": round(built_s, 2), "tokens": tokens,
           "tokens_per_s": round(tokens / gen_s, 1), "reload_s": round(statistics.median(reloads), 3),
           "peak_gb": peak_gb(args.device) if kind == "transformers" else used_gb(args.device)}
    return row, engine


def measure_learner(args: argparse.Namespace, engine: object) -> dict:
    """One learner step (fp32 weights, AdamW) on groups the engine sampled, then the bf16
    export and the publisher's build of that version."""
    import torch

    from echo2p2p import messages as m
    from echo2p2p import signing
    from echo2p2p.buffer import ScoredGroup
    from echo2p2p.hub.config_sections import OverlayConfig
    from echo2p2p.hub.learning.learner import Learner
    from echo2p2p.hub.overlay.publisher import Publisher
    from echo2p2p.hub.overlay.versions import VersionFiles
    from echo2p2p.policy.model import load_policy
    from echo2p2p.rows import parse_samples

    task = CoinTask(seed=0)
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    groups = []
    for g in range(args.groups):
        out = engine.generate(prompt, args.group_size, temperature=1.0, top_p=1.0,
                              max_new_tokens=args.new_tokens, seed=100 + g)
        samples = parse_samples([m.Sample(m.pack_ids(c.token_ids), m.pack_logprobs(c.logprobs),
                                          c.text, 0.0, c.finish_reason) for c in out], None)
        groups.append(ScoredGroup(f"L{g}", f"P{g}", prompt, 0, samples,
                                  [task.reward("", c.text) for c in out]))
    del engine
    peak_reset(args.device)
    model, tokenizer = load_policy(str(args.model_dir), device=args.device)
    learner = Learner(model, lr=1e-5, pad_id=tokenizer.pad_token_id)
    learner.step(groups[:1])  # warm-up: kernels, AdamW state
    sync(args.device)
    start = time.perf_counter()
    stats = learner.step(groups)
    sync(args.device)
    step_s = time.perf_counter() - start
    trained_tokens = sum(len(s.token_ids) + len(prompt) for g in groups for s in g.samples)
    start = time.perf_counter()
    weights = learner.export_weights(torch.bfloat16)
    export_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="gpu-realsize-") as tmp:
        pub = Publisher(OverlayConfig(), signing.new_private_key(),
                        files=VersionFiles(Path(tmp), keep_streams=1, keep_chunks=1))
        built = pub.build(1, weights)
    return {"part": "learner", "step_s": round(step_s, 3), "skipped": stats.skipped,
            "tokens_per_s": round(trained_tokens / step_s, 1), "export_s": round(export_s, 2),
            "publish_build_s": round(pub.timings["build_s"], 2),
            "wire_gb": round(built.full.wire_bytes / 1e9, 3), "peak_gb": peak_gb(args.device)}


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return [{"part": "all", "error": "no CUDA device here: use --device cpu --tiny"}]
    state = full_state(args.model_dir)
    rows, engine = [], None
    for kind in args.engines.split(","):
        try:
            row, built = measure_engine(kind, args, state)
        except ImportError as exc:
            rows.append({"part": kind, "error": f"not installed ({exc.name or exc})"})
            continue
        except Exception as exc:  # noqa: BLE001 - one part failing must not hide the others
            rows.append({"part": kind, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        rows.append(row)
        if kind == "transformers":
            engine = built
        else:
            del built
    if engine is not None and not args.no_learner:
        rows.append(measure_learner(args, engine))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:1 or cpu")
    ap.add_argument("--engines", default="transformers,vllm",
                    help="comma-separated engines to measure (vllm where it is installed)")
    ap.add_argument("--batch", type=int, default=16, help="rows sampled at once for tokens/s")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens sampled per row")
    ap.add_argument("--groups", type=int, default=8, help="groups in the learner's batch")
    ap.add_argument("--group-size", type=int, default=8, help="G, samples per group")
    ap.add_argument("--no-learner", action="store_true", help="skip the learner step")
    ap.add_argument("--tiny", action="store_true",
                    help="2 decoder layers, 8 rows of 8 tokens, 2 groups of 2: a CPU smoke test")
    ap.add_argument("--model-dir", type=Path,
                    default=Path.home() / ".cache" / "echo2p2p" / "qwen3-0.6b-shape")
    args = ap.parse_args(argv)
    layers = 28
    if args.tiny:
        layers, args.batch, args.new_tokens, args.groups, args.group_size = 2, 8, 8, 2, 2
        args.model_dir = args.model_dir.with_name(f"{args.model_dir.name}-2l")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ensure_model(args.model_dir, layers)
    rows = run(args)
    cols = ["part", "tokens_per_s", "reload_s", "step_s", "export_s", "publish_build_s",
            "peak_gb", "error"]
    print(f"\nQwen3-0.6B-shaped ({layers} layers) on {args.device}\n")
    print(table(cols, [[r.get(c) for c in cols] for r in rows]))
    print(json.dumps({"bench": "gpu_realsize", "device": args.device, "layers": layers,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
