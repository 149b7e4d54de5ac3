"""TRL's reward functions plug in as they are: TRL's own (`trl.rewards`) and ones written to
its signature, scored in real worker processes from the ids a peer sent, the dataset's columns
as keyword arguments, None skipped as TRL skips it."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from trl.rewards import accuracy_reward, think_format_reward

from echo2p2p.completions import CompletionDecoder
from echo2p2p.messages import pack_ids
from echo2p2p.scoring.rewards import RewardFunctions, exact_match
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.adapters.trl_rewards import is_trl_reward
from echo2p2p.tasks import Problem

CHAT = [{"role": "user", "content": "What is 1 + 1? Think first."}]


def ids_seen(prompts, completions, completion_ids, limit, **kwargs):
    """A TRL-style reward of the standard format: the completion's length in ids against the
    row's `limit` column (TRL hands every column as a list over the batch)."""
    assert isinstance(prompts[0], str) and isinstance(completions[0], str)
    return [len(ids) / lim for ids, lim in zip(completion_ids, limit)]


async def shouts(completions, **kwargs):
    await asyncio.sleep(0)  # a coroutine, as TRL allows
    return [1.0 if c[0]["content"].splitlines()[-1].isupper() else 0.0 for c in completions]


def two_for_one(completions, **kwargs):
    return [1.0, 1.0]  # broken: one reward per completion is the contract


def chat_row(**columns) -> Problem:
    return Problem("p", "What is 1 + 1?", "", row={"prompt": CHAT, **columns})


def test_trls_signature_is_told_from_ours():
    assert is_trl_reward(think_format_reward) and is_trl_reward(accuracy_reward)
    assert is_trl_reward(ids_seen) and is_trl_reward(shouts)
    assert not is_trl_reward(exact_match) and not is_trl_reward(len)


def test_trls_own_rewards_score_a_conversational_row():
    """`think_format_reward` and `accuracy_reward` (its `solution` column) read the
    completion as TRL's conversational format hands it: [{"role": "assistant", ...}]."""
    reward = RewardFunctions([think_format_reward, accuracy_reward], [1.0, 2.0])
    row = chat_row(solution="$2$")
    assert reward(row, "<think>\n1 + 1 is 2\n</think>\nThe answer is $2$.") == 1.0 + 2.0
    assert reward(row, "<think>\nhm\n</think>\nThe answer is $3$.") == 1.0
    assert reward(row, "The answer is $2$.") == 2.0


def test_none_is_left_out_and_all_none_fails_the_sample():
    """accuracy_reward returns None when the solution does not parse: TRL leaves it out of
    the sum; a sample no function applies to is not scorable."""
    row = chat_row(solution="no math here")
    both = RewardFunctions([think_format_reward, accuracy_reward], [1.0, 2.0])
    assert both(row, "<think>\nx\n</think>\n$2$") == 1.0
    with pytest.raises(ValueError, match="every reward function returned None"):
        RewardFunctions([accuracy_reward])(row, "$2$")


def test_a_function_that_breaks_trls_contract_is_named():
    with pytest.raises(ValueError, match="two_for_one returned .* one reward per completion"):
        RewardFunctions([two_for_one])(chat_row(), "x")


def test_wrapped_functions_pickle_by_reference():
    reward = pickle.loads(pickle.dumps(RewardFunctions([think_format_reward, shouts])))
    assert reward(chat_row(), "<think>\nloud\n</think>\nYES") == 2.0


@pytest.mark.timeout(120)
async def test_workers_score_trl_functions_from_the_ids_a_peer_sent():
    """Real worker processes: the ids decoded from the wire reach `completion_ids` (a text
    scored as it is, its encoding), the row's columns reach the keyword arguments, and an async
    TRL function is awaited."""
    from echo2p2p.policy.model import build_char_tokenizer

    tok = build_char_tokenizer()
    decoder = CompletionDecoder(tok)
    standard = Problem("p", "2+2=", "4", row={"prompt": "2+2=", "limit": 10})
    text = "4 and more"
    ids = tok.encode(text, add_special_tokens=False)
    with Scorer(RewardFunctions([ids_seen]), decoder=decoder, timeout_s=30.0) as scorer:
        scored = await scorer.score_ids(standard, [pack_ids(ids)], [text])
        as_text = await scorer.score([(standard, text + "!")])  # held-out evaluation: a text
    assert scored.rewards == [len(ids) / 10] and as_text.rewards == [(len(ids) + 1) / 10]
    chat = chat_row()
    with Scorer(RewardFunctions([shouts]), decoder=decoder, timeout_s=30.0) as scorer:
        loud, quiet = (tok.encode(t, add_special_tokens=False) for t in ("YES", "yes"))
        scored = await scorer.score_ids(chat, [pack_ids(loud), pack_ids(quiet)], ["YES", "yes"])
    assert scored.rewards == [1.0, 0.0]
