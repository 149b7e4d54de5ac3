"""Procedurally generated reasoning tasks from `reasoning-gym`, scored by the generator itself.

`ReasoningTask(name, args, eval_size=...)` draws problems from the generator `name` (one of
reasoning-gym's datasets, "basic_arithmetic", "leg_counting", ...) configured with `args` (its
config's keywords, {"min_digits": 1, "max_digits": 2}). The split is the generator's own seed,
never a run's: the held-out set is the first `eval_size` distinct questions drawn with
`EVAL_SEED` (at most half of the distinct questions the training draw holds, for a generator
that makes few); the training set is `TRAIN_SIZE` entries drawn with `TRAIN_SEED`, less every
entry whose question text is held out. Easy configs repeat questions, so the split is held out
by question text, by construction.

The prompt is the generator's question and `INSTRUCTION`. Scoring (`GeneratorScore`) needs the
whole entry (answer and metadata), which peers never receive, so peers do not score these tasks
(their kind, "rg:<name>", is not one of `echo2p2p.tasks.REWARDS`): the hub's scorers call
`dataset.score_answer(extract_answer(completion, entry), entry)`.

`reasoning_gym` is imported only when a generator is opened (`open_generator`): LookupError for
an unknown name (naming close ones), ValueError for arguments the generator rejects, ImportError
when it is not installed.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Problem, check_split

KIND_PREFIX = "rg:"
INSTRUCTION = "Give only the final answer."
EVAL_SEED = 1_000_000_007  # the held-out draw; items are seeded seed + index, far from TRAIN_SEED's
TRAIN_SEED = 0
TRAIN_SIZE = 10_000  # the hub cycles through these in shuffled epochs
EVAL_DRAWS_PER_PROBLEM = 20  # draws tried per held-out problem wanted, when questions repeat

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_LEAD_IN = re.compile(r"^(?:the\s+(?:final\s+)?answer\s+is:?|(?:final\s+)?answer\s*:)\s*", re.I)


def extract_answer(completion: str, entry: Mapping[str, Any]) -> str:
    """What of `completion` is scored against `entry`: the content of the last
    <answer>...</answer>; else, when the gold answer is a number, the last number ("5 - 3 = 2"
    gives "2", "1,234." gives "1234"); else the last non-empty line without a leading
    "Answer:" or "The answer is" and a trailing period."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if _NUMBER.fullmatch(str(entry.get("answer", "")).strip()):
        numbers = _NUMBER.findall(completion)
        if numbers:
            return numbers[-1].replace(",", "")
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    if not lines:
        return ""
    return _LEAD_IN.sub("", lines[-1]).strip().removesuffix(".").strip()


def open_generator(name: str, args: Mapping[str, Any], *, seed: int, size: int) -> Any:
    """reasoning-gym's dataset `name` with config keywords `args` (see the module docstring
    for what it raises)."""
    import reasoning_gym  # optional: pip install reasoning-gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=4, cutoff=0.5)
        hint = f"close names: {', '.join(close)}; " if close else ""
        raise LookupError(f"no reasoning-gym generator {name!r}; {hint}list them with python -c "
                          f"\"import reasoning_gym.factory as f; print(sorted(f.DATASETS))\"")
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **args)
    except (TypeError, ValueError, AssertionError) as exc:  # a keyword or value it rejects
        raise ValueError(f"generator {name!r} rejects {dict(args)}: {exc}") from None


def prompt_of(entry: Mapping[str, Any]) -> str:
    """The prompt of a generated entry: its question, then `INSTRUCTION`."""
    return f"{str(entry['question']).rstrip()}\n{INSTRUCTION}"


class ReasoningTask:
    """A reasoning-gym generator's problems with a held-out split fixed by its own seeds."""

    def __init__(self, name: str, args: Mapping[str, Any] | None = None, *,
                 eval_size: int = 256, train_size: int = TRAIN_SIZE):
        self.name, self.args = name, dict(args or {})
        self.kind = KIND_PREFIX + name
        train = list(open_generator(name, self.args, seed=TRAIN_SEED, size=train_size))
        distinct = len({e["question"] for e in train})
        wanted = max(1, min(eval_size, distinct // 2))
        held = self._held_out(wanted)
        questions = {e["question"] for e in held}
        self._splits = {
            "eval": tuple(_problem(f"{self.kind}/eval/{i}", e) for i, e in enumerate(held)),
            "train": tuple(_problem(f"{self.kind}/train/{i}", e) for i, e in enumerate(train)
                           if e["question"] not in questions)}
        if not self._splits["train"]:
            raise ValueError(f"generator {name!r} with {self.args} makes too few distinct "
                             f"questions to hold some out: widen its arguments")

    def _held_out(self, wanted: int) -> list[dict[str, Any]]:
        """The first `wanted` distinct questions of the `EVAL_SEED` draw (fewer when the
        generator repeats itself that much)."""
        held: dict[str, dict[str, Any]] = {}
        for entry in open_generator(self.name, self.args, seed=EVAL_SEED,
                                    size=wanted * EVAL_DRAWS_PER_PROBLEM):
            held.setdefault(entry["question"], entry)
            if len(held) == wanted:
                break
        return list(held.values())

    def problems(self, split: str) -> Sequence[Problem]:
        """The problems of `split`; the same tuple on every call."""
        return self._splits[check_split(split)]

    def scorer(self) -> GeneratorScore:
        """What the hub's scorers call for this task."""
        return GeneratorScore(self.name, self.args)

    def reward(self, answer: str, completion: str) -> float:
        raise TypeError("a reasoning-gym task is scored against the whole entry: use scorer()")


class GeneratorScore:
    """`score(problem, completion)`: the generator's `score_answer` on the extracted answer
    against the problem's entry (`Problem.row`). Picklable: the generator is rebuilt, once,
    where it is unpickled (a scoring worker, as it starts). Raises on a score that is not a
    number in [0, 1] (a scorer counts that sample as failed and scores it 0)."""

    def __init__(self, name: str, args: Mapping[str, Any]):
        self.name, self.args = name, dict(args)
        self._dataset: Any = None

    def __call__(self, problem: Problem, completion: str) -> float:
        if self._dataset is None:
            self._dataset = open_generator(self.name, self.args, seed=EVAL_SEED, size=1)
        entry = problem.row
        value = float(self._dataset.score_answer(extract_answer(completion, entry), entry))
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"{self.name}.score_answer returned {value}, not in [0, 1]")
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "args": self.args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Opens the generator now: in a scoring worker that is while it starts, not within the
        first completion's deadline (importing reasoning-gym takes a second or more)."""
        self.name, self.args = state["name"], state["args"]
        self._dataset = open_generator(self.name, self.args, seed=EVAL_SEED, size=1)


def _problem(problem_id: str, entry: Mapping[str, Any]) -> Problem:
    return Problem(id=problem_id, prompt=prompt_of(entry), answer=str(entry["answer"]),
                   row=dict(entry))
