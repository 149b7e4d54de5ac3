"""Procedurally generated reasoning tasks from `reasoning-gym`, scored by the generator itself.

`ReasoningTask(generator, args, eval_size=...)` draws problems from `generator` (one of
reasoning-gym's datasets, "basic_arithmetic", "leg_counting", ...) configured with `args` (its
config's keywords, {"min_digits": 1, "max_digits": 2}). The split is the generator's own seed,
never a run's: the held-out set is the first `eval_size` distinct questions drawn with
`EVAL_SEED` (at most half of the distinct questions the training draw holds, for a generator
that makes few); the training set is `TRAIN_SIZE` entries drawn with `TRAIN_SEED`, less every
entry whose question text is held out. Easy configs repeat questions, so the split is held out
by question text, by construction.

The prompt is the generator's question and `INSTRUCTION`. Scoring (`GeneratorScore`) needs the
whole entry (answer and metadata), which peers never receive, so peers do not score these tasks
(their kind, "rg:<generator>", is not one of `echo2p2p.tasks.REWARDS`): the hub's scorers call
`dataset.score_answer(answer, entry)`. Strict by default: 1.0 when the generator gives full
credit to the answer the completion commits to (`committed_answer`: one number against a
numeric gold, `echo2p2p.tasks.final_answer`), else 0.0. Many generators' scorers give partial
credit, chain_sum's `len(gold) / len(answer)` when the gold is inside a longer answer: the gold
with a digit appended earns ~0.66, two numbers ~0.39, digit soup up to 0.2, where a wrong
answer earns 0, so a policy learns to hedge. Full credit or nothing keeps each generator's own
normalisation ("+01,000.00" is 1000 to chain_sum) and pays nothing for a hedge.
`partial_credit=True` (`--task-args '{"partial_credit": true}'`, `task_options`) gives the
generator's score as it is, on what `extract_answer` takes (the last number, say).

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
from .final_answer import ANSWER_TAG, NUMBER, committed_statement, single_number

KIND_PREFIX = "rg:"
PARTIAL_CREDIT = "partial_credit"  # a task-args key of ours, never passed to the generator
FULL_CREDIT = 1.0  # exactly: spell_backward gives 0.9999999999999998 to its gold plus a letter
INSTRUCTION = "Give only the final answer."
EVAL_SEED = 1_000_000_007  # the held-out draw; items are seeded seed + index, far from TRAIN_SEED's
TRAIN_SEED = 0
TRAIN_SIZE = 10_000  # the hub cycles through these in shuffled epochs
EVAL_DRAWS_PER_PROBLEM = 20  # draws tried per held-out problem wanted, when questions repeat

_LEAD_IN = re.compile(r"^(?:the\s+(?:final\s+)?answer\s+is:?|(?:final\s+)?answer\s*:)\s*", re.I)


def _is_number(entry: Mapping[str, Any]) -> bool:
    """The entry's gold answer is a bare number ("42", "-1,234.5"; not "5%", which a generator
    compares as text)."""
    return NUMBER.fullmatch(str(entry.get("answer", "")).strip()) is not None


def extract_answer(completion: str, entry: Mapping[str, Any]) -> str:
    """What of `completion` is scored against `entry`: the content of the last
    <answer>...</answer>; else, when the gold answer is a number, the last number ("5 - 3 = 2"
    gives "2", "1,234." gives "1234"); else the last non-empty line without a leading
    "Answer:" or "The answer is" and a trailing period."""
    tagged = ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if _is_number(entry):
        numbers = NUMBER.findall(completion)
        if numbers:
            return numbers[-1].replace(",", "")
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    if not lines:
        return ""
    return _LEAD_IN.sub("", lines[-1]).strip().removesuffix(".").strip()


def committed_answer(completion: str, entry: Mapping[str, Any]) -> str:
    """What of `completion` the strict scorer hands the generator: the one number of the
    statement it commits to when the gold answer is a number ("84 + 80 = 164" gives "164";
    "164 or 165", "84 + 80" give ""), else that statement without a leading "Answer:" or
    "The answer is" and a trailing period; "" when it commits to several answers."""
    numeric = _is_number(entry)
    said = committed_statement(completion, numeric=numeric, keep_equation=not numeric)
    if said is None:
        return ""
    if numeric:
        return single_number(said.text) or ""
    return _LEAD_IN.sub("", said.text).strip().removesuffix(".").strip()


def task_options(args: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the generator's config keywords, partial_credit) of a task's arguments: `PARTIAL_CREDIT`
    is this module's option, not the generator's; ValueError unless it is true or false."""
    generator_args = dict(args)
    partial = generator_args.pop(PARTIAL_CREDIT, False)
    if not isinstance(partial, bool):
        raise ValueError(f"{PARTIAL_CREDIT!r} must be true (the generator's partial-credit "
                         f"scorer) or false (full credit or nothing, the default), got "
                         f"{partial!r}")
    return generator_args, partial


# `-> Any`: a reasoning-gym dataset (the library is imported only here, when opened).
def open_generator(generator: str, args: Mapping[str, Any], *, seed: int, size: int) -> Any:
    """reasoning-gym's dataset `generator` with config keywords `args` (see the module docstring
    for what it raises)."""
    import reasoning_gym  # optional: pip install reasoning-gym
    from reasoning_gym.factory import DATASETS

    if generator not in DATASETS:
        close = difflib.get_close_matches(generator, list(DATASETS), n=4, cutoff=0.5)
        hint = f"close names: {', '.join(close)}; " if close else ""
        raise LookupError(f"no reasoning-gym generator {generator!r}; {hint}list them with "
                          f"python -c \"import reasoning_gym.factory as f; "
                          f"print(sorted(f.DATASETS))\"")
    try:
        return reasoning_gym.create_dataset(generator, seed=seed, size=size, **args)
    except (TypeError, ValueError, AssertionError) as exc:  # a keyword or value it rejects
        raise ValueError(f"generator {generator!r} rejects {dict(args)}: {exc}") from None


def prompt_of(entry: Mapping[str, Any]) -> str:
    """The prompt of a generated entry: its question, then `INSTRUCTION`."""
    return f"{str(entry['question']).rstrip()}\n{INSTRUCTION}"


class ReasoningTask:
    """A reasoning-gym generator's problems with a held-out split fixed by its own seeds."""

    def __init__(self, generator: str, args: Mapping[str, Any] | None = None, *,
                 eval_size: int = 256, train_size: int = TRAIN_SIZE,
                 partial_credit: bool = False):
        """`generator`: reasoning-gym's name for it (its "dataset"; the kind is
        "rg:<generator>"); `args`: the generator's config keywords; `partial_credit`: score with
        the generator's own scores, partial credit included (default: full credit or nothing)."""
        self.generator, self.args, self.partial_credit = generator, dict(args or {}), partial_credit
        self.kind = KIND_PREFIX + generator
        train = list(open_generator(generator, self.args, seed=TRAIN_SEED, size=train_size))
        distinct = len({e["question"] for e in train})
        wanted = max(1, min(eval_size, distinct // 2))
        held = self._held_out(wanted)
        questions = {e["question"] for e in held}
        self._splits = {
            "eval": tuple(_problem(f"{self.kind}/eval/{i}", e) for i, e in enumerate(held)),
            "train": tuple(_problem(f"{self.kind}/train/{i}", e) for i, e in enumerate(train)
                           if e["question"] not in questions)}
        if not self._splits["train"]:
            raise ValueError(f"generator {generator!r} with {self.args} makes too few distinct "
                             f"questions to hold some out: widen its arguments")

    def _held_out(self, wanted: int) -> list[dict[str, Any]]:
        """The first `wanted` distinct questions of the `EVAL_SEED` draw (fewer when the
        generator repeats itself that much)."""
        held: dict[str, dict[str, Any]] = {}
        for entry in open_generator(self.generator, self.args, seed=EVAL_SEED,
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
        return GeneratorScore(self.generator, self.args, partial_credit=self.partial_credit)

    def reward(self, answer: str, completion: str) -> float:
        raise TypeError("a reasoning-gym task is scored against the whole entry: use scorer()")


class GeneratorScore:
    """`score(problem, completion)`: 1.0 if the generator's `score_answer` gives full credit to
    the answer the completion commits to (`committed_answer`) against the problem's entry
    (`Problem.row`), else 0.0; with `partial_credit`, its score as it is, of what
    `extract_answer` takes. Picklable: the generator is rebuilt, once, where it is unpickled (a
    scoring worker, as it starts). Raises on a score that is not a number in [0, 1] (a scorer
    counts that sample as failed and scores it 0)."""

    def __init__(self, generator: str, args: Mapping[str, Any], *, partial_credit: bool = False):
        self.generator, self.args, self.partial_credit = generator, dict(args), partial_credit
        self._dataset: Any = None

    def __call__(self, problem: Problem, completion: str) -> float:
        if self._dataset is None:
            self._dataset = open_generator(self.generator, self.args, seed=EVAL_SEED, size=1)
        entry = problem.row
        answer = (extract_answer if self.partial_credit else committed_answer)(completion, entry)
        value = float(self._dataset.score_answer(answer, entry))
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"{self.generator}.score_answer returned {value}, not in [0, 1]")
        if self.partial_credit:
            return value
        return 1.0 if value >= FULL_CREDIT else 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {"generator": self.generator, "args": self.args,
                "partial_credit": self.partial_credit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Opens the generator now: in a scoring worker that is while it starts, not within the
        first completion's deadline (importing reasoning-gym takes a second or more)."""
        self.generator, self.args = state["generator"], state["args"]
        self.partial_credit = state["partial_credit"]
        self._dataset = open_generator(self.generator, self.args, seed=EVAL_SEED, size=1)


def _problem(problem_id: str, entry: Mapping[str, Any]) -> Problem:
    return Problem(id=problem_id, prompt=prompt_of(entry), answer=str(entry["answer"]),
                   row=dict(entry))
