"""Scoring: what text a completion stands for, and reward functions run where they can be killed.

`text` holds the one rule the engines and the hub share, token ids to the scored text
(`CompletionDecoder`). `scorer` runs a task's reward function in worker
processes (`worker`), each completion under a deadline, for the hub's admission, the peers'
claimed rewards and evaluation. Not part of the sans-IO core: it starts processes and threads;
it imports neither torch nor any network library.
"""

from .scorer import DEFAULT_TIMEOUT_S, Scored, Scorer, ScorerStats
from .text import CompletionDecoder, DecodedCompletion

__all__ = ["DEFAULT_TIMEOUT_S", "CompletionDecoder", "DecodedCompletion", "Scored", "Scorer",
           "ScorerStats"]
