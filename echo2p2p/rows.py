"""Rollout samples as the learning plane holds them: parsed and validated once, at admission.

A peer sends each completion packed (`messages.Sample`: little-endian uint32 ids, float32
behaviour logprobs). `parse_samples` checks a submission's samples and makes them `SampleRow`s
(ids and logprobs as tuples, unpacked when read), or says why it cannot (a reason word the hub
answers with a `Reject`, never an exception). Every row it returns holds: at least one id, one
finite behaviour logprob <= MAX_LOGPROB per id, and every id below the vocabulary size it was
given; an episode's turns describe its ids and logprobs (`echo2p2p.episodes`). The learner
and the spot-check take rows as they
are and never re-validate them; the journal and checkpoints store them (`echo2p2p.hub.learning.durable`).

Pure: no clock, no files, no tensors. Knows nothing of tokenizers (the vocabulary size is a
number the caller passes) or of rewards (the hub scores rows; a peer's claimed reward stays on
the wire message).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .episodes import check_layout, model_mask, unpack_turns
from .messages import Sample

# A logprob is <= 0; float32 rounding of a near-certain token can land a hair above.
MAX_LOGPROB = 1e-3

BAD_SAMPLE = "bad_sample"  # torn or ragged arrays, no tokens, a non-finite or positive logprob
BAD_TOKENS = "bad_tokens"  # an id outside the vocabulary (the scorer's word for it too)


@dataclass(frozen=True)
class SampleRow:
    """One completion, valid by construction (see the module docstring) when `parse_samples`
    made it. It keeps the bytes it was validated from: the journal writes them as they are and
    admission never unpacks on the event loop; `token_ids` and `logprobs` unpack them when
    read (in the learner's or the spot-check's thread; ~4 us for 256 tokens)."""

    packed_ids: bytes  # little-endian uint32, as on the wire
    packed_logprobs: bytes  # little-endian float32, one per id (an episode: per model token)
    finish_reason: str  # one of messages.FINISH_REASONS
    text: str  # the peer's decoding: a hint, the hub scores the ids
    packed_turns: bytes = b""  # an episode's segment lengths (`echo2p2p.episodes`); b"": none

    @classmethod
    def of(cls, token_ids: Sequence[int], logprobs: Sequence[float], finish_reason: str = "stop",
           text: str = "") -> SampleRow:
        """A row from values, unchecked: for rows the caller made itself (tests, benches)."""
        return cls(struct.pack(f"<{len(token_ids)}I", *token_ids),
                   struct.pack(f"<{len(logprobs)}f", *logprobs), finish_reason, text)

    @property
    def n_tokens(self) -> int:
        return len(self.packed_ids) // 4

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The completion's ids, each below the vocabulary size it was parsed against."""
        return struct.unpack(f"<{self.n_tokens}I", self.packed_ids)

    @property
    def logprobs(self) -> tuple[float, ...]:
        """The behaviour logprob of each model token: finite, <= MAX_LOGPROB."""
        return struct.unpack(f"<{len(self.packed_logprobs) // 4}f", self.packed_logprobs)

    @property
    def turns(self) -> tuple[int, ...] | None:
        """An episode's segment lengths (valid by construction), None for one completion."""
        return unpack_turns(self.packed_turns) if self.packed_turns else None

    def trained(self) -> list[bool]:
        """Per id: is it the model's (trained on, with a behaviour logprob)? Observation
        tokens of an episode are not."""
        turns = self.turns
        return [True] * self.n_tokens if turns is None else model_mask(turns)

    def behaviour(self) -> list[float]:
        """Per id, its behaviour logprob; 0.0 at an episode's observation tokens (masked)."""
        logprobs = iter(self.logprobs)
        return [next(logprobs) if mine else 0.0 for mine in self.trained()]


def parse_sample(sample: Sample, vocab_size: int | None) -> SampleRow | str:
    """`sample` as a row, or the reason (BAD_SAMPLE, BAD_TOKENS) it cannot be one."""
    rows = parse_samples([sample], vocab_size)
    return rows if isinstance(rows, str) else rows[0]


def parse_samples(samples: Sequence[Sample], vocab_size: int | None
                  ) -> tuple[SampleRow, ...] | str:
    """Every sample of a submission as rows, or why not: BAD_SAMPLE if one is malformed (or
    there are none), else BAD_TOKENS if one holds an id at or above `vocab_size` (None: ids are
    not checked against a vocabulary; the caller's decoder does). A submission is taken whole
    or refused whole: its group's advantages need every sample."""
    if not samples:
        return BAD_SAMPLE
    for s in samples:
        if not s.token_ids or len(s.token_ids) % 4 or len(s.logprobs) % 4:
            return BAD_SAMPLE
        if (not check_layout(unpack_turns(s.turns), s.n_tokens, len(s.logprobs) // 4)
                if s.turns else len(s.logprobs) != len(s.token_ids)):
            return BAD_SAMPLE
    # One vectorised pass over the whole submission: ~10 us for G = 8 x 256 tokens, where a
    # Python loop over the unpacked values takes ~100 us (bench/ingest.py admits ~1000 groups/s).
    lps = np.frombuffer(b"".join(s.logprobs for s in samples), dtype="<f4")
    if not (np.isfinite(lps).all() and lps.max() <= MAX_LOGPROB):
        return BAD_SAMPLE
    if vocab_size is not None:
        ids = np.frombuffer(b"".join(s.token_ids for s in samples), dtype="<u4")
        if int(ids.max()) >= vocab_size:  # uint32: never negative
            return BAD_TOKENS
    return tuple(SampleRow(s.token_ids, s.logprobs, s.finish_reason, s.text, s.turns)
                 for s in samples)
