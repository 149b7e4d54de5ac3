"""The learner's GPU memory and speed per rank at real size: a Qwen3-4B-shaped model on N GPUs.

For a lent CUDA machine; the CUDA twin of bench/learner_memory.py (same batches, same measures).
The model is Qwen3-4B's published config (hidden 2560, MLP 9728, 36 layers, 32 query / 8 KV
heads of 128, vocabulary 151936, tied embeddings; 4.02 B parameters) with random weights: only
config.json and bench/realsize_probes.py's padded character tokenizer are written to --model-dir,
and `load_policy` builds the architecture from them (nothing is downloaded, no 8 GB of weight
files). Launched as PyTorch jobs are, one GPU per rank (nccl; `Ranks.from_env`):

    python -m torch.distributed.run --nproc-per-node N bench/gpu_learner.py \
        [--precision bf16] [--checkpointing] [--steps 3] [--completion-tokens 512]
    python bench/gpu_learner.py --device cpu --tiny     # the built-in tiny policy: a smoke test

Per rank, with `torch.cuda.max_memory_allocated` (peaks reset between phases): allocated after
the model is loaded and sharded, the peak over --steps `Learner.step`s after a warm-up step
(AdamW state allocated), and the peak of one publication (`iter_weights(torch.bfloat16)` on
every rank) above the memory before it; step seconds CUDA-synchronised, completion tokens/s.
Rank 0 prints a table beside 16 P / W (fp32 weights, grads, AdamW moments), then one JSON line
{"bench": "gpu_learner", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learner_memory import make_groups, share_tokens  # noqa: E402
from bench.realsize_probes import padded_char_tokenizer, table  # noqa: E402

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                tie_word_embeddings=True)


def ensure_config(directory: Path, layers: int) -> Path:
    """--model-dir with Qwen3-4B's config (`layers` decoder layers) and the padded tokenizer,
    no weights: `load_policy` then initialises the architecture at random."""
    if (directory / "config.json").exists():
        return directory
    from transformers import Qwen3Config

    tokenizer = padded_char_tokenizer(QWEN3_4B["vocab_size"])
    staged = directory.with_name(f"{directory.name}.{os.getpid()}")  # every rank writes one
    Qwen3Config(**{**QWEN3_4B, "num_hidden_layers": layers},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id).save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    try:
        staged.rename(directory)  # atomic; the first rank's wins
    except OSError:
        shutil.rmtree(staged)
    return directory


class Gauge:
    """Peak device memory since the last `reset`, and synchronised seconds (CUDA or CPU)."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else 0

    def timed(self, call) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter() - start


def rank_main(args: argparse.Namespace) -> list[dict]:
    """Every rank's figures (the module docstring's measures) on rank 0; [] on the others."""
    import torch

    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.learning.learner import Learner
    from echo2p2p.hub.learning.ranks import Ranks
    from echo2p2p.policy.model import load_policy

    ranks = Ranks.from_env(HubConfig.from_flat(prompts_per_step=args.groups, device=args.device))
    world, rank = (1, 0) if ranks is None else (ranks.world, ranks.rank)
    device = torch.device(args.device) if ranks is None else ranks.device
    gauge = Gauge(device)
    model, tokenizer = load_policy(args.model, device=str(device), weights=rank == 0)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    groups = make_groups(cfg.vocab_size, args.groups, args.group_size, args.prompt_tokens,
                         args.completion_tokens)
    learner = Learner(model, lr=1e-5, pad_id=tokenizer.pad_token_id, ranks=ranks,
                      micro_tokens=args.micro_tokens, precision=args.precision,
                      checkpointing=args.checkpointing)
    del model
    out = {"rank": rank, "world": world, "params": params, "sharded": gauge.allocated(),
           "init_peak": gauge.peak(),
           "padded_tokens": share_tokens(groups, cfg.vocab_size, world, rank, args.micro_tokens)[0]}
    learner.step(groups)  # warm-up: AdamW state, kernels
    gauge.reset()
    out["step_s"] = [gauge.timed(lambda: learner.step(groups)) for _ in range(args.steps)]
    out["step_peak"], out["before_pub"] = gauge.peak(), gauge.allocated()
    gauge.reset()
    out["publish_s"] = gauge.timed(lambda: [None for _ in learner.iter_weights(torch.bfloat16)])
    out["pub_peak"] = gauge.peak()
    out["tokens"] = sum(s.n_tokens for g in groups for s in g.samples)
    if ranks is None:
        return [out]
    rows = ranks.gather_to_first(out)
    ranks.close()
    return rows


def report(args: argparse.Namespace, rows: list[dict]) -> dict:
    gb = lambda b: round(b / 1e9, 2)  # noqa: E731
    world, params = rows[0]["world"], rows[0]["params"]
    step_s = [max(t) for t in zip(*(r["step_s"] for r in rows))]
    mean_s = sum(step_s) / len(step_s)
    print(f"\n{Path(args.model).name} ({args.layers} layers), P = {params / 1e9:.2f} B, "
          f"W = {world}, {args.precision}, checkpointing {args.checkpointing}, {args.device}\n")
    print(table(["rank", "sharded GB", "init peak GB", "step peak GB", "16 P / W GB",
                 "publication over before GB", "padded tokens"], [
        [r["rank"], gb(r["sharded"]), gb(r["init_peak"]), gb(r["step_peak"]),
         gb(16 * params / world), gb(r["pub_peak"] - r["before_pub"]), r["padded_tokens"]]
        for r in rows]))
    print(f"step {mean_s:.3f} s, {rows[0]['tokens'] / mean_s:.0f} completion tokens/s\n")
    return {"bench": "gpu_learner", "device": args.device, "layers": args.layers, "world": world,
            "precision": args.precision, "checkpointing": args.checkpointing, "params": params,
            "step_s": round(mean_s, 4), "tokens_per_s": round(rows[0]["tokens"] / mean_s, 1),
            "ranks": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (one GPU per rank) or cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                    help="bf16: compute in bf16 over fp32 master weights")
    ap.add_argument("--checkpointing", action="store_true", help="recompute layer activations")
    ap.add_argument("--layers", type=int, default=36, help="decoder layers (36: Qwen3-4B)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps after 1 warm-up")
    ap.add_argument("--groups", type=int, default=8, help="groups per batch (W must divide it)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per group")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--completion-tokens", type=int, default=512)
    ap.add_argument("--micro-tokens", type=int, default=16384, help="the learner's micro_tokens")
    ap.add_argument("--model-dir", type=Path,
                    default=Path.home() / ".cache" / "echo2p2p" / "qwen3-4b-shape")
    ap.add_argument("--tiny", action="store_true",
                    help="the built-in tiny policy, 2 groups of 2 x 8 tokens: a smoke test")
    args = ap.parse_args(argv)
    if args.layers != 36:
        args.model_dir = args.model_dir.with_name(f"{args.model_dir.name}-{args.layers}l")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_learner: no CUDA device here (--device cpu for a smoke test)", file=sys.stderr)
        return 2
    if args.tiny:
        args.model, args.layers, args.groups, args.group_size = "tiny", 3, 2, 2
        args.completion_tokens, args.prompt_tokens = 8, 8
    else:
        args.model = str(ensure_config(args.model_dir, args.layers))
    rows = rank_main(args)
    if rows:
        print(json.dumps(report(args, rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
