"""The row parser: a submission's samples become valid rows, or a reason word, never a raise."""

from __future__ import annotations

import math
import struct

from hypothesis import given
from hypothesis import strategies as st

from echo2p2p.messages import Sample, pack_ids, pack_logprobs
from echo2p2p.rows import BAD_SAMPLE, BAD_TOKENS, MAX_LOGPROB, SampleRow, parse_sample, parse_samples

VOCAB = 50


def sample(ids: list[int], lps: list[float], text: str = "t", finish: str = "stop") -> Sample:
    return Sample(pack_ids(ids), pack_logprobs(lps), text, 0.5, finish)


def test_valid_samples_become_rows():
    """Ids, float32 logprobs, finish reason and text come through; the claimed reward does not."""
    rows = parse_samples([sample([1, 2, 49], [-0.5, -1.25, 0.0]), sample([7], [-2.0], "x", "length")],
                         VOCAB)
    assert rows == (SampleRow.of((1, 2, 49), (-0.5, -1.25, 0.0), "stop", "t"),
                    SampleRow.of((7,), (-2.0,), "length", "x"))
    assert rows[0].token_ids == (1, 2, 49) and rows[0].logprobs == (-0.5, -1.25, 0.0)
    assert [r.n_tokens for r in rows] == [3, 1]
    assert all(type(t) is int for t in rows[0].token_ids)


def test_float32_rounding_above_zero_is_kept():
    """A near-certain token's logprob may round a hair above 0: up to MAX_LOGPROB passes as is."""
    (row,) = parse_samples([sample([3], [MAX_LOGPROB / 2])], VOCAB)
    assert 0 < row.logprobs[0] <= MAX_LOGPROB


def test_each_hostile_sample_has_its_reason():
    """Every malformed sample the learner used to drop is refused with a reason word."""
    cases = {
        BAD_SAMPLE: [
            sample([1, 2], [-1.0, float("nan")]),  # non-finite
            sample([1, 2], [float("-inf"), -1.0]),
            sample([1, 2], [-1.0, float("inf")]),
            sample([1, 2], [-1.0, 0.5]),  # a positive logprob
            Sample(pack_ids([1, 2]) + b"\x01", pack_logprobs([-1.0, -1.0]), "", 0.0, "stop"),  # torn
            sample([1, 2, 3], [-1.0]),  # lengths differ
            Sample(b"", b"", "", 0.0, "stop"),  # no tokens
        ],
        BAD_TOKENS: [sample([1, VOCAB], [-1.0, -1.0]), sample([2**32 - 1], [-1.0])],
    }
    for reason, samples in cases.items():
        for bad in samples:
            assert parse_sample(bad, VOCAB) == reason
            assert parse_samples([sample([1], [-1.0]), bad], VOCAB) == reason  # refused whole


def test_no_samples_is_refused():
    """A submission with no samples is no group."""
    assert parse_samples([], VOCAB) == BAD_SAMPLE


def test_vocabulary_left_to_the_caller():
    """Without a vocabulary size ids are not range-checked (the hub's decoder does that)."""
    (row,) = parse_samples([sample([10**6], [-1.0])], None)
    assert row.token_ids == (10**6,)


@given(st.binary(max_size=40), st.binary(max_size=40), st.integers(1, 2**32))
def test_any_bytes_give_a_row_or_a_reason(ids: bytes, lps: bytes, vocab: int):
    """Whatever bytes a peer packs, the parser answers a valid row or a reason, never raises."""
    out = parse_sample(Sample(ids, lps, "", 0.0, "stop"), vocab)
    if isinstance(out, str):
        assert out in (BAD_SAMPLE, BAD_TOKENS)
        return
    assert out.token_ids and len(out.token_ids) == len(out.logprobs)
    assert all(0 <= t < vocab for t in out.token_ids)
    assert all(math.isfinite(x) and x <= MAX_LOGPROB for x in out.logprobs)
    assert struct.pack(f"<{len(out.logprobs)}f", *out.logprobs) == lps
