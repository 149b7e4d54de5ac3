"""Make the shipped base checkpoint of the built-in model: `python -m bench.assets.make_tiny_base`.

Builds the character tokenizer and the tiny Qwen3 (echo2p2p/policy/model.py), then runs a short
supervised warm-up on the train split of the hub's own AdditionTask (`warmup_problems()`; loss
on the answer and EOS only). That split is fixed, whatever a run's seed, so nothing the hub holds
out was warm-up data. The warm-up targets come in two styles: the bare answer "87" and, with
probability `--hedge-fraction`, a hedged "87?" that the task's verifier counts as wrong. The
result knows most sums but mostly answers in the wrong style, the way a pretrained model knows
the maths before RL teaches it the answer format: greedy exact-match accuracy starts low, sampled
groups of 8 hold correct answers often (GRPO signal), and RL has a long way to climb. The warm-up
stops once the probe's accuracy with the hedge forgiven reaches `--target-competence`. Saves
model (safetensors, fp32) and tokenizer with save_pretrained, and prints both accuracies. CPU
only, about 3 minutes on one thread. Its loop, `supervised_steps`, warms up `make_takeaway_base` too.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from echo2p2p.tasks import AdditionTask

HEDGE = "?"


def warmup_task() -> AdditionTask:
    """The task the base is warmed up on: the hub's (`AdditionTask()`, the fixed split the hub
    evaluates on), so that what the hub holds out is what the warm-up never saw."""
    return AdditionTask()


def warmup_problems(task: AdditionTask | None = None) -> list:
    """What the warm-up trains on: the train split of `task` (default `warmup_task()`)."""
    return list((task or warmup_task()).problems("train"))


def forgiving(reward):
    """`reward` with a trailing hedge forgiven: how many sums the model knows."""
    return lambda answer, completion: reward(answer, completion.strip().removesuffix(HEDGE))


def encode_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt + answer + EOS, and labels that are -100 on the prompt."""
    p = tokenizer.encode(prompt, add_special_tokens=False)
    a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return p + a, [-100] * len(p) + a


def greedy_accuracy(model, tokenizer, problems: Sequence, reward, *, max_new_tokens: int = 8) -> float:
    """Exact-match accuracy of greedy completions; prompts batched by length (no padding)."""
    import torch

    from echo2p2p.policy.sampling import forward_cached

    by_len: dict[int, list] = {}
    for p in problems:
        by_len.setdefault(len(p.prompt), []).append(p)
    eos, correct = tokenizer.eos_token_id, 0.0
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for group in by_len.values():
            ids = torch.tensor([tokenizer.encode(p.prompt, add_special_tokens=False)
                                for p in group])  # (B, P)
            out, cache = [], None
            step_ids = ids
            for _ in range(max_new_tokens):
                logits, cache = forward_cached(model, step_ids, cache)  # (B, V)
                step_ids = logits.argmax(-1, keepdim=True)  # (B, 1)
                out.append(step_ids)
            rows = torch.cat(out, dim=1).tolist()  # (B, N)
            for p, row in zip(group, rows):
                row = row[:row.index(eos)] if eos in row else row
                correct += reward(p.answer, tokenizer.decode(row, skip_special_tokens=True))
    model.train(was_training)
    return correct / max(len(problems), 1)


Example = tuple[list[int], list[int]]  # token ids, and labels: -100 where there is no loss


def supervised_steps(model, pad_token_id: int, batch: Callable[[], list[Example]], *,
                     steps: int, lr: float) -> Iterator[tuple[int, Any]]:
    """AdamW steps of next-token loss on `batch()` (a fresh batch each step), right padded;
    yields (step, loss tensor) after each, from 1. The warm-up of both built-in bases (this
    one and `make_takeaway_base`): the caller probes, logs and stops between steps."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    for step in range(1, steps + 1):
        examples = batch()
        width = max(len(ids) for ids, _ in examples)
        ids = torch.full((len(examples), width), pad_token_id)  # (B, T)
        labels = torch.full((len(examples), width), -100)  # (B, T)
        for i, (x, y) in enumerate(examples):
            ids[i, :len(x)], labels[i, :len(y)] = torch.tensor(x), torch.tensor(y)
        loss = model(input_ids=ids, labels=labels).loss  # right padding: causal, so harmless
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield step, loss


def warm_up(model, tokenizer, task, *, target_competence: float, hedge_fraction: float,
            max_steps: int, batch_size: int, lr: float, eval_every: int, seed: int,
            log=print) -> tuple[int, float]:
    """Supervised steps until forgiving held-out accuracy >= target; (steps run, last value)."""
    rng = random.Random(seed)
    train = warmup_problems(task)
    probe = list(task.problems("eval"))[:200]  # early-stopping probe (checkpoint selection only)

    def batch() -> list[Example]:
        return [encode_example(tokenizer, p.prompt,
                               p.answer + (HEDGE if rng.random() < hedge_fraction else ""))
                for p in rng.sample(train, batch_size)]

    accuracy, t0 = 0.0, time.perf_counter()
    for step, loss in supervised_steps(model, tokenizer.pad_token_id, batch, steps=max_steps,
                                       lr=lr):
        if step % eval_every == 0:
            accuracy = greedy_accuracy(model, tokenizer, probe, forgiving(task.reward))
            log(f"step {step:5d}  loss {loss.item():.3f}  probe competence {accuracy:.3f}  "
                f"{time.perf_counter() - t0:.0f}s")
            if accuracy >= target_competence:
                return step, accuracy
    return max_steps, accuracy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output directory (default: echo2p2p/policy/assets/tiny-base)")
    ap.add_argument("--seed", type=int, default=0, help="model init and batch order seed")
    ap.add_argument("--target-competence", type=float, default=0.8,
                    help="stop once held-out greedy accuracy, hedges forgiven, reaches this")
    ap.add_argument("--hedge-fraction", type=float, default=0.55,
                    help="share of warm-up answers written in the hedged style the verifier rejects")
    ap.add_argument("--max-steps", type=int, default=2500, help="warm-up step cap")
    ap.add_argument("--batch-size", type=int, default=64, help="sequences per warm-up step")
    ap.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between accuracy probes")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)

    import torch

    from echo2p2p.policy.model import build_char_tokenizer, build_tiny_model, builtin_dir

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.out or str(builtin_dir())
    task = warmup_task()  # no --task-seed: a base on another split would leak into eval
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen3: {n_params:,} parameters; {len(task.problems('train'))} train problems")
    t0 = time.perf_counter()
    steps, _ = warm_up(model, tokenizer, task, target_competence=args.target_competence,
                       hedge_fraction=args.hedge_fraction, max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr,
                       eval_every=args.eval_every, seed=args.seed)
    accuracy = greedy_accuracy(model, tokenizer, task.problems("eval"), task.reward)
    competence = greedy_accuracy(model, tokenizer, task.problems("eval"), forgiving(task.reward))
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(json.dumps({"out": out, "params": n_params, "warmup_steps": steps,
                      "warmup_s": round(time.perf_counter() - t0, 1),
                      "eval_greedy_accuracy": accuracy, "eval_greedy_competence": competence,
                      "eval_problems": len(task.problems("eval"))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
