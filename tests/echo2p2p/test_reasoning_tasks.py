"""reasoning-gym generators as tasks, for real: a split held out by question text and fixed by
the generator's seeds, the answer extraction, and the generator's own scorer as the reward."""

from __future__ import annotations

import math
import pickle

import pytest

pytest.importorskip("reasoning_gym")

from echo2p2p.scoring import worker
from echo2p2p.tasks.reasoning import (INSTRUCTION, PARTIAL_CREDIT, GeneratorScore,
                                      ReasoningTask, committed_answer, extract_answer,
                                      open_generator, task_options)

ONE_DIGIT_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture(scope="module")
def sums() -> ReasoningTask:
    """chain_sum of two 1-digit terms: only 200 distinct questions, so draws repeat them."""
    return ReasoningTask("chain_sum", ONE_DIGIT_SUMS, eval_size=64, train_size=2000)


def test_eval_and_train_share_no_question(sums):
    """A generator that repeats itself still holds the eval questions out of training."""
    held = {p.row["question"] for p in sums.problems("eval")}
    trained = [p.row["question"] for p in sums.problems("train")]
    assert len(held) == len(sums.problems("eval")) == 64  # distinct, and as many as asked
    assert len(trained) > len(set(trained)) > 64  # the training draw does repeat questions
    assert not held & set(trained)
    ids = [p.id for p in (*sums.problems("eval"), *sums.problems("train"))]
    assert len(ids) == len(set(ids))


def test_same_config_same_split(sums):
    """The generator's seeds fix the split: built again, the task holds out the same problems."""
    again = ReasoningTask("chain_sum", ONE_DIGIT_SUMS, eval_size=64, train_size=2000)
    for split in ("eval", "train"):
        assert [(p.id, p.prompt, p.answer) for p in again.problems(split)] == \
               [(p.id, p.prompt, p.answer) for p in sums.problems(split)]
    assert sums.kind == "rg:chain_sum"


def test_few_distinct_questions_hold_out_at_most_half():
    """products of two digits makes 100 questions: at most half of them are held out."""
    task = ReasoningTask("products", ONE_DIGIT_SUMS, eval_size=256, train_size=2000)
    held = {p.row["question"] for p in task.problems("eval")}
    assert len(held) == 50
    assert len({p.row["question"] for p in task.problems("train")}) == 50


def test_prompt_is_the_question_and_the_instruction(sums):
    problem = sums.problems("eval")[0]
    assert problem.prompt == f"{problem.row['question'].rstrip()}\n{INSTRUCTION}"
    assert problem.answer == problem.row["answer"]


@pytest.mark.parametrize("completion, gold, expected", [
    ("5 - 3 = 2", "2", "2"),
    ("The answer is 1,234.", "1234", "1234"),
    ("It is -4", "-4", "-4"),
    ("x is 7 <answer> 12 </answer> then <answer>13</answer> and 99", "13", "13"),
    ("<answer>dog, cat</answer>", "4", "dog, cat"),  # the tag wins over the number rule
    ("I think\nAnswer: blue.", "blue", "blue"),
    ("thinking...\nThe answer is Paris.\n\n", "Paris", "Paris"),
    ("The final answer is: Paris", "Paris", "Paris"),
    ("no number at all", "7", "no number at all"),
    ("", "7", ""),
    ("3 apples and 2.5 pears", "2.5", "2.5"),
])
def test_extract_answer(completion, gold, expected):
    assert extract_answer(completion, {"answer": gold}) == expected


def test_generator_scores_right_one_and_wrong_zero(sums):
    score = pickle.loads(pickle.dumps(sums.scorer()))  # as a scoring worker receives it
    problem = sums.problems("eval")[0]
    assert score(problem, f"{problem.row['question']} {problem.answer}") == 1.0
    assert score(problem, f"<answer>{problem.answer}</answer>") == 1.0
    assert score(problem, "I do not know.") == 0.0
    assert score(problem, f"{problem.answer}07") == 0.0  # full credit or nothing


def test_partial_credit_is_the_generators_own_score(sums):
    """With partial_credit the generator's score stands as it is: chain_sum credits a gold
    answer inside a longer one with len(gold) / len(answer), and survives pickling."""
    task = ReasoningTask("chain_sum", ONE_DIGIT_SUMS, eval_size=64, train_size=2000,
                         partial_credit=True)
    score = pickle.loads(pickle.dumps(task.scorer()))
    problem = task.problems("eval")[0]
    assert score(problem, f"{problem.answer}07") == pytest.approx(
        len(problem.answer) / (len(problem.answer) + 2))
    assert score(problem, problem.answer) == 1.0


class OutOfRange:
    """A generator whose scorer answers `value` (as a third-party scorer might)."""

    def __init__(self, value: float):
        self.value = value

    def score_answer(self, answer, entry):
        return self.value


@pytest.mark.parametrize("value", [1.5, -0.1, math.nan, math.inf])
def test_a_score_out_of_range_fails_that_sample_with_zero(sums, value):
    """A score that is not a number in [0, 1] is a failed sample scored 0 by the worker."""
    score = GeneratorScore("chain_sum", ONE_DIGIT_SUMS)
    score._dataset = OutOfRange(value)
    reward, note, detail = worker.score_item(score, None, (sums.problems("eval")[0], "3"))
    assert (reward, note) == (0.0, worker.FAILED)
    assert "score_answer returned" in detail


def test_unknown_generator_names_close_ones():
    with pytest.raises(LookupError, match="close names: chain_sum.*list them"):
        open_generator("chain_sums", {}, seed=0, size=1)


@pytest.mark.parametrize("args, says", [({"min_digts": 1}, "min_digts"),
                                        ({"min_terms": 5, "max_terms": 2}, "max_terms")])
def test_arguments_the_generator_rejects_carry_its_message(args, says):
    with pytest.raises(ValueError, match=says):
        open_generator("chain_sum", args, seed=0, size=1)


def test_task_reward_points_to_the_scorer(sums):
    with pytest.raises(TypeError, match="scorer"):
        sums.reward("1", "1")


@pytest.mark.parametrize("completion, gold, expected", [
    ("5 - 3 = 2", "2", "2"),
    ("The answer is 1,234.", "1234", "1234"),
    ("It is -4", "-4", "-4"),
    ("The answer is 7.\n\nHope this helps!", "7", "7"),  # a sign-off is not an answer
    ("3 apples and 2.5 pears", "2.5", ""),  # two numbers: not one answer
    ("12 or 13", "13", ""),
    ("<answer>12 13</answer>", "13", ""),
    ("<answer>12</answer> then <answer>13</answer>", "13", ""),  # tags that disagree
    ("<answer>13</answer> and 99", "13", "13"),
    ("\\boxed{13} or \\boxed{12}", "13", ""),
    ("4 + 9 = 4 + 9", "13", ""),  # the question echoed
    ("I think\nAnswer: blue.", "blue", "blue"),
    ("<answer>dog, cat</answer>", "dog, cat", "dog, cat"),
    ("no number at all", "7", ""),
])
def test_committed_answer(completion, gold, expected):
    """The strict scorer reads one answer: against a number, the one number of the final
    statement; "" when the completion commits to several."""
    assert committed_answer(completion, {"answer": gold}) == expected


def test_task_options_take_partial_credit_out_of_the_generators_keywords():
    """"partial_credit" is ours: taken out of the keywords, a boolean or a ValueError."""
    assert task_options({"min_digits": 1}) == ({"min_digits": 1}, False)
    assert task_options({PARTIAL_CREDIT: True, "min_digits": 1}) == ({"min_digits": 1}, True)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="'partial_credit' must be true .* or false"):
            task_options({PARTIAL_CREDIT: bad})
