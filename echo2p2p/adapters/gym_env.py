"""Gymnasium text environments as episodes: `--env gym:mod:Class`, or a registered `gym:Id-v0`.

A Gymnasium text environment answers `reset(seed=seed) -> (observation, info)` and
`step(action) -> (observation, reward, terminated, truncated, info)`, its observations and
actions text (SkyRL-gym's and grail's shape). `GymText` gives it our contract
(`echo2p2p.episodes.Environment`) unchanged:
- `reset(seed)` is `env.reset(seed=seed)`'s observation; `step(action)` hands the model's turn
  (its decoded text) to `env.step`, and the episode ends at terminated or truncated;
- its `max_turns`: the registered TimeLimit (`spec.max_episode_steps`), else the environment's
  `max_turns` attribute, else `episodes.MAX_TURNS`;
- an observation that is not text is refused with a sentence: the model reads text; under a
  chat template each observation is a user turn (`user_turns`, `PromptFormat.observation_turn`).

`gym:mod:Class` imports `mod` and calls `Class()` (a class or any factory) once per episode;
`gym:Id-v0` is `gymnasium.make("Id-v0")`. The version peers must match is the module's
distribution version (`environments.module_version`) and Gymnasium's.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import gymnasium

from echo2p2p.episodes import MAX_TURNS, Step

PREFIX = "gym:"
LIBRARY, VERSION = "gymnasium", gymnasium.__version__


class GymText:
    """A Gymnasium text environment seen through `echo2p2p.episodes.Environment`."""

    user_turns = True  # under a chat template, each observation is a user turn

    def __init__(self, env: gymnasium.Env):
        self.env = env
        spec = getattr(env, "spec", None)
        limit = getattr(spec, "max_episode_steps", None) or getattr(env, "max_turns", MAX_TURNS)
        self.max_turns = min(int(limit), MAX_TURNS)

    def reset(self, seed: int) -> str:
        observation, _info = self.env.reset(seed=seed)
        return _text(observation, f"reset(seed={seed})")

    def step(self, action: str) -> Step:
        observation, reward, terminated, truncated, _info = self.env.step(action)
        done = bool(terminated or truncated)
        return Step("" if done else _text(observation, "step()"), float(reward), done)


def _text(observation: object, where: str) -> str:
    if not isinstance(observation, str):
        shown = repr(observation)[:60]
        raise TypeError(f"a Gymnasium environment run here must observe text, but its {where} "
                        f"returned {shown} ({type(observation).__name__}): wrap it so that "
                        f"observations are strings (a gymnasium.ObservationWrapper)")
    return observation


@dataclass(frozen=True)
class Episodes:
    """Fresh episodes of `gym:module:attr` (attr: a class or factory) or of a registered id
    (`module` empty); it pickles as its names, for the hub's scoring workers."""

    module: str
    attr: str

    def __call__(self) -> GymText:
        if not self.module:
            return GymText(gymnasium.make(self.attr))
        return GymText(getattr(importlib.import_module(self.module), self.attr)())


@dataclass(frozen=True)
class Loaded:
    module: str  # where the environment's code lives (its version is the distribution's)
    factory: Episodes
    seeds: None = None  # any seed: no rows of its own


def load(name: str) -> Loaded:
    """`gym:mod:Class` or `gym:Id-v0`; LookupError, in one sentence, when the module, class or
    id is not there."""
    target = name.removeprefix(PREFIX)
    module, _, attr = target.rpartition(":")
    try:
        if module:
            getattr(importlib.import_module(module), attr)
            source = module
        else:
            entry = gymnasium.spec(attr).entry_point
            source = entry.split(":")[0] if isinstance(entry, str) else entry.__module__
    except (ImportError, AttributeError, gymnasium.error.Error) as exc:
        raise LookupError(f"environment {name!r} is not here ({exc}): give gym:MODULE:CLASS of "
                          f"an importable module, or a registered Gymnasium id") from None
    return Loaded(source, Episodes(module, attr))
