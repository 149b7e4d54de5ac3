"""Reward functions written for TRL's GRPOTrainer, scored as the hub scores its own.

TRL calls a reward function on a batch, by keyword: `f(prompts=[...], completions=[...],
completion_ids=[...], **columns)`, where `columns` are the dataset's columns but "prompt" (and
"completion", "completion_ids"), each a list over the batch, plus `trainer_state`, `log_extra`
and `log_metric`; it returns one float per completion, or None where the function does not
apply (the example is skipped: TRL sums the others with nansum). It may be async. In TRL's
standard format the prompt and the completion are text; in its conversational one the prompt
is a list of {"role", "content"} messages and the completion `[{"role": "assistant",
"content": text}]`.

`TrlReward(f)` calls such an `f` on a batch of one, in the scoring worker under the hub's
deadline like any reward (`echo2p2p.scoring.rewards.RewardFunctions`): the prompt's format is
the row's "prompt" (a list of messages: conversational), the completion is the text the hub
decoded from the peer's ids, and `completion_ids` are those ids. None comes back as None. What
the worker cannot give is the trainer's: `trainer_state` is None, and `log_extra` and
`log_metric` drop what they are handed. `is_trl_reward(f)` tells the two contracts apart by
the parameters' names: TRL's functions name `completions` (plural), ours take three positional
parameters (prompt, completion, row).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

TRL_NAMES = ("prompts", "completions", "completion_ids")  # what only TRL's functions name
OWN_COLUMNS = ("prompt", "completion", "completion_ids")  # columns TRL passes otherwise


def is_trl_reward(f: Callable[..., Any]) -> bool:
    """Whether `f` has TRL's reward signature (a parameter named prompts, completions or
    completion_ids) rather than ours, (prompt, completion, row)."""
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):  # a builtin without a signature: not TRL's
        return False
    return any(name in params for name in TRL_NAMES)


# What TRL passes its log callbacks: open.
def _drop(*_args: Any, **_kwargs: Any) -> None:
    """`log_extra` and `log_metric` in a scoring worker: nothing is logged."""


class TrlReward:
    """A TRL reward function as one of the hub's: `self(prompt, completion, row, ids)` is its
    value for one completion, a float or None (it does not apply)."""

    def __init__(self, f: Callable[..., Any]):
        params = inspect.signature(f).parameters
        self.f = f
        self.__qualname__ = getattr(f, "__qualname__", repr(f))  # what the scorer's messages say
        self._any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self._names = frozenset(params)
        self._loop: asyncio.AbstractEventLoop | None = None  # a worker's, for async functions

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any],
                 ids: Sequence[int] | None = None) -> float | None:
        messages = row.get("prompt")
        if isinstance(messages, list):  # conversational
            prompts, completions = [messages], [[{"role": "assistant", "content": completion}]]
        else:
            prompts, completions = [prompt], [completion]
        kwargs = {name: [value] for name, value in row.items() if name not in OWN_COLUMNS}
        kwargs.update(prompts=prompts, completions=completions,
                      completion_ids=[list(ids) if ids is not None else None],
                      trainer_state=None, log_extra=_drop, log_metric=_drop)
        if not self._any_keyword:  # TRL passes everything; a function naming some takes those
            kwargs = {k: v for k, v in kwargs.items() if k in self._names}
        out = self.f(**kwargs)
        if inspect.isawaitable(out):
            self._loop = self._loop or asyncio.new_event_loop()
            out = self._loop.run_until_complete(out)
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) or len(out) != 1:
            raise ValueError(f"{self.__qualname__} returned {out!r} for one completion; a TRL "
                             f"reward function returns a list with one reward per completion")
        return None if out[0] is None else float(out[0])

    def __getstate__(self) -> dict[str, Any]:
        return {"f": self.f}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["f"])
