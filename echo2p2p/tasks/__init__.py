"""Tasks: problem sets with held-out splits, and reward functions chosen by kind.

Pure Python (no torch, no files, no clock): the hub builds a task from data it read itself, and a
peer, which knows only the task's `kind`, scores its own completions with `reward_fn(kind)`.
"""

from __future__ import annotations

from collections.abc import Callable

from .addition import KIND as ADDITION
from .addition import PARTIAL_KIND as ADDITION_PARTIAL
from .addition import AdditionTask, addition_partial_reward, addition_reward
from .answers import ANSWER_FORMATS, extract_answer, problems_from_records
from .base import SPLITS, Problem, Task
from .records import RecordsTask
from .math import KIND as MATH
from .math import MathTask, math_reward, normalize_answer
from .takeaway import TakeAway

REWARDS: dict[str, Callable[[str, str], float]] = {
    ADDITION: addition_reward,
    ADDITION_PARTIAL: addition_partial_reward,
    MATH: math_reward,
}


def reward_fn(kind: str) -> Callable[[str, str], float]:
    """The reward function of task `kind`; ValueError naming it if unknown."""
    try:
        return REWARDS[kind]
    except KeyError:
        raise ValueError(f"unknown task kind {kind!r}; known kinds: {', '.join(REWARDS)}") from None


__all__ = ["ANSWER_FORMATS", "SPLITS", "AdditionTask", "MathTask",
           "RecordsTask", "Problem", "REWARDS", "TakeAway", "Task",
           "addition_partial_reward", "addition_reward", "extract_answer", "math_reward",
           "normalize_answer", "problems_from_records", "reward_fn"]
