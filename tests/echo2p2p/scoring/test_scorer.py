"""The scorer: reward functions in worker processes, a deadline per completion, the decode rule."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from echo2p2p import messages as m
from echo2p2p.errors import ScoringError
from echo2p2p.completions import CompletionDecoder
from echo2p2p.scoring.scorer import OverBudget, Scorer
from echo2p2p.tasks import addition_reward, math_reward

# math-verify with its timeouts off never finishes on this against an expression gold (against
# a number the math reward takes one number and never calls it)
BOMB, BOMB_GOLD = r"\boxed{9^{99999999999}}", r"\frac{1}{2}"


def char_tokenizer():
    """The built-in tokenizer (imported here: a worker that loads this module's reward
    functions need not import torch)."""
    from echo2p2p.policy.model import build_char_tokenizer

    return build_char_tokenizer()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def raising_reward(answer: str, text: str) -> float:
    """A user reward that breaks the task contract on one input."""
    if text == "boom":
        raise RuntimeError("a bug in someone's verifier")
    return 1.0


@pytest.mark.timeout(120)
async def test_math_bomb_is_killed_at_its_deadline_and_the_group_is_scored():
    """From async code, with the loop free meanwhile: the completion that hangs math-verify
    scores 0 and is counted as a timeout; the others of its group are scored right; a fresh
    worker serves the next call."""
    pytest.importorskip("math_verify")
    with Scorer(math_reward, timeout_s=2.0) as scorer:
        group = [("3", r"\boxed{3}"), (BOMB_GOLD, BOMB), ("4", r"so \boxed{4}"),
                 ("3", r"\boxed{5}")]
        pending = asyncio.create_task(scorer.score(group))
        while not pending.done():  # the loop keeps turning while the worker is stuck
            await asyncio.to_thread(lambda: None)
        scored = pending.result()
        assert scored.rewards == [1.0, 0.0, 1.0, 0.0] and scored.timed_out == 1
        first = scorer.statistics()
        assert first.timeouts == 1 and first.restarts == 1 and first.completions == 4
        again = await scorer.score([("7", r"\boxed{7}"), ("7", r"\boxed{8}")])
        assert again.rewards == [1.0, 0.0] and again.timed_out == 0
        assert scorer.statistics().worker_pids == first.worker_pids  # the fresh one, kept


@pytest.mark.timeout(120)
def test_blocking_use_from_a_thread_and_a_whole_bombed_batch():
    """`score_blocking` (as evaluation calls it from a worker thread) gets a 0 for every bomb
    of a batch made only of bombs, one kill each, and the killed workers are gone."""
    pytest.importorskip("math_verify")
    with Scorer(math_reward, timeout_s=1.0) as scorer:
        assert scorer.score_blocking([("1", r"\boxed{1}")]).rewards == [1.0]
        (pid,) = scorer.statistics().worker_pids
        scored = scorer.score_blocking([(BOMB_GOLD, BOMB), (BOMB_GOLD, BOMB)])
        assert scored.rewards == [0.0, 0.0] and scored.timed_out == 2
        assert scorer.statistics().timeouts == 2 and not alive(pid)


async def test_close_kills_every_worker_and_refuses_more_work():
    """After close() no worker process is left and a new submission raises ScoringError."""
    scorer = Scorer(addition_reward, workers=2)
    await scorer.start()
    scored = await asyncio.gather(*(scorer.score([("12", "12"), ("12", "13")]) for _ in range(8)))
    assert all(s.rewards == [1.0, 0.0] for s in scored)
    pids = scorer.statistics().worker_pids
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    scorer.close()
    assert not any(alive(pid) for pid in pids) and scorer.statistics().worker_pids == ()
    with pytest.raises(ScoringError):
        await scorer.score([("1", "1")])


async def test_close_mid_verifier_cancels_the_waiter_and_kills_the_busy_worker():
    """A worker deep in a verifier that would never return is killed by close(), and its
    caller's future is cancelled, not left waiting."""
    pytest.importorskip("math_verify")
    scorer = Scorer(math_reward, timeout_s=600.0)
    await scorer.start()
    (pid,) = scorer.statistics().worker_pids
    waiting = scorer.submit([(BOMB_GOLD, BOMB)])  # sent at once: the worker is idle
    scorer.close()
    assert waiting.cancelled() and not alive(pid)


def test_a_raising_reward_scores_zero_and_is_counted():
    """A reward function that raises costs that completion only (0, a failure), not the worker."""
    with Scorer(raising_reward) as scorer:
        scored = scorer.score_blocking([("x", "fine"), ("x", "boom"), ("x", "fine")])
        assert scored.rewards == [1.0, 0.0, 1.0] and scored.failed == 1
        assert scorer.statistics().failures == 1 and scorer.statistics().restarts == 0


def test_an_unpicklable_reward_is_refused_at_construction():
    """A lambda cannot reach a worker process: the scorer says so at once, naming the cause."""
    with pytest.raises(ValueError, match="picklable"):
        Scorer(lambda answer, text: 1.0)


async def test_ids_are_decoded_and_scored_and_the_claimed_text_is_only_compared():
    """`score_ids` scores the decoding of the ids: a right answer under a wrong text scores 1
    and is a mismatch; out-of-vocabulary ids and ids after EOS are malformed and score 0."""
    tok = char_tokenizer()

    def ids(text: str, eos: bool = True) -> bytes:
        return m.pack_ids(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] * eos)

    rows = [ids("57"), ids("57"), ids("12"), m.pack_ids([20, len(tok)]),
            ids("57") + ids("57"), ids("57", eos=False)]
    claimed = ["57", "wrong", "57", "57", "57", "57"]
    with Scorer(addition_reward, decoder=CompletionDecoder(tok)) as scorer:
        scored = await scorer.score_ids("57", rows, claimed)
    assert scored.rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert scored.mismatched == 2 and scored.malformed == 2


def test_the_decode_rule_cuts_after_the_first_eos_and_drops_special_tokens():
    """Padding after EOS is no part of the completion; EOS is kept in the ids, not in the text."""
    tok = char_tokenizer()
    row = tok.encode("42", add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id, 9]
    decoder = CompletionDecoder(tok)
    done = decoder.completion(row)
    assert done.token_ids == row[:3] and done.text == "42" and done.stopped
    capped = decoder.completion(row[:2])
    assert capped.token_ids == row[:2] and capped.text == "42" and not capped.stopped


def test_the_decoders_text_is_exactly_the_tokenizers_decode():
    """The decoder's fast path returns `tokenizer.decode(ids, skip_special_tokens=True)` for any
    ids, special tokens and ids the tokenizer does not know included."""
    tok = char_tokenizer()
    decoder = CompletionDecoder(tok)
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(tok) + 3) for _ in range(rng.randrange(1, 30))]
        ids = [i for i in ids if i != tok.eos_token_id]  # the cut at EOS is tested above
        assert decoder.completion(ids).text == tok.decode(ids, skip_special_tokens=True)


def test_scoring_deadlines_and_workers_are_validated_in_both_configs():
    """A non-positive deadline or no worker is refused at start, naming the field."""
    from echo2p2p.errors import ConfigError
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.peer.config import PeerConfig

    for bad in ({"score_timeout_s": 0.0}, {"score_timeout_s": float("nan")},
                {"score_timeout_s": float("inf")}, {"score_workers": 0},
                {"score_sample_budget_s": -1.0}, {"score_sample_budget_s": float("nan")},
                {"code_answer_hold_s": float("inf")}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            HubConfig.from_flat(**bad)
    with pytest.raises(ConfigError, match="score_timeout_s"):
        PeerConfig(score_timeout_s=-1.0)
    assert HubConfig().scoring.score_timeout_s == PeerConfig().score_timeout_s == 5.0


def sleepy_reward(answer: str, text: str) -> float:
    """Sleeps `text` seconds (a program that runs that long), then scores 1."""
    import time

    time.sleep(float(text))
    return 1.0


@pytest.mark.timeout(120)
async def test_a_cheap_owner_is_served_before_a_slow_ones_queue():
    """Owners are served least-used first: a peer whose items are slow waits behind a cheap
    one that arrived later, and its own items beyond the one running wait too."""
    with Scorer(sleepy_reward, timeout_s=5.0) as scorer:
        await scorer.score([("", "0")], owner="honest")  # the worker is up; honest measured
        slow = scorer.submit([("", "0.3")] * 4, owner="burner")
        while scorer.usage_s("burner") == 0:  # its first item is scored
            await asyncio.to_thread(lambda: None)
        fast = scorer.submit([("", "0")] * 2, owner="honest")
        await asyncio.wait({slow, fast}, return_when=asyncio.FIRST_COMPLETED)
        assert fast.done() and not slow.done()
        assert (await slow).rewards == [1.0] * 4


@pytest.mark.timeout(120)
async def test_an_owner_past_its_budget_has_its_queue_failed_over_budget():
    """With a per-item budget, an owner whose items run past it while another scores has
    what it still has queued failed with OverBudget; the other is scored."""
    with Scorer(sleepy_reward, timeout_s=5.0, sample_budget_s=0.1) as scorer:
        await scorer.score([("", "0")], owner="honest")
        slow = scorer.submit([("", "0.3")] * 4, owner="burner")
        with pytest.raises(OverBudget):
            await slow
        assert scorer.over_budget("burner", 0.1) and not scorer.over_budget("honest", 0.1)
        assert (await scorer.score([("", "0")], owner="honest")).rewards == [1.0]


@pytest.mark.timeout(120)
async def test_one_round_trip_scores_many_waiting_owners_cheap_items():
    """Cheap items of many owners that wait while the worker is busy go out in a batch, in
    fair order, not one round trip each (64 peers always wait: one a sample was 0.10x)."""
    with Scorer(sleepy_reward, timeout_s=5.0) as scorer:
        owners = [f"peer-{n}" for n in range(8)]
        for owner in owners:  # each measured: an unmeasured owner's item goes alone
            await scorer.score([("", "0")], owner=owner)
        busy = scorer.submit([("", "0")], owner="first")  # sent now; the others queue behind
        before = scorer.statistics().round_trips
        jobs = [scorer.submit([("", "0")] * 4, owner=owner) for owner in owners]
        assert all(s.rewards == [1.0] * 4 for s in await asyncio.gather(*jobs))
        await busy
        assert scorer.statistics().round_trips - before <= 8  # one an item: 32


@pytest.mark.timeout(120)
async def test_a_slow_item_in_a_shared_batch_is_charged_to_its_owner_and_cuts_the_batch():
    """An owner whose cheap history got a slow item into a batch with another's pays that
    item's time alone (each item is timed), and the worker stops the batch after it: the
    other's items go next, before the slow owner's second item."""
    with Scorer(sleepy_reward, timeout_s=5.0) as scorer:
        for owner in ("honest", "burner"):
            await scorer.score([("", "0")], owner=owner)
        busy = scorer.submit([("", "0")], owner="first")  # both queue behind it, cheap-looking
        slow = scorer.submit([("", "0.3")] * 2, owner="burner")
        fast = scorer.submit([("", "0")] * 4, owner="honest")
        await asyncio.wait({slow, fast}, return_when=asyncio.FIRST_COMPLETED)
        assert fast.done() and not slow.done()
        assert (await slow).rewards == [1.0] * 2 and (await busy).rewards == [1.0]
        assert scorer.usage_s("honest") < 0.1 and scorer.usage_s("burner") > 0.5  # 0.6, decaying
