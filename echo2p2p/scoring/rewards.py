"""What a hub's scorer calls: the task's own reward, users' reward functions, episode replay.

A scorer (`echo2p2p.scoring.scorer`) runs `reward(problem, text)` in its worker processes, off
the event loop and under a deadline; the hub hands it `Problem`s (`echo2p2p.tasks.Problem`).
- `ByAnswer(task.reward)`: a built-in task's `reward(answer, completion)`.
- `RewardFunctions(funcs, weights)`: users' functions `f(prompt, completion, row) -> float`,
  or TRL's `f(prompts, completions, completion_ids, **columns) -> list` as they are
  (`echo2p2p.adapters.trl_rewards`), sync or async, summed with weights (TRL's `reward_funcs` /
  `reward_weights`); a TRL function's None leaves it out of the sum (TRL's nansum). A function
  that raises or returns no finite number, or a sample every function returned None for, scores
  0; the scorer counts and logs why.
- `EpisodeReplay(factory)`: a multi-turn environment; `replay` re-runs it on an episode's model
  turns (`echo2p2p.episodes.replay`).
Everything here is pickled once per worker start: functions by reference (a module-level
function, or one defined at the top of a script run as `__main__`), never by value.

Built-in reward functions, by name (`load_reward`): "exact_match" (the completion, stripped,
equals the row's "answer"), "math_verify" (math-verify's equivalence, as the math task) and
"code_tests" (the completion's program against the row's tests in a sandboxed subprocess,
`echo2p2p.scoring.code`). Any other name is "module:function", imported where it is loaded.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from echo2p2p import episodes
from echo2p2p.adapters.trl_rewards import TrlReward, is_trl_reward
from echo2p2p.completions import CompletionDecoder
from echo2p2p.tasks import Problem, math_reward
from echo2p2p.tasks.reasoning import GeneratorScore


def exact_match(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """1.0 if the completion, stripped, is the row's "answer" (stripped), else 0.0."""
    return 1.0 if completion.strip() == str(row.get("answer", "")).strip() else 0.0


def math_verify(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    """The math task's reward against the row's "answer" (math-verify when installed)."""
    return math_reward(str(row.get("answer", "")), completion)


def _code_tests(prompt: str, completion: str, row: Mapping[str, Any]) -> float:
    from .code import code_tests

    return code_tests(prompt, completion, row)


BUILTIN: dict[str, Callable[[str, str, Mapping[str, Any]], Any]] = {
    "exact_match": exact_match, "math_verify": math_verify, "code_tests": _code_tests}


def load_reward(spec: str) -> Callable[..., Any]:
    """A built-in reward function's name, or "module:function"; ValueError naming the fix."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"reward {spec!r}: not a built-in ({', '.join(BUILTIN)}) and not "
                         f"'module:function'")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward {spec!r}: cannot import it ({exc}); is its module on "
                         f"PYTHONPATH?") from None
    if not callable(found):
        raise ValueError(f"reward {spec!r} is not a function")
    return found


class ByAnswer:
    """A built-in task's `reward(answer, completion)` as the hub calls it."""

    def __init__(self, reward: Callable[[str, str], float]):
        self.reward = reward

    def __call__(self, problem: Problem, text: str) -> float:
        return self.reward(problem.answer, text)


class RewardFunctions:
    """`sum(w * f(prompt, completion, row))` over users' reward functions (TRL's wrapped in
    `TrlReward`, handed the completion's ids too)."""

    takes_ids = True  # the scoring worker hands `__call__` the ids it decoded

    def __init__(self, funcs: Sequence[Callable[..., Any]], weights: Sequence[float] | None = None):
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        if not funcs or len(weights) != len(funcs):
            raise ValueError(f"{len(funcs)} reward functions and {len(weights)} weights: give "
                             f"one weight per function")
        if not all(math.isfinite(w) for w in weights) or not any(weights):
            raise ValueError(f"reward weights must be finite and not all 0, got {weights}")
        funcs = [TrlReward(f) if is_trl_reward(f) else f for f in funcs]
        for f in funcs:
            if not isinstance(f, TrlReward) and len(inspect.signature(f).parameters) < 3:
                raise ValueError(f"reward function {_name(f)} must take (prompt, completion, "
                                 f"row), or TRL's (prompts, completions, **kwargs)")
        self.funcs, self.weights = funcs, weights
        self._loop: asyncio.AbstractEventLoop | None = None  # a worker's, for async functions

    def __call__(self, problem: Problem, text: str, ids: Sequence[int] | None = None) -> float:
        total, row, applied = 0.0, problem.row or {"answer": problem.answer}, False
        for f, w in zip(self.funcs, self.weights):
            if isinstance(f, TrlReward):
                value = f(problem.prompt, text, row, ids)
                if value is None:  # it does not apply to this sample
                    continue
            else:
                value = f(problem.prompt, text, row)
            if inspect.isawaitable(value):
                self._loop = self._loop or asyncio.new_event_loop()
                value = self._loop.run_until_complete(value)
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{_name(f)} returned {value}")
            total, applied = total + w * value, True
        if not applied:
            raise ValueError("every reward function returned None for this completion")
        return total

    def __getstate__(self) -> dict[str, Any]:
        return {"funcs": self.funcs, "weights": self.weights}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.funcs, self.weights, self._loop = state["funcs"], state["weights"], None


class EpisodeReplay:
    """A multi-turn environment's episodes, scored by replay: `factory()` makes a fresh
    environment; the problem's answer is the episode's seed. `turn`: the (before, after) text
    that wraps each observation (`PromptFormat.observation_turn`: a chat template's user turn,
    for an environment whose observations are user turns; the welcome gives peers the same)."""

    def __init__(self, factory: Callable[[], episodes.Environment],
                 turn: tuple[str, str] = ("", "")):
        self.factory, self.turn = factory, turn

    def replay(self, problem: Problem, packed_ids: bytes, packed_turns: bytes,
               decoder: CompletionDecoder) -> episodes.Replayed:
        lengths = episodes.unpack_turns(packed_turns)
        ids = decoder.ids_from_wire(packed_ids)
        if lengths is None or ids is None or sum(lengths) != len(ids):
            return episodes.Replayed(0.0, episodes.BAD_TURNS)
        return episodes.replay(self.factory(), problem.episode_seed, ids, lengths,
                               decode_turn=decoder.turn_text,
                               encode=episodes.in_turn(decoder.encode, self.turn))

    def __call__(self, problem: Problem, text: str) -> float:
        raise TypeError("an environment's episodes are scored by replay, not as texts")


def _name(f: Callable[..., Any]) -> str:
    return getattr(f, "__qualname__", repr(f))


# What a hub's scorers call for a run (`TaskSetup.reward`): a built-in task's reward, users'
# functions, a reasoning-gym generator's own score, or an environment's replay.
HubReward = ByAnswer | RewardFunctions | GeneratorScore | EpisodeReplay
Reward = HubReward | Callable[[str, str], float]  # a scorer's: the hub's, or a task's (a peer's)
Key = Problem | str  # what an item is scored against: the hub's Problem, or an answer (a peer's)
