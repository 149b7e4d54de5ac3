"""The hub learner's peak memory on a real model, measured against `echo2p2p.learner_size`'s
prediction: a couple of GRPO steps on a batch shaped like a real run's.

Each measurement is its own process (`--worker`), so its peak RSS (`ru_maxrss`) is its own:
the model loaded (fp32), a `Learner` built as `echo2-hub serve` builds it (micro-batches from
`LearnerConfig`), then --steps steps on G groups x N samples x (prompt + completion) random
tokens, rewards varying within each group so that every sample is trained. Reported: RSS after
loading, the step peak, the micro-batch token budget used, and the hub's predicted RAM
(`echo2p2p.hub.learning.fitting.predicted_footprint`) beside it: its runtime, learner state and
micro-batch parts (what this process holds; the hub adds the spot-checker's copy and the version
being published); --checkpoint: the bytes of one learner checkpoint too (12 P predicted).

    python bench/hub_footprint.py --model /tmp/smol/m [--steps 2] [--micro-tokens N] [--checkpoint]
    python bench/hub_footprint.py --model tiny

Measured on 2 shared cores (ratio = peak / predicted learner parts): SmolLM2-135M (/tmp/smol/m,
fp32, 801-token micro-batches, 1 group x 8 x (60 + 64), 2 steps): peak 3.42 GB against 4.90
(0.70; the whole hub 5.98 predicted), one checkpoint 1.73 GB (12 P = 1.61); before the memory
budget, the issue's 8 x 8 batch in one 7,936-token micro-batch was killed for memory at 16.1 GB
in its first step (25.1 predicted). tiny, --micro-tokens 4096: 0.62 GiB against 0.75 (0.83).

Ends with one JSON line {"bench": "hub_footprint", ...}. MALLOC_MMAP_THRESHOLD_=65536 is set
for the worker, so freed tensors leave the RSS and the peak follows the tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args: argparse.Namespace) -> dict:
    """Load, build the learner, step; the peak RSS of this process."""
    import torch

    from echo2p2p.buffer import ScoredGroup
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.learning.fitting import fit_to_model, predicted_footprint
    from echo2p2p.hub.run.start import make_learner
    from echo2p2p.learner_size import ModelShape
    from echo2p2p.policy.model import load_policy
    from echo2p2p.rows import SampleRow

    torch.set_num_threads(args.threads)
    base = rss_bytes()
    model, tokenizer = load_policy(args.model, device="cpu")
    model = model.float()
    loaded = rss_bytes()
    flat = {"learner_micro_tokens": args.micro_tokens} if args.micro_tokens else {}
    shape = ModelShape.of(model)
    cfg = fit_to_model(HubConfig.from_flat(model=args.model, **flat), shape)
    learner = make_learner(cfg, model, tokenizer, None)
    vocab = learner.vocab_size
    rng = random.Random(0)
    groups = []
    for g in range(args.groups):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        rows = tuple(SampleRow.of([rng.randrange(vocab) for _ in range(args.completion_tokens)],
                                  [-2.0] * args.completion_tokens)
                     for _ in range(args.samples))
        rewards = [float(i % 2) for i in range(args.samples)]
        groups.append(ScoredGroup(f"l{g}", f"p{g}", prompt, 0, rows, rewards))
    steps = [learner.step(groups) for _ in range(args.steps)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checkpoint = 0
    if args.checkpoint:  # what one checkpoint of the learner writes (weights and AdamW state)
        with tempfile.TemporaryDirectory() as tmp:
            learner.save(Path(tmp) / "learner")
            checkpoint = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    predicted = predicted_footprint(cfg, shape)
    return {"model": args.model, "params": shape.params, "vocab": shape.vocab,
            "micro_tokens": learner.micro_tokens, "base_rss": base, "loaded_rss": loaded,
            "peak_rss": peak, "predicted_learner": sum(
                predicted.ram_parts[k] for k in ("runtime", "learner state", "micro-batch")),
            "step_s": [round(s.step_s, 2) for s in steps],
            "loss": [s.loss for s in steps], "predicted_ram": predicted.ram_bytes,
            "predicted_disk": predicted.disk_bytes, "predicted_ram_parts": predicted.ram_parts,
            "checkpoint_every": cfg.run.checkpoint_every,
            "catch_up_versions": cfg.overlay.catch_up_versions,
            "disk_per_version": predicted.disk_per_version_bytes,
            "checkpoint_bytes": checkpoint}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="/tmp/smol/m")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=60)
    p.add_argument("--completion-tokens", type=int, default=64)
    p.add_argument("--micro-tokens", type=int, default=0, help="0: the config's default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpoint", action="store_true", help="also measure one checkpoint's bytes")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env,
                         check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    gib = 2 ** 30
    print(f"{result['model']}: P={result['params'] / 1e6:.1f} M, vocab {result['vocab']}, "
          f"micro-batch {result['micro_tokens']} tokens; RSS loaded "
          f"{result['loaded_rss'] / gib:.2f} GiB, step peak {result['peak_rss'] / gib:.2f} GiB, "
          f"predicted: this learner process {result['predicted_learner'] / gib:.2f} GiB (ratio "
          f"{result['peak_rss'] / result['predicted_learner']:.2f}), the whole hub "
          f"{result['predicted_ram'] / gib:.2f} GiB; step s {result['step_s']}")
    print(json.dumps({"bench": "hub_footprint", **result}))


if __name__ == "__main__":
    main()
