"""Users' reward functions as the hub runs them: weights, async, and what a broken one costs.

Real worker processes (`Scorer`), real `Problem`s; the functions are this module's, which the
workers import by name.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from echo2p2p.scoring.rewards import RewardFunctions, exact_match, load_reward
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.tasks import Problem


def length(prompt: str, completion: str, row: dict) -> float:
    return float(len(completion))


async def echoes_row(prompt: str, completion: str, row: dict) -> float:
    await asyncio.sleep(0)  # a real await: the function is a coroutine
    return float(row["bonus"])


def moody(prompt: str, completion: str, row: dict) -> float:
    """Raises, hangs or returns NaN on the completions named so; 1 otherwise."""
    if completion == "raise":
        raise KeyError("no such column")
    if completion == "hang":
        while True:
            pass
    return float("nan") if completion == "nan" else 1.0


def problem(bonus: float = 0.0) -> Problem:
    return Problem("p", "2+2=", "4", row={"answer": "4", "bonus": bonus})


def test_weighted_sum_of_sync_and_async_functions():
    reward = RewardFunctions([length, echoes_row], [0.5, 2.0])
    assert reward(problem(bonus=3.0), "abcd") == 0.5 * 4 + 2.0 * 3.0


def test_builtin_task_rows_carry_their_answer():
    """A built-in task's problems have no row: the functions see its answer as the row's."""
    assert RewardFunctions([exact_match])(Problem("p", "2+2=", "4"), " 4") == 1.0


@pytest.mark.parametrize("weights, funcs, why", [
    ([1.0], [length, echoes_row], "one weight per function"),
    ([0.0], [length], "not all 0"),
    ([float("inf")], [length], "finite"),
    (None, [lambda prompt, completion: 1.0], r"must take \(prompt, completion, row\)"),
])
def test_bad_reward_functions_are_refused_with_the_fix(weights, funcs, why):
    with pytest.raises(ValueError, match=why):
        RewardFunctions(funcs, weights)


def test_rewards_load_by_builtin_name_or_module_path():
    assert load_reward("exact_match") is exact_match
    assert load_reward(f"{__name__}:length") is length
    with pytest.raises(ValueError, match="not a built-in"):
        load_reward("nonsense")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward("no_such_module_here:f")


@pytest.mark.timeout(120)
async def test_a_reward_that_raises_hangs_or_is_nan_scores_zero_with_a_counted_logged_reason(
        caplog):
    """Each broken sample scores 0 with its reason counted and logged; the others of the
    batch are scored, and the scorer serves the next batch."""
    caplog.set_level(logging.WARNING, logger="echo2p2p.scoring.scorer")
    reward = RewardFunctions([moody])
    with Scorer(reward, timeout_s=1.0) as scorer:
        items = [(problem(), text) for text in ("fine", "raise", "nan", "hang", "fine")]
        scored = await scorer.score(items)
        assert scored.rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert (scored.failed, scored.timed_out) == (2, 1)
        stats = scorer.statistics()
        assert (stats.failures, stats.timeouts) == (2, 1)
        again = await scorer.score([(problem(), "fine")])
        assert again.rewards == [1.0]
    logged = caplog.text
    assert "KeyError: 'no such column'" in logged
    assert "moody returned nan" in logged
    assert "ran past the 1 s deadline" in logged
