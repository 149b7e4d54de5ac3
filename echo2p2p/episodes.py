"""Multi-turn episodes: the environment contract, the token layout, and the hub's replay.

An episode alternates model turns and environment turns until the environment says done. It
starts from the environment's first observation (`reset(seed)`, the prompt the hub leases) and
goes: model turn, `step(action)` -> observation, model turn, ... The peer plays it (every turn
needs the model); the hub replays it, since an environment is deterministic given its seed and
the model's actions.

Token layout of one episode sample, after the prompt: the model's turn 1, the observation's
tokens, the model's turn 2, ..., the model's last turn. `turns` lists the segment lengths in
that order (odd count: model, observation, model, ...); the behaviour logprobs are those of the
model's tokens only, in order. Only those are trained on: observation tokens are inputs, masked
out of the loss. The rules both planes follow:
- a model turn is the ids the engine sampled, through the first EOS (kept) or `max_turn_tokens`
  of them; its action is their decoding without special tokens (`echo2p2p.completions`);
- an observation's tokens are `encode(observation)`, no special tokens added (a chat model's
  environment writes its own turn markup into the text, or, if its observations are user
  turns (`user_turns`: the Gymnasium and verifiers adapters), the run wraps each in the chat
  template's markup, the same (before, after) text on both planes: `in_turn`);
- the episode ends at the first step that says done, or after `max_turns` model turns.

`replay` re-runs the environment on a submitted episode and answers its reward, or why the
episode is not what the environment would have said. Pure: the environment, tokenizer and
decoder come in as arguments; no clock, no I/O.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

MAX_TURNS = 64  # model turns one episode may have (bounds the replay's work per sample)

# Why a replay fails (a Reject's reason; OBSERVATION and REWARD count against the peer's trust).
BAD_TURNS = "bad_turns"  # the segment lengths do not describe the ids and logprobs
OBSERVATION = "observation_mismatch"  # an observation is not what the environment said
TOO_LONG = "episode_too_long"  # turns after the environment said done, or past max_turns
TOO_SHORT = "episode_too_short"  # stopped before the environment said done
ENV_FAILED = "env_failed"  # the environment raised or returned a bad step on these actions
LIES = frozenset({OBSERVATION, TOO_LONG, TOO_SHORT})  # what an honest peer never sends


@dataclass(frozen=True)
class Step:
    """What the environment answers to one model turn."""

    observation: str  # shown to the model before its next turn ('' once done)
    reward: float  # this turn's reward; the episode's is the sum
    done: bool


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: deterministic given the seed and the actions."""

    max_turns: int  # model turns at most (<= MAX_TURNS)

    def reset(self, seed: int) -> str:
        """Start the episode of `seed`; its first observation (the prompt text)."""
        ...

    def step(self, action: str) -> Step:
        """The model's turn (decoded text) -> the environment's answer."""
        ...


def in_turn(encode: Callable[[str], list[int]],
            turn: tuple[str, str]) -> Callable[[str], list[int]]:
    """How an observation becomes ids: `encode`d, wrapped in `turn` (before, after) if any."""
    before, after = turn
    return encode if not (before or after) else lambda text: encode(before + text + after)


@dataclass(frozen=True)
class Replayed:
    """A replay's verdict: the episode's reward, or why it is not the environment's."""

    reward: float
    fault: str = ""  # one of the reasons above; '' when the episode checks out


def pack_turns(lengths: Sequence[int]) -> bytes:
    """Segment lengths as little-endian uint32 (the wire's `Sample.turns`)."""
    return struct.pack(f"<{len(lengths)}I", *lengths)


def unpack_turns(packed: bytes) -> tuple[int, ...] | None:
    """The segment lengths, or None unless they are an odd number of positive uint32s."""
    if not packed or len(packed) % 4:
        return None
    lengths = struct.unpack(f"<{len(packed) // 4}I", packed)
    if len(lengths) % 2 == 0 or len(lengths) > 2 * MAX_TURNS - 1 or min(lengths) < 1:
        return None
    return lengths


def model_mask(lengths: Sequence[int]) -> list[bool]:
    """Per token after the prompt: True for the model's tokens (even segments)."""
    return [i % 2 == 0 for i, n in enumerate(lengths) for _ in range(n)]


def split_turns(ids: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """`ids` cut into the segments `lengths` gives (the caller checked they add up)."""
    out, at = [], 0
    for n in lengths:
        out.append(list(ids[at:at + n]))
        at += n
    return out


def check_layout(lengths: Sequence[int] | None, n_ids: int, n_logprobs: int) -> bool:
    """True when `lengths` describe `n_ids` ids of which `n_logprobs` are the model's."""
    return (lengths is not None and sum(lengths) == n_ids
            and sum(lengths[0::2]) == n_logprobs)


def replay(env: Environment, seed: int, ids: Sequence[int], lengths: Sequence[int],
           *, decode_turn: Callable[[list[int]], str | None],
           encode: Callable[[str], list[int]]) -> Replayed:
    """Re-run `env` from `seed` on the episode's model turns; check each observation and say
    the reward. `decode_turn(ids)`: a model turn's action text, or None if the ids are no turn
    (ids after an EOS); `encode(text)`: an observation's ids."""
    segments = split_turns(ids, lengths)
    env.reset(seed)
    total, turns, limit = 0.0, segments[0::2], min(env.max_turns, MAX_TURNS)
    if len(turns) > limit:
        return Replayed(0.0, TOO_LONG)
    for k, turn in enumerate(turns):
        action = decode_turn(turn)
        if action is None:
            return Replayed(0.0, BAD_TURNS)
        step = env.step(action)
        if not isinstance(step, Step) or not math.isfinite(float(step.reward)):
            return Replayed(0.0, ENV_FAILED)
        total += float(step.reward)
        last = k == len(turns) - 1
        if step.done:
            return Replayed(total, "" if last else TOO_LONG)
        if last:
            return Replayed(total, "" if len(turns) == limit else TOO_SHORT)
        if encode(step.observation) != segments[2 * k + 1]:
            return Replayed(0.0, OBSERVATION)
    return Replayed(total)


@dataclass(frozen=True)
class Played:
    """One episode as a peer played it, laid out for the wire (`messages.Sample`)."""

    ids: list[int]  # every token after the prompt: model turns and observations
    logprobs: list[float]  # the model's tokens' behaviour logprobs, in order
    turns: list[int]  # segment lengths: model, observation, model, ...
    reward: float  # the environment's, summed over the turns
    action: str  # the model's last turn's text (the sample's `text`, a hint)
    stopped: bool  # the last model turn ended with EOS


Turn = tuple[list[int], list[float], str, bool]  # ids, their logprobs, text, stopped at EOS


def play(envs: Sequence[Environment], seeds: Sequence[int], prompt_ids: Sequence[Sequence[int]],
         turns: Callable[[list[list[int]]], list[Turn]],
         *, encode: Callable[[str], list[int]]) -> list[Played]:
    """Play one episode per environment, in lock-step: `turns(contexts)` samples one model turn
    for each live episode's context (its ids through EOS or the per-turn cap, their logprobs,
    its text, whether it stopped at EOS); each environment answers, its observation's ids join
    that context; an episode ends when its environment says done or after `max_turns`."""
    for env, seed in zip(envs, seeds, strict=True):
        env.reset(seed)
    contexts = [list(p) for p in prompt_ids]
    out: list[dict] = [{"ids": [], "logprobs": [], "turns": [], "reward": 0.0, "action": "",
                        "stopped": False} for _ in envs]
    live = list(range(len(envs)))
    for k in range(MAX_TURNS):
        if not live:
            break
        sampled = turns([contexts[i] for i in live])
        for i, (t_ids, t_logprobs, action, stopped) in zip(list(live), sampled, strict=True):
            ep, env = out[i], envs[i]
            ep["turns"].append(len(t_ids))
            ep["ids"] += t_ids
            ep["logprobs"] += t_logprobs
            contexts[i] += t_ids
            step = env.step(action)
            ep["reward"] += float(step.reward)
            ep["action"], ep["stopped"] = action, stopped
            if step.done or k + 1 >= min(env.max_turns, MAX_TURNS):
                live.remove(i)
                continue
            observation = encode(step.observation)
            if not observation:
                raise ValueError(f"the environment answered turn {k + 1} of seed {seeds[i]} "
                                 f"with an empty observation and done=False")
            ep["turns"].append(len(observation))
            ep["ids"] += observation
            contexts[i] += observation
    return [Played(**ep) for ep in out]


# Model turns the determinism check plays: digits, words and nothing, in a fixed order.
PROBES = ("1", "2", "3", "yes", "a", "0", "no", "")


def undetermined(factory: Callable[[], Environment], seeds: Sequence[int],
                 probes: Sequence[str] = PROBES) -> str:
    """'' when `factory`'s environments answer alike, twice over, to the same turns from the
    same seeds; else a sentence saying where they did not (the hub refuses such an environment:
    its replay would reject honest peers). An exception is an answer too (the same one twice is
    deterministic). Each seed is played with the probes in order and with each probe repeated."""
    scripts = [list(probes)] + [[p] * len(probes) for p in probes[:3]]
    for seed in seeds:
        for script in scripts:
            first, again = _trace(factory(), seed, script), _trace(factory(), seed, script)
            if first != again:
                at = next(k for k, (a, b) in enumerate(zip(first, again)) if a != b)
                return (f"it is not deterministic given its seed: seed {seed}, played twice "
                        f"with the same turns {script[:at]!r}, answered {first[at]!r} and then "
                        f"{again[at]!r}; the hub's replay would reject honest peers. Draw its "
                        f"randomness from the seed (random.Random(seed), or Gymnasium's "
                        f"self.np_random after reset(seed=seed))")
    return ""


def _trace(env: Environment, seed: int, script: Sequence[str]) -> list[object]:
    """What `env` answers from `seed` to the turns of `script` (until done or an exception)."""
    out: list[object] = []
    try:
        out.append(env.reset(seed))
        for action in script[:min(env.max_turns, MAX_TURNS)]:
            step = env.step(action)
            out.append((step.observation, step.reward, step.done))
            if step.done:
                break
    except Exception as exc:  # the environment's own failure: part of what it answered
        out.append(f"raised {type(exc).__name__}")
    return out
