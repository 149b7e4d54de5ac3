"""The task contract: a problem set with held-out splits and a reward function.

A task is pure data plus a pure scoring function. The hub holds the task and leases its problems;
a peer only ever learns the task's `kind` and picks the reward function by that name
(`echo2p2p.tasks.reward_fn`), so a reward must depend on nothing but (answer, completion).

Invariants every task keeps:
- `problems(split)` is deterministic given the task's seed, and "eval" is disjoint from "train";
- `reward(answer, completion)` lies in [0, 1] and never raises on any completion text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer; `id` is unique within the task. `row`: the
    dataset row it came from (what a user's reward function reads besides the texts)."""

    id: str
    prompt: str
    answer: str
    row: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def messages(self) -> list[dict[str, str]] | None:
        """The conversation a conversational row's "prompt" is (TRL's format: a list of
        {"role", "content"} messages), else None; `prompt` is then its messages' text."""
        prompt = self.row.get("prompt") if self.row else None
        return prompt if isinstance(prompt, list) else None

    @property
    def episode_seed(self) -> int:
        """An environment's problem is one episode seed, kept in `answer` in decimal (what a
        lease hands a peer: `LeaseGrant.episode_seed`); ValueError on any other problem."""
        return int(self.answer)


@runtime_checkable
class Task(Protocol):
    """What the hub needs from a task."""

    kind: str  # "addition", "math", "rg:<generator>", ...: sent to peers, selects the reward

    def problems(self, split: str) -> Sequence[Problem]:
        """The problems of `split` ("train" or "eval"), in a fixed order."""
        ...

    def reward(self, answer: str, completion: str) -> float:
        """Score of `completion` (the generated text after the prompt) against `answer`."""
        ...


def check_split(split: str) -> str:
    """`split` itself, or ValueError naming the valid splits."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return split
