"""A task of users' own rows: each row's "prompt" as it is, the whole row for their rewards.

A "prompt" is text, or a conversation (TRL's conversational format, a list of {"role",
"content"} messages), which the run's chat template renders (`echo2p2p.policy.prompts`).

The rows are plain mappings (a list of dicts, a JSONL file's objects, a `datasets.Dataset`'s
rows); the task keeps each as `Problem.row`, which users' reward functions receive
(`echo2p2p.scoring.rewards.RewardFunctions`). The answer is the row's "answer" as text when it
has one ('' otherwise: a reward that runs tests, say, needs none). Ids are the row's "id", else
"row-<index>". The split is seeded by the task, never by the run: the first `eval_size` rows of
a fixed shuffle are held out (at most half), so the held-out set is the same whatever the run's
seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .base import Problem, check_split
from .math import json_object

KIND = "custom"  # peers cannot score it: only the hub runs users' reward functions
SPLIT_SEED = "records/split"


def problem_of(index: int, row: Mapping[str, Any]) -> Problem:
    """Row `index` as a problem; ValueError naming the row if its "prompt" is neither text nor
    a conversation (TRL's conversational format: {"role", "content"} messages)."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        row = {**row, "prompt": conversation(index, prompt)}
        prompt = conversation_text(row["prompt"])
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"row {index}: needs a 'prompt': non-empty text, or a list of "
                         f"{{'role': ..., 'content': ...}} messages")
    answer = row.get("answer", "")
    row_id = row.get("id")
    return Problem(id=f"row-{index}" if row_id is None else str(row_id), prompt=prompt,
                   answer="" if answer is None else str(answer), row=dict(row))


def conversation(index: int, messages: list) -> list[dict[str, str]]:
    """Row `index`'s conversational prompt, each message {"role": str, "content": str} (other
    keys dropped); ValueError naming the row otherwise."""
    if not messages or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"row {index}: a conversational 'prompt' is a non-empty list of "
                         f"{{'role': str, 'content': str}} messages")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def conversation_text(messages: list[dict[str, str]]) -> str:
    """A conversation as plain text: its messages' contents, one after another."""
    return "\n".join(m["content"] for m in messages)


class RecordsTask:
    """Users' rows with a fixed held-out split; `held_out`: rows to hold out instead (a
    dataset's own evaluation split: then every row of `rows` is trained on)."""

    kind = KIND

    def __init__(self, rows: Iterable[Mapping[str, Any]], *, eval_size: int = 256,
                 held_out: Iterable[Mapping[str, Any]] | None = None):
        problems = [problem_of(i, row) for i, row in enumerate(rows)]
        if held_out is not None:
            start = len(problems)
            held = [problem_of(start + i, row) for i, row in enumerate(held_out)]
            problems += held[:eval_size]
        if len(problems) < 2:
            raise ValueError(f"need at least 2 rows (some to train on, some held out), got "
                             f"{len(problems)}")
        if len({p.id for p in problems}) != len(problems):
            raise ValueError("row ids must be unique")
        if held_out is not None:
            self._splits = {"eval": tuple(problems[start:]), "train": tuple(problems[:start])}
            return
        random.Random(SPLIT_SEED).shuffle(problems)
        held = min(eval_size, len(problems) // 2)
        self._splits = {"eval": tuple(problems[:held]), "train": tuple(problems[held:])}

    @classmethod
    def from_lines(cls, lines: Iterable[str], *, eval_size: int = 256) -> RecordsTask:
        """JSONL lines (blank ones skipped); ValueError naming a bad line."""
        rows = [json_object(line, lineno) for lineno, line in enumerate(lines, start=1)
                if line.strip()]
        return cls(rows, eval_size=eval_size)

    def problems(self, split: str) -> Sequence[Problem]:
        return self._splits[check_split(split)]

    def reward(self, answer: str, completion: str) -> float:
        raise TypeError("a custom task is scored by its reward functions")
