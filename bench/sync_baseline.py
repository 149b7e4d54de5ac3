"""The synchronous baseline (S = 0): generate, score (in a worker process), learn, in turn.

The reference the distributed run is measured against (learning parity): the same learner,
the same engine and the same weight path as a peer gets (the learner's version exported in
`weights_dtype` and loaded into a `TransformersEngine`), but no network, no leases and no
staleness: every group of step t is sampled from version t. Deterministic given `seed`. Its
defaults are the hub's (`HubConfig`'s fields: lr, prompts per step, G, tokens, eval problems...),
so a bare run is the S = 0 twin of a bare `echo2-hub serve`:

    python -m bench.sync_baseline --steps 100
    python -m bench.sync_baseline --steps 100 --lr 3e-4 --prompts-per-step 16 --eval-every 20
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from echo2p2p.config import as_dict

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.config_sections import TasksConfig

log = logging.getLogger(__name__)

HUB = HubConfig()  # the one source of defaults: a knob the hub has defaults to the hub's value
OnStep = Callable[[dict], None]


def train_sync(*, model: str = HUB.run.model, steps: int, seed: int = HUB.run.seed,
               prompts_per_step: int = HUB.grpo.prompts_per_step, lr: float = HUB.grpo.lr,
               group_size: int = HUB.grpo.group_size, temperature: float = HUB.grpo.temperature,
               top_p: float = HUB.grpo.top_p, max_new_tokens: int = HUB.grpo.max_new_tokens,
               eval_every: int = HUB.tasks.eval_every, eval_problems: int = HUB.tasks.eval_problems,
               weights_dtype: Any = HUB.overlay.weights_dtype, on_step: OnStep | None = None,
               score_timeout_s: float = HUB.scoring.score_timeout_s, prompts: Any = None) -> list[dict]:
    """`steps` synchronous GRPO steps on the hub's AdditionTask (`seed` orders its prompts and seeds
    sampling; its split is fixed); one record per step: step, version (the one the step produced),
    reward_mean (of the samples it trained on, drawn from version `step`), gen_s, the learner's
    `train/...` and off-policy (lag 0) metrics, eval_accuracy (greedy, held-out) when version %
    eval_every == 0 or at the last step; the first also holds eval_accuracy_initial (version 0) when
    eval_every > 0. `weights_dtype`: a torch dtype or its name. Rewards: the hub's, keyed by
    problem, in a worker process (`score_timeout_s` each). `prompts`: a `PromptFormat` ("auto")."""
    import torch

    from echo2p2p.policy.prompts import PromptFormat
    from echo2p2p.scoring.rewards import ByAnswer
    from echo2p2p.scoring.scorer import Scorer

    dtype = getattr(torch, weights_dtype) if isinstance(weights_dtype, str) else weights_dtype
    torch.manual_seed(seed)
    task, learner, engine, tokenizer = _open(model, lr, temperature)
    prompts = (prompts or PromptFormat()).check(tokenizer, repr(model))
    train = list(task.problems("train"))
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held_out = list(task.problems("eval"))[:eval_problems]
    sampling = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens}

    with Scorer(ByAnswer(task.reward), timeout_s=score_timeout_s, name="local-scorer") as scorer:
        def score(items: list[tuple[Any, str]]) -> list[float]:
            return scorer.score_blocking(items).rewards

        def evaluate() -> float:
            return learner.evaluate(tokenizer, held_out, score, max_new_tokens=max_new_tokens,
                                    prompts=prompts)

        initial = evaluate() if eval_every else None
        records: list[dict] = []
        for step in range(steps):  # step t trains on version t and produces version t + 1
            t0 = time.perf_counter()
            engine.load_weights(learner.export_weights(dtype))  # exactly what a peer would hold
            problems = [train[order[(step * prompts_per_step + j) % len(order)]]
                        for j in range(prompts_per_step)]
            groups = _generate(engine, tokenizer, problems, step, group_size, seed, score,
                               sampling, prompts)
            gen_s = time.perf_counter() - t0
            stats = learner.step(groups)
            record: dict[str, Any] = {"step": step, "version": step + 1, "gen_s": gen_s,
                                      "reward_mean": stats.reward_mean, **stats.metrics(),
                                      **stats.off_policy.summary(lambda version: step - version)}
            if step == 0 and initial is not None:
                record["eval_accuracy_initial"] = initial
            if eval_every and ((step + 1) % eval_every == 0 or step == steps - 1):
                record["eval_accuracy"] = evaluate()
            records.append(record)
            if on_step is not None:
                on_step(record)
    return records


def _open(model: str, lr: float, temperature: float) -> tuple[Any, Any, Any, Any]:
    """(task, learner, engine, tokenizer) of a synchronous run: the learner and a peer's engine
    on the same model."""
    from echo2p2p.policy.engines import TransformersEngine
    from echo2p2p.policy.model import load_policy
    from echo2p2p.tasks import AdditionTask

    from echo2p2p.hub.learning.learner import Learner

    task = AdditionTask()  # the hub's split, not one per seed: the held-out set stays put
    policy, tokenizer = load_policy(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    learner = Learner(policy, lr=lr, clip_eps=HUB.grpo.clip_eps, kl_coef=HUB.grpo.kl_coef,
                      pad_id=pad_id, temperature=temperature,
                      micro_tokens=HUB.learner.learner_micro_tokens)
    return task, learner, TransformersEngine(model), tokenizer


def _generate(engine: Any, tokenizer: Any, problems: list[Any], step: int, group_size: int,
              seed: int, score: Callable[[list[tuple[Any, str]]], list[float]],
              sampling: dict[str, Any], prompts: Any) -> list[Any]:
    """One scored group of `group_size` completions per problem, from version `step`."""
    seeds = [seed * 1_000_003 + step * len(problems) + j + 1 for j in range(len(problems))]
    return scored_groups(engine, tokenizer, problems, seeds, group_size, score, sampling, prompts,
                         version=step, label=f"sync-{step}")


def scored_groups(engine: Any, tokenizer: Any, problems: list[Any], seeds: list[int],
                  group_size: int, score: Callable[[list[tuple[Any, str]]], list[float]],
                  sampling: dict[str, Any], prompts: Any, *, version: int, label: str
                  ) -> list[Any]:
    """One scored group of `group_size` completions per problem (the j-th sampled with
    `seeds[j]`, its lease id `label-j`, tagged `version`), each sample taken through the wire
    format and the hub's row parser as a peer's would be (bench/mismatch.py too)."""
    from echo2p2p.buffer import ScoredGroup
    from echo2p2p.messages import Sample, pack_ids, pack_logprobs
    from echo2p2p.rows import parse_samples

    from echo2p2p.hub.learning.learner import encode_prompt
    from echo2p2p.policy.prompts import prompt_of

    groups = []
    for j, (problem, sample_seed) in enumerate(zip(problems, seeds)):
        prompt_ids = encode_prompt(tokenizer, prompt_of(problem), prompts)
        completions = engine.generate(prompt_ids, group_size, seed=sample_seed, **sampling)
        rewards = score([(problem, c.text) for c in completions])
        rows = parse_samples([
            Sample(token_ids=pack_ids(c.token_ids), logprobs=pack_logprobs(c.logprobs),
                   text=c.text, reward=r, finish_reason=c.finish_reason)
            for c, r in zip(completions, rewards)], None)
        assert not isinstance(rows, str), f"the engine made a sample the hub refuses: {rows}"
        groups.append(ScoredGroup(f"{label}-{j}", problem.id, prompt_ids, version, rows, rewards))
    return groups


# (flag, HubConfig field, help): the knobs the hub has, their defaults read from `HUB`
KNOBS = (
    ("--model", "model", "built-in name, HF hub id or local path"),
    ("--prompts-per-step", "prompts_per_step", "groups per step"),
    ("--group-size", "group_size", "completions per prompt, G"),
    ("--lr", "lr", "AdamW learning rate"),
    ("--seed", "seed", "prompt order and sampling seed; the task's split is fixed"),
    ("--temperature", "temperature", "sampling temperature"),
    ("--top-p", "top_p", "nucleus sampling threshold"),
    ("--max-new-tokens", "max_new_tokens", "completion length cap"),
    ("--eval-every", "eval_every", "greedy held-out eval period, 0 = off"),
    ("--eval-problems", "eval_problems", "held-out problems per eval"),
    ("--weights-dtype", "weights_dtype", "dtype the engine receives"),
    ("--score-timeout-s", "score_timeout_s", "deadline for scoring one completion"),
    ("--prompt-format", "prompt_format", "auto, chat or plain"),
    ("--system-prompt", "system_prompt", "system message under a chat template"),
    ("--chat-template-args", "chat_template_args", "JSON variables for the template"),
)


def parser() -> argparse.ArgumentParser:
    """The command line: `--steps`, `--threads`, and the hub's knobs with the hub's defaults."""
    p = argparse.ArgumentParser(prog="python -m bench.sync_baseline",
                                description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, required=True, help="learner steps")
    for flag, field, text in KNOBS:
        default = as_dict(HUB)[field]
        p.add_argument(flag, dest=field, type=type(default), default=default,
                       help=f"{text} (default: %(default)r, the hub's)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: one line per step on stdout, then the last record as JSON."""
    p = parser()
    args = p.parse_args(argv)
    try:
        prompts = TasksConfig(prompt_format=args.prompt_format, system_prompt=args.system_prompt,
                             chat_template_args=args.chat_template_args).prompts
    except ValueError as e:  # ConfigError: one line naming the flag
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import torch  # after parsing, so --help answers at once

    if args.threads:
        torch.set_num_threads(args.threads)

    def show(r: dict) -> None:
        line = (f"step {r['step']:4d} v{r['version']:<4d} reward {r['reward_mean']:.3f} "
                f"loss {r['train/loss']:+.4f} clip {r['train/clip_frac']:.3f} "
                f"ratio {r['train/ratio_mean']:.3f} grad {r['train/grad_norm']:.3f} "
                f"tokens {int(r['train/tokens'])} gen {r['gen_s']:.1f}s "
                f"train {r['train/step_s']:.1f}s")
        if "eval_accuracy_initial" in r:
            line += f" eval@v0 {r['eval_accuracy_initial']:.3f}"
        if "eval_accuracy" in r:
            line += f" eval {r['eval_accuracy']:.3f}"
        print(line, flush=True)

    records = train_sync(
        model=args.model, steps=args.steps, prompts_per_step=args.prompts_per_step,
        group_size=args.group_size, lr=args.lr, seed=args.seed, temperature=args.temperature,
        top_p=args.top_p, max_new_tokens=args.max_new_tokens, eval_every=args.eval_every,
        eval_problems=args.eval_problems, weights_dtype=args.weights_dtype, on_step=show,
        score_timeout_s=args.score_timeout_s, prompts=prompts,
    )
    if records:
        print(json.dumps(records[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
