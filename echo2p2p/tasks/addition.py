"""The built-in task: addition, prompt "47+38=", answer "85".

Operands have 1..`max_digits` digits (2 by default: a task the built-in tiny model can master
on a CPU), the digit count drawn uniformly first so that short and long sums are equally common.
Problems are drawn from a `random.Random` seeded with `split_seed`; a pair (a, b) appears at most
once across both splits, so "eval" is held out from "train" exactly. The split is a property of
the task, never of a run: a run's seed orders the prompts and seeds the sampling, but the held-out
set stays put, and `SPLIT_SEED` (the default) is the split the shipped base checkpoint was warmed
up on (its train split), so its held-out problems are ones that model has never seen.

Reward ("addition"): 1.0 when the completion equals the answer exactly (the engine has already cut
it at EOS), else 0.0 — a hedged "85?" earns nothing. Partial credit ("addition-partial",
`AdditionTask(partial_credit=True)`): a wrong answer of the right length also earns 0.5 x the
fraction of its digits in place, so a miss always scores below 0.5 and an exact answer 1.0.
Accuracy is always `addition_reward` (exact match), whatever the training reward.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .base import Problem, check_split

KIND = "addition"
PARTIAL_KIND = "addition-partial"
SPLIT_SEED = 0  # the shipped base (bench/assets/make_tiny_base.py) trained on this split: keep it


def addition_reward(answer: str, completion: str) -> float:
    """1.0 if `completion` (surrounding whitespace ignored) is exactly `answer`, else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def addition_partial_reward(answer: str, completion: str) -> float:
    """Exact match, or for a same-length miss 0.5 x the fraction of digits in place."""
    answer, completion = answer.strip(), completion.strip()
    if completion == answer:
        return 1.0
    if len(completion) != len(answer) or not answer:
        return 0.0
    return 0.5 * sum(a == c for a, c in zip(answer, completion)) / len(answer)


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


class AdditionTask:
    """`train_size` + `eval_size` distinct sums of two numbers of up to `max_digits` digits."""

    kind: str  # KIND, or PARTIAL_KIND with partial_credit

    def __init__(self, split_seed: int = SPLIT_SEED, *, max_digits: int = 2,
                 train_size: int = 4_500, eval_size: int = 500,
                 partial_credit: bool = False) -> None:
        """`split_seed`: which problems are drawn and which are held out; not a run's seed (a
        base model warmed up on one split would find its training data in another's eval)."""
        if max_digits < 1:
            raise ValueError(f"max_digits must be >= 1, got {max_digits}")
        space = 10 ** (2 * max_digits)  # distinct ordered pairs
        if train_size < 0 or eval_size < 0 or train_size + eval_size > space // 2:
            raise ValueError(f"train_size + eval_size = {train_size + eval_size} is out of range "
                             f"for {max_digits}-digit operands (at most {space // 2})")
        self.split_seed = split_seed
        self.max_digits = max_digits
        self.kind = PARTIAL_KIND if partial_credit else KIND
        self._reward = addition_partial_reward if partial_credit else addition_reward
        rng = random.Random(f"addition/{split_seed}/{max_digits}")
        seen: set[tuple[int, int]] = set()
        drawn: list[Problem] = []
        while len(drawn) < train_size + eval_size:
            pair = (_operand(rng, max_digits), _operand(rng, max_digits))
            if pair in seen:
                continue
            seen.add(pair)
            a, b = pair
            drawn.append(Problem(id=f"add-{a}+{b}", prompt=f"{a}+{b}=", answer=str(a + b)))
        self._splits = {"eval": tuple(drawn[:eval_size]), "train": tuple(drawn[eval_size:])}

    def problems(self, split: str) -> Sequence[Problem]:
        """The problems of `split`; the same tuple on every call."""
        return self._splits[check_split(split)]

    def reward(self, answer: str, completion: str) -> float:
        return self._reward(answer, completion)
