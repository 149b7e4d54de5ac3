"""`--task rg:<name>` on the hub, for real: the task and its scorer from the config, scored by
the hub's scoring workers, peers not trusted to score it, and every mistake a ConfigError naming
its field."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("reasoning_gym")

from echo2p2p.errors import ConfigError
from echo2p2p.hub.cli import build_parser, load_config
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.tasks.task_setup import open_setup
from echo2p2p.scoring.scorer import Scorer

SUMS = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'


def test_generator_task_scored_by_the_hubs_workers():
    """A right answer scores 1 and a wrong one 0 in the hub's scoring workers (off the event
    loop, under the deadline); peers are told a kind they do not score."""
    setup = open_setup(HubConfig.from_flat(task="rg:chain_sum", task_args=SUMS, eval_problems=8))
    assert setup.kind == "rg:chain_sum" and not setup.peers_score
    problems = list(setup.task.problems("eval"))
    assert len(problems) == 8
    right = [(p, f"So {p.row['question']} {p.answer}.") for p in problems]
    wrong = [(p, "<answer>no idea</answer>") for p in problems]
    with Scorer(setup.reward, timeout_s=30.0, name="rg-test") as scorer:
        scored = scorer.score_blocking(right + wrong)
    assert scored.rewards == [1.0] * 8 + [0.0] * 8
    assert scored.failed == scored.timed_out == 0


def test_hedges_score_zero_unless_partial_credit_is_asked_for():
    """In the hub's workers a hedge of the gold scores 0 by default; --task-args with
    "partial_credit": true (never passed to the generator) gives chain_sum's own partial
    credit back."""
    def scores(task_args: str) -> list[float]:
        setup = open_setup(HubConfig.from_flat(task="rg:chain_sum", task_args=task_args,
                                               eval_problems=8))
        problems = [p for p in setup.task.problems("eval") if p.answer.isdigit()]
        hedged = [(p, f"<answer>{p.answer} {int(p.answer) + 1}</answer>") for p in problems]
        with Scorer(setup.reward, timeout_s=30.0, name="rg-test") as scorer:
            return scorer.score_blocking(hedged).rewards

    strict = scores(SUMS)
    assert strict and strict == [0.0] * len(strict)
    partial = scores(SUMS[:-1] + ', "partial_credit": true}')
    assert partial and all(0.0 < r < 1.0 for r in partial)


def test_few_distinct_questions_are_said_in_the_log(caplog):
    """products of two digits makes 100 questions: 50 are held out, and the log says why."""
    setup = open_setup(HubConfig.from_flat(task="rg:products", task_args=SUMS, eval_problems=64))
    assert len(setup.task.problems("eval")) == 50
    assert "rg:products makes few distinct questions: 50 held out, not --eval-problems 64" \
        in caplog.text


def test_users_reward_functions_read_the_generated_row():
    """--reward exact_match on a generator's task reads each entry's "answer"."""
    setup = open_setup(HubConfig.from_flat(task="rg:chain_sum", task_args=SUMS, eval_problems=4,
                                           reward="exact_match"))
    problem = setup.task.problems("eval")[0]
    assert setup.kind == "custom"
    assert setup.reward(problem, problem.answer) == 1.0


@pytest.mark.parametrize("fields, field, says", [
    ({"task": "rg:chain_sums"}, "task", "chain_sum"),
    ({"task": "rg:chain_sum", "task_args": "{min_digits: 1}"}, "task_args", "not JSON"),
    ({"task": "rg:chain_sum", "task_args": "[1, 2]"}, "task_args", "JSON object"),
    ({"task": "rg:chain_sum", "task_args": '{"min_digts": 1}'}, "task_args", "min_digts"),
    ({"task": "rg:chain_sum", "task_args": '{"min_terms": 5, "max_terms": 2}'}, "task_args",
     "max_terms must be >= min_terms"),
    ({"task_args": '{"min_digits": 1}'}, "task_args", "rg:<name>"),
    ({"task": "rg:chain_sum", "task_args": '{"partial_credit": "yes"}'}, "task_args",
     "'partial_credit' must be true"),
])
def test_mistakes_name_the_field(fields, field, says):
    with pytest.raises(ConfigError, match=says) as caught:
        open_setup(HubConfig.from_flat(eval_problems=4, **fields))
    assert caught.value.field == field


def test_reasoning_gym_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym fails
    with pytest.raises(ConfigError, match="pip install reasoning-gym") as caught:
        open_setup(HubConfig.from_flat(task="rg:chain_sum", eval_problems=4))
    assert caught.value.field == "task"


def test_task_args_come_from_the_command_line():
    """--task rg:<name> and --task-args on echo2-hub's command line reach the task."""
    args = build_parser().parse_args(["serve", "--task", "rg:leg_counting", "--task-args",
                                      '{"min_animals": 1, "max_animals": 1}'])
    cfg = load_config(args)
    assert cfg.tasks.generator_args == {"min_animals": 1, "max_animals": 1}
    assert open_setup(cfg).kind == "rg:leg_counting"
