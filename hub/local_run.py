"""The synchronous baseline (S = 0): generate, score (in a worker process), learn, in turn.

The reference the distributed run is measured against (learning parity): the same learner,
the same engine and the same weight path as a peer gets (the learner's version exported in
`weights_dtype` and loaded into a `TransformersEngine`), but no network, no leases and no
staleness: every group of step t is sampled from version t. Deterministic given `seed`.

    python -m echo2p2p.hub.local_run --steps 100 --prompts-per-step 16 --group-size 8 --lr 1e-5
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

log = logging.getLogger(__name__)


def train_sync(*, model: str = "tiny", steps: int, prompts_per_step: int, group_size: int,
               lr: float, seed: int, temperature: float = 1.0, top_p: float = 1.0,
               max_new_tokens: int, eval_every: int = 0, eval_problems: int = 128,
               weights_dtype: Any = "bfloat16", on_step: Callable[[dict], None] | None = None,
               score_timeout_s: float = 5.0, prompts: Any = None) -> list[dict]:
    """Run `steps` synchronous GRPO steps on AdditionTask(seed); one record per step: step,
    version (the one the step produced), reward_mean (of the samples the step trained on, drawn
    from version `step`), gen_s, the learner's `train/...` metrics, and eval_accuracy (greedy,
    held-out) when version % eval_every == 0 or at the last step; the first record also holds
    eval_accuracy_initial (version 0) when eval_every > 0. `weights_dtype`: a torch dtype or its
    name. Rewards come from a scoring worker process, `score_timeout_s` per completion.
    `prompts`: the `PromptFormat` (None: "auto", as the hub's default renders them)."""
    import torch

    from echo2p2p.policy.prompts import PromptFormat
    from echo2p2p.scoring.scorer import Scorer

    dtype = getattr(torch, weights_dtype) if isinstance(weights_dtype, str) else weights_dtype
    torch.manual_seed(seed)
    task, learner, engine, tokenizer = _open(model, lr, temperature, seed)
    prompts = (prompts or PromptFormat()).check(tokenizer, repr(model))
    train = list(task.problems("train"))
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    held_out = list(task.problems("eval"))[:eval_problems]
    sampling = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens}

    with Scorer(task.reward, timeout_s=score_timeout_s, name="local-scorer") as scorer:
        def score(items: list[tuple[str, str]]) -> list[float]:
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
            record: dict[str, Any] = {"step": step, "version": step + 1,
                                      "reward_mean": stats.reward_mean, "gen_s": gen_s,
                                      **stats.metrics()}
            if step == 0 and initial is not None:
                record["eval_accuracy_initial"] = initial
            if eval_every and ((step + 1) % eval_every == 0 or step == steps - 1):
                record["eval_accuracy"] = evaluate()
            records.append(record)
            if on_step is not None:
                on_step(record)
    return records


def _open(model: str, lr: float, temperature: float, seed: int) -> tuple[Any, Any, Any, Any]:
    """(task, learner, engine, tokenizer) of a synchronous run: the learner and a peer's engine
    on the same model."""
    from echo2p2p.policy.engines import TransformersEngine
    from echo2p2p.policy.model import load_policy
    from echo2p2p.tasks import AdditionTask

    from .learner import Learner

    task = AdditionTask(seed=seed)
    policy, tokenizer = load_policy(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    learner = Learner(policy, lr=lr, temperature=temperature, pad_id=pad_id)
    return task, learner, TransformersEngine(model), tokenizer


def _generate(engine: Any, tokenizer: Any, problems: list[Any], step: int, group_size: int,
              seed: int, score: Callable[[list[tuple[str, str]]], list[float]],
              sampling: dict[str, Any], prompts: Any) -> list[Any]:
    """One scored group of `group_size` completions per problem, from version `step`, each
    sample taken through the wire format and the hub's row parser as a peer's would be."""
    from echo2p2p.buffer import ScoredGroup
    from echo2p2p.messages import Sample, pack_ids, pack_logprobs
    from echo2p2p.rows import parse_samples

    from .learner import encode_prompt

    groups = []
    for j, problem in enumerate(problems):
        cursor = step * len(problems) + j + 1  # the sampling seed of the j-th prompt of `step`
        prompt_ids = encode_prompt(tokenizer, problem.prompt, prompts)
        completions = engine.generate(prompt_ids, group_size, seed=seed * 1_000_003 + cursor,
                                      **sampling)
        rewards = score([(problem.answer, c.text) for c in completions])
        rows = parse_samples([
            Sample(token_ids=pack_ids(c.token_ids), logprobs=pack_logprobs(c.logprobs),
                   text=c.text, reward=r, finish_reason=c.finish_reason)
            for c, r in zip(completions, rewards)], None)
        assert not isinstance(rows, str), f"the engine made a sample the hub refuses: {rows}"
        groups.append(ScoredGroup(f"sync-{step}-{j}", problem.id, prompt_ids, step, rows, rewards))
    return groups


def main(argv: list[str] | None = None) -> int:
    """Command line: one line per step on stdout, then the last record as JSON."""
    p = argparse.ArgumentParser(prog="python -m echo2p2p.hub.local_run", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="built-in name, HF hub id or local path")
    p.add_argument("--steps", type=int, required=True, help="learner steps")
    p.add_argument("--prompts-per-step", type=int, default=16, help="groups per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="task, order and sampling seed")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--max-new-tokens", type=int, default=16, help="completion length cap")
    p.add_argument("--eval-every", type=int, default=0, help="greedy held-out eval period (0: off)")
    p.add_argument("--eval-problems", type=int, default=128, help="held-out problems per eval")
    p.add_argument("--weights-dtype", default="bfloat16", help="dtype the engine receives")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--prompt-format", default="auto", help="auto, chat or plain (as the hub's)")
    p.add_argument("--system-prompt", default="", help="system message under a chat template")
    p.add_argument("--chat-template-args", default="", help="JSON variables for the template")
    args = p.parse_args(argv)
    from .config import HubConfig

    try:
        prompts = HubConfig(prompt_format=args.prompt_format, system_prompt=args.system_prompt,
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
        prompts=prompts,
    )
    if records:
        print(json.dumps(records[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
