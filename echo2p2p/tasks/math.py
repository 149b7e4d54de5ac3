"""Math word problems from JSONL rows {"question": ..., "answer": ...}, scored by final answer.

The task never opens files: the caller hands it lines (an open file is an iterable of lines).
Rows are shuffled with `split_seed` and the first `eval_size` are held out; the split belongs to
the task, never to a run (a run's seed orders the prompts, the held-out set stays put). A
GSM8K-style answer ("reasoning ... #### 72") keeps only the part after the last "####".

Reward: the final answer the completion commits to (`echo2p2p.tasks.final_answer`: its
answer tags, its box, else its final line, right of its last "="), never a hedge or an echo of
the question. Against a numeric gold ("72", "1,000") that statement must hold exactly one
number, equal to the gold ("84 + 80 = 84 + 80" scores 0 against 164, which math-verify alone
would credit: it evaluates the echoed sum); math-verify is not called. Against an expression
gold ("\\frac{1}{2}") the statement may hold no more numbers than the gold, then `math_verify`
judges it when installed (gold first, parsed as boxed LaTeX, as is a boxed statement; both
timeouts off, because its signal-based timeout breaks outside the main thread and peers score
in worker threads), else a normalised exact match of the last number-like token (or of the
whole text when neither side has one). math-verify warns, once per process, that its timeouts
are off; every scoring worker and peer is a process of its own, so that one record of its two
loggers is dropped (`_quiet_timeouts`).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from typing import Any

from .answers import last_boxed
from .base import Problem, check_split
from .final_answer import (ANSWER_TAG, Statement, committed_statement, number_count,
                           plain_number, same_number, single_number)

KIND = "math"
SPLIT_SEED = 0  # the default split; a run's seed orders prompts, it never moves this
PROMPT_TEMPLATE = "{question}\nPut the final answer in \\boxed{{}}.\n"

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")

try:  # optional dependency: pip install echo2p2p[math]
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify
    from math_verify.grader import logger as _mv_grader_log
    from math_verify.parser import logger as _mv_parser_log
except ImportError:  # pragma: no cover - depends on the environment
    _mv_parse = _mv_verify = _mv_grader_log = _mv_parser_log = None


# `record`: a logging.LogRecord (the core does not import logging).
def _not_the_timeout_notice(record: Any) -> bool:
    """False for math-verify's "Timeout is disabled as ... is None" warning (off on purpose)."""
    return not str(record.msg).startswith("Timeout is disabled")


def _quiet_timeouts() -> None:
    """Drop that one warning of math-verify's parser and grader loggers, nothing else."""
    for logger in (_mv_parser_log, _mv_grader_log):
        if logger is not None and _not_the_timeout_notice not in logger.filters:
            logger.addFilter(_not_the_timeout_notice)


_quiet_timeouts()


def _answer_part(text: str) -> str:
    tagged = ANSWER_TAG.findall(text)
    return tagged[-1] if tagged else text


def normalize_answer(text: str) -> str:
    """The comparable core of an answer: boxed content, last number, no $ or commas or ".0"."""
    text = _answer_part(text)
    boxed = last_boxed(text)
    text = (boxed if boxed is not None else text).replace("$", "").replace(",", "").strip()
    numbers = _NUMBER.findall(text)
    if numbers:
        text = numbers[-1]
        if "." in text and "/" not in text:
            text = text.rstrip("0").rstrip(".")
        if text in ("-0", ""):
            text = "0"
    return text


def math_reward(answer: str, completion: str) -> float:
    """1.0 if the final answer the completion commits to equals `answer`, else 0.0 (the rules
    are the module docstring's)."""
    gold = plain_number(answer)
    said = committed_statement(completion, numeric=gold is not None, keep_equation="=" in answer)
    if said is None:
        return 0.0
    if gold is not None:
        return 1.0 if same_number(single_number(said.text), gold) else 0.0
    if number_count(said.text) > number_count(answer):  # an unevaluated expression
        return 0.0
    if _mv_verify is not None:
        gold_parsed = _mv_parse(_boxed(answer), parsing_timeout=None)
        return 1.0 if _mv_verify(gold_parsed, _parsed(said), timeout_seconds=None) else 0.0
    return 1.0 if normalize_answer(answer) == normalize_answer(said.text) else 0.0


def _boxed(text: str) -> str:
    """`text` as math-verify reads a boxed answer: a bare "\\sqrt{2}" or "2\\sqrt{3}" parses
    to nothing, or to 2, outside a box."""
    return f"\\boxed{{{text}}}"


def _parsed(said: Statement) -> list:
    """math-verify's reading of a statement: boxed content as LaTeX; a final line as prose
    (math-verify finds "$...$" in it), else as LaTeX."""
    if said.boxed:
        return _mv_parse(_boxed(said.text), parsing_timeout=None)
    return (_mv_parse(said.text, parsing_timeout=None)
            or _mv_parse(_boxed(said.text), parsing_timeout=None))


def json_object(line: str, lineno: int) -> dict:
    """One JSONL line as an object; ValueError naming the line if it is not one."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"line {lineno}: expected a JSON object, got {type(row).__name__}")
    return row


def _row(line: str, lineno: int) -> tuple[str, str, str | None]:
    row = json_object(line, lineno)
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"line {lineno}: missing or empty string field 'question'")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"line {lineno}: missing field 'answer' (a string or a number)")
    answer = str(answer).rsplit("####", 1)[-1].strip()
    if not answer:
        raise ValueError(f"line {lineno}: empty 'answer'")
    row_id = row.get("id")
    return question, answer, None if row_id is None else str(row_id)


class MathTask:
    """Question/answer pairs with a fixed held-out split (see `split_seed`)."""

    kind = KIND

    def __init__(self, problems: Sequence[Problem], *, eval_size: int = 200,
                 split_seed: int = SPLIT_SEED, held_out: Sequence[Problem] | None = None):
        """`held_out`: the eval split as given (a dataset's own test split); else the first
        `eval_size` of `problems`, shuffled with `split_seed`, are held out (at most half)."""
        ids = [p.id for p in [*problems, *(held_out or ())]]
        if len(set(ids)) != len(ids):
            raise ValueError("problem ids must be unique")
        order = list(problems)
        random.Random(f"math/{split_seed}").shuffle(order)
        if held_out is not None:
            self._splits = {"eval": tuple(held_out), "train": tuple(order)}
            return
        held = min(eval_size, len(order) // 2)  # never leave train with fewer than eval
        self._splits = {"eval": tuple(order[:held]), "train": tuple(order[held:])}

    @classmethod
    def from_lines(cls, lines: Iterable[str], *, eval_size: int = 200,
                   split_seed: int = SPLIT_SEED, template: str = PROMPT_TEMPLATE) -> MathTask:
        """Parse JSONL `lines` (blank ones skipped); a bad row raises ValueError naming its line."""
        problems = []
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            question, answer, row_id = _row(line, lineno)
            problems.append(Problem(id=row_id or f"math-{lineno}",
                                    prompt=template.format(question=question.strip()),
                                    answer=answer))
        if not problems:
            raise ValueError("no problems: every line was blank")
        return cls(problems, eval_size=eval_size, split_seed=split_seed)

    def problems(self, split: str) -> Sequence[Problem]:
        """The problems of `split`; the same tuple on every call."""
        return self._splits[check_split(split)]

    def reward(self, answer: str, completion: str) -> float:
        return math_reward(answer, completion)
