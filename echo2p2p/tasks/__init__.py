"""Tasks: problem sets with held-out splits, and reward functions chosen by kind.

Pure Python (no torch, no files, no clock): the hub builds a task from data it read itself, and a
peer, which knows only the task's `kind`, scores its own completions with `reward_fn(kind)`.

"Task" means one thing here; its neighbours have names of their own, used so throughout:
- a **task** is a problem set (`base.Task`: problems by split, and a kind); `task` holds one;
- its **kind** is the string naming how it is scored ("addition", "math", "custom",
  "rg:<generator>", "env:<environment>"), the one part of a task a peer learns: `Task.kind`,
  `TaskSetup.kind`, and `Welcome.task_kind` (the wire's field is `welcome.task`);
- a **setup** (`echo2p2p.hub.tasks.task_setup.TaskSetup`) is the run's task with its reward,
  kind and environment version: what the hub scores with; `setup` holds one;
- a **generator** is reasoning-gym's name for one of its problem makers (its "dataset"):
  `ReasoningTask.generator`, the `<generator>` of "rg:<generator>";
- the **task spec** is what `--task` says (a path, "addition", "rg:<generator>"): `spec`.
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
