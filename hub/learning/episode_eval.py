"""Held-out evaluation of a multi-turn environment: the learner's greedy play, episode by episode.

The held-out seeds' episodes are played in lock-step (`echo2p2p.episodes.play`), each turn one
batched greedy `generate` over the live episodes' contexts (left-padded), cut by the completion
rule as a peer's engine cuts a turn; the score is the mean episode reward. On the learner of
one rank only (a sharded learner's evaluation of episodes is not built: `HubRun` refuses it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from echo2p2p import episodes
from echo2p2p.completions import CompletionDecoder

from .batches import left_padded
from .learner import Learner, encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from echo2p2p.policy.prompts import PromptFormat
    from echo2p2p.tasks import Problem


def greedy_turns(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 decoder: CompletionDecoder, max_new_tokens: int
                 ) -> Callable[[list[list[int]]], list[episodes.Turn]]:
    """`turns(contexts)` for `episodes.play`: one greedy model turn per context, cut by
    `decoder` (the tokenizer's completion rule)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    device = next(model.parameters()).device

    def turns(contexts: list[list[int]]) -> list[episodes.Turn]:
        ids, attention = left_padded(contexts, pad)  # (B, P)
        width = ids.shape[1]
        out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad,
                             eos_token_id=eos)  # (B, P + N)
        done = [decoder.completion(row) for row in out[:, width:].tolist()]
        return [(d.token_ids, [0.0] * len(d.token_ids), d.text, d.stopped) for d in done]

    return turns


@torch.no_grad()
def evaluate_episodes(learner: Learner, tokenizer: PreTrainedTokenizerBase,
                      problems: Sequence[Problem], factory: Callable[[], episodes.Environment],
                      *, max_new_tokens: int, prompts: PromptFormat, batch_size: int = 64,
                      turn: tuple[str, str] = ("", "")) -> float:
    """Mean reward of the learner's greedy episodes on `problems` (seeds in their answers);
    `turn` wraps each observation, as on the peers (`episodes.in_turn`)."""
    if not problems:
        return 0.0
    model = learner.model
    decoder = CompletionDecoder(tokenizer)
    turns = greedy_turns(model, tokenizer, decoder, max_new_tokens)
    total = 0.0
    model.eval()
    try:
        for start in range(0, len(problems), batch_size):
            batch = problems[start:start + batch_size]
            played = episodes.play([factory() for _ in batch], [p.episode_seed for p in batch],
                                   [encode_prompt(tokenizer, p.prompt, prompts) for p in batch],
                                   turns, encode=episodes.in_turn(decoder.encode, turn))
            total += sum(p.reward for p in played)
    finally:
        model.train()
    return total / len(problems)
