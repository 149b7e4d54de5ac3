"""A multi-turn environment as a task: one problem per episode seed, split by seed.

Each problem is one seed: its prompt is the environment's first observation (`reset(seed)`),
its answer the seed in decimal (what a peer needs to play the episode, and the hub to replay
it). Held-out seeds are 0 .. eval_size - 1 and training seeds follow them, whatever the run's
seed (which orders the prompts, not the split), so the two never overlap. Episodes are scored
by replay (`echo2p2p.scoring.rewards.EpisodeReplay`), not by `reward`.

An environment that opens on a conversation (a verifiers one: `opening(seed)`, its row's
messages) gives it as the problem's messages, which the chat template renders; its prompt text
is then the messages' contents, one per line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from echo2p2p.tasks.base import Problem, check_split
from echo2p2p.tasks.records import conversation_text

KIND_PREFIX = "env:"  # a task kind "env:<name>": episodes of environment <name>


class EnvironmentTask:
    """`train_size` training seeds and `eval_size` held-out ones of an environment."""

    def __init__(self, name: str, version: str, factory: Callable[[], Any], *,
                 train_size: int = 10_000, eval_size: int = 256):
        if train_size < 1 or eval_size < 0:
            raise ValueError(f"need train_size >= 1 and eval_size >= 0, got {train_size}, "
                             f"{eval_size}")
        self.name, self.version, self.factory = name, version, factory
        self.kind = KIND_PREFIX + name

        def problem(seed: int) -> Problem:
            env = factory()
            if not hasattr(env, "opening"):
                return Problem(id=f"{name}-{seed}", prompt=env.reset(seed), answer=str(seed),
                               row={"seed": seed})
            messages = env.opening(seed)
            return Problem(id=f"{name}-{seed}", answer=str(seed), row={"seed": seed,
                           "prompt": messages}, prompt=conversation_text(messages))

        self._splits = {"eval": tuple(problem(s) for s in range(eval_size)),
                        "train": tuple(problem(s) for s in range(eval_size, eval_size + train_size))}

    def problems(self, split: str) -> Sequence[Problem]:
        return self._splits[check_split(split)]

    def reward(self, answer: str, completion: str) -> float:
        raise TypeError(f"{self.kind} episodes are scored by replaying the environment")
