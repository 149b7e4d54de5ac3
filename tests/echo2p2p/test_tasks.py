"""Tasks: rewards, deterministic held-out splits, JSONL parsing errors, the reward registry."""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import pathlib
import re

import pytest

from echo2p2p.tasks import (AdditionTask, MathTask, Problem, Task, extract_answer,
                            problems_from_records, reward_fn)
from echo2p2p.tasks.addition import SPLIT_SEED
from echo2p2p.tasks.math import normalize_answer

TASKS_DIR = pathlib.Path(__file__).resolve().parents[2] / "echo2p2p" / "tasks"


def test_tasks_import_no_heavy_or_io_modules():
    """The tasks package is pure: no torch, transformers, asyncio or aiohttp imports, no open()."""
    banned = {"torch", "transformers", "asyncio", "aiohttp", "vllm"}
    for path in TASKS_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {(node.module or "").split(".")[0]}
            else:
                roots = set()
            assert not roots & banned, f"{path.name} imports {roots & banned}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "open", f"{path.name} opens a file"


def test_addition_problems_are_correct_sums():
    """Every addition prompt is "a+b=" and its answer is the decimal sum."""
    task = AdditionTask(split_seed=3, train_size=300, eval_size=50)
    for p in [*task.problems("train"), *task.problems("eval")]:
        a, b = p.prompt.removesuffix("=").split("+")
        assert p.prompt.endswith("=") and p.answer == str(int(a) + int(b))
        assert max(len(a), len(b)) <= task.max_digits


def test_addition_splits_deterministic_and_disjoint():
    """Same split seed gives the same splits; eval never shares a problem with train; split
    seeds differ."""
    a, b = AdditionTask(split_seed=1), AdditionTask(split_seed=1)
    assert a.problems("train") == b.problems("train") and a.problems("eval") == b.problems("eval")
    train_ids = {p.id for p in a.problems("train")}
    eval_ids = {p.id for p in a.problems("eval")}
    assert len(train_ids) == len(a.problems("train")) and len(eval_ids) == len(a.problems("eval"))
    assert not train_ids & eval_ids
    assert {p.prompt for p in a.problems("train")}.isdisjoint(p.prompt for p in a.problems("eval"))
    assert AdditionTask(split_seed=2).problems("eval") != a.problems("eval")


def _digest(problems) -> str:
    return hashlib.sha256("\n".join(p.id for p in problems).encode()).hexdigest()


def test_default_addition_split_is_the_one_the_shipped_base_learned_on():
    """The default split is pinned: the shipped tiny base was warmed up on exactly this train
    split (bench/assets/make_tiny_base.py), so redrawing it would put warm-up sums in the held-out set."""
    task = AdditionTask()
    assert task.split_seed == SPLIT_SEED == 0
    assert (len(task.problems("train")), len(task.problems("eval"))) == (4_500, 500)
    assert [p.id for p in task.problems("eval")[:3]] == ["add-5+3", "add-5+26", "add-1+73"]
    assert _digest(task.problems("train")) == (
        "78515c91a95969d1299f44a9d0b410aa94c34445afe7c3291d2dbb59e9ba2c4c")
    assert _digest(task.problems("eval")) == (
        "bace0ad377a0d02c04c3c94c9fd738de88343fa9868e77fd7523bcb4b7353d40")


def test_addition_reward_exact_match():
    """Addition reward is 1 only for the exact answer (outer whitespace ignored), else 0."""
    r = reward_fn("addition")
    assert r("432", "432") == 1.0
    assert r("432", " 432\n") == 1.0
    assert r("432", "4321") == 0.0
    assert r("432", "43") == 0.0
    assert r("432", "") == 0.0
    assert AdditionTask(train_size=10, eval_size=10).reward("5", "5") == 1.0


def test_addition_partial_credit():
    """Partial credit: 1 for exact, 0.5 x digits in place for a same-length miss, else 0."""
    task = AdditionTask(train_size=10, eval_size=10, partial_credit=True)
    assert task.kind == "addition-partial" and reward_fn(task.kind) is task._reward
    assert task.reward("432", "432") == 1.0
    assert task.reward("432", "431") == pytest.approx(1 / 3)
    assert task.reward("432", "999") == 0.0
    assert task.reward("432", "43") == 0.0 and task.reward("432", "4320") == 0.0
    assert AdditionTask(train_size=10, eval_size=10).kind == "addition"


def test_unknown_split_raises():
    """Asking for a split other than train or eval names the valid ones."""
    with pytest.raises(ValueError, match="train"):
        AdditionTask(train_size=10, eval_size=10).problems("test")


def _rows(n: int) -> list[str]:
    return [json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) for i in range(n)]


def test_math_task_from_lines_splits():
    """MathTask holds out eval_size shuffled rows, deterministically, disjoint from train."""
    lines = _rows(50) + [""]
    a = MathTask.from_lines(lines, eval_size=10, split_seed=4)
    b = MathTask.from_lines(lines, eval_size=10, split_seed=4)
    assert isinstance(a, Task) and a.kind == "math"
    assert len(a.problems("eval")) == 10 and len(a.problems("train")) == 40
    assert a.problems("eval") == b.problems("eval") and a.problems("train") == b.problems("train")
    assert not {p.id for p in a.problems("eval")} & {p.id for p in a.problems("train")}
    other = MathTask.from_lines(lines, eval_size=10, split_seed=5)
    assert other.problems("eval") != a.problems("eval")
    assert MathTask.from_lines(lines, eval_size=10).problems("eval") == (
        MathTask.from_lines(lines, eval_size=10, split_seed=0).problems("eval"))
    assert all("What is" in p.prompt for p in a.problems("train"))


def test_math_task_gsm8k_answer_and_ids():
    """A "#### 72" answer keeps only 72; a row id is used when present."""
    row = {"id": "q7", "question": "How many?", "answer": "Half of 144 is 72.\n#### 72"}
    task = MathTask.from_lines([json.dumps(row), *_rows(3)], eval_size=0)
    assert Problem("q7", task.problems("train")[0].prompt, "72") in task.problems("train")


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ('["a", "b"]', "line 2: expected a JSON object"),
    ('{"answer": "3"}', "line 2: .*'question'"),
    ('{"question": "Q?"}', "line 2: .*'answer'"),
    ('{"question": "Q?", "answer": null}', "line 2: .*'answer'"),
    ('{"question": "Q?", "answer": "  "}', "line 2: empty 'answer'"),
])
def test_math_task_bad_rows_name_the_line(line, message):
    """A malformed JSONL row raises ValueError naming its line number."""
    with pytest.raises(ValueError, match=message):
        MathTask.from_lines([_rows(1)[0], line, _rows(1)[0]])


def test_math_task_empty_input():
    """Input with no rows at all is an error, not an empty task."""
    with pytest.raises(ValueError, match="no problems"):
        MathTask.from_lines(["", "  \n"])


@pytest.mark.parametrize("gold, completion, expected", [
    ("72", "The answer is \\boxed{72}.", 1.0),
    ("72", "The answer is 72", 1.0),
    ("72", "so 72.0", 1.0),
    ("1,000", "It costs $1000.", 1.0),
    ("72", "<answer>72</answer> and later 5", 1.0),
    ("72", "I think 71", 0.0),
    ("72", "\\boxed{7}2", 0.0),
    ("72", "", 0.0),
    ("-3", "x = -3", 1.0),
])
def test_math_reward(gold, completion, expected):
    """Math reward compares final answers after normalisation (or via math_verify)."""
    assert reward_fn("math")(gold, completion) == expected


def test_math_reward_says_nothing_about_its_timeouts(monkeypatch, capfd, caplog):
    """math-verify's "Timeout is disabled" warning (once per process: each scoring worker and
    peer) is dropped; its other records are not."""
    mv_parser = pytest.importorskip("math_verify.parser")
    mv_grader = pytest.importorskip("math_verify.grader")
    monkeypatch.setattr(mv_parser, "TIMEOUT_WARNING_SHOWN", False)  # as in a fresh process
    monkeypatch.setattr(mv_grader, "TIMEOUT_WARNING_SHOWN", False)
    with caplog.at_level(logging.DEBUG):
        assert reward_fn("math")("72", "The answer is \\boxed{72}.") == 1.0
        mv_parser.logger.warning("another warning")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == \
           ["another warning"]
    assert "Timeout" not in capfd.readouterr().err


def test_normalize_answer():
    """The fallback normaliser keeps the last number-like token of the boxed or plain text."""
    assert normalize_answer("\\boxed{\\frac{1}{2}} or \\boxed{3,500.50}") == "3500.5"
    assert normalize_answer("$12.00$") == "12"
    assert normalize_answer("no number") == "no number"


def test_reward_fn_unknown_kind():
    """An unknown task kind raises ValueError naming it and the known kinds."""
    with pytest.raises(ValueError, match="'poetry'.*addition"):
        reward_fn("poetry")


GSM8K_ROW = {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
             "answer": "In May she sold 48/2 = <<48/2=24>>24.\n48+24 = <<48+24=72>>72\n#### 72"}
MATH_ROW = {"problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
            "solution": "We add: $\\frac{1}{4} + \\frac{1}{4} = \\boxed{\\frac{1}{2}}$."}


@pytest.mark.parametrize("text, style, expected", [
    (GSM8K_ROW["answer"], "gsm8k", "72"),
    ("It costs 1,000 dollars.\n#### 1,000", "gsm8k", "1000"),
    (MATH_ROW["solution"], "math", "\\frac{1}{2}"),
    ("first \\boxed{1}, then \\boxed{\\sqrt{2}}", "math", "\\sqrt{2}"),
    (GSM8K_ROW["answer"], "auto", "72"),
    (MATH_ROW["solution"], "auto", "\\frac{1}{2}"),
    (" 42 ", "auto", "42"),
    (" 42 ", "plain", "42"),
    ("no hashes here", "gsm8k", None),
    ("####  ", "gsm8k", None),
    ("no box", "math", None),
    ("\\boxed{unclosed", "math", None),
])
def test_extract_answer_styles(text, style, expected):
    """GSM8K keeps what follows the last ####, MATH the last balanced \\boxed{}; None if absent."""
    assert extract_answer(text, style) == expected


def test_extract_answer_unknown_style():
    """An unknown answer format names the known ones."""
    with pytest.raises(ValueError, match="'latex'.*gsm8k"):
        extract_answer("3", "latex")


def test_dataset_rows_become_problems_scored_by_math_verify():
    """Rows with a field mapping become problems whose extracted answers math-verify scores."""
    pytest.importorskip("math_verify")
    rows = [MATH_ROW, {"problem": "Empty?", "solution": "no boxed answer"}, MATH_ROW]
    problems, skipped = problems_from_records(rows, question_field="problem",
                                              answer_field="solution", answer_format="math",
                                              template="Q: {question}", id_prefix="test")
    assert skipped == 1 and [p.id for p in problems] == ["test-0", "test-2"]
    assert problems[0].prompt == "Q: " + MATH_ROW["problem"] and problems[0].answer == "\\frac{1}{2}"
    reward = reward_fn("math")
    assert reward(problems[0].answer, "So it is \\boxed{0.5}.") == 1.0
    assert reward(problems[0].answer, "So it is \\boxed{\\frac{2}{4}}.") == 1.0
    assert reward(problems[0].answer, "So it is \\boxed{\\frac{1}{3}}.") == 0.0
    (gsm,), _ = problems_from_records([GSM8K_ROW], question_field="question",
                                      answer_field="answer", answer_format="gsm8k",
                                      template="{question}", id_prefix="train")
    assert reward(gsm.answer, "48 + 24 = 72, so \\boxed{72}") == 1.0
    assert reward(gsm.answer, "\\boxed{24}") == 0.0


def test_dataset_rows_without_any_answer_name_the_fields():
    """No usable row is a ValueError naming both fields and the answer format."""
    with pytest.raises(ValueError, match="'question'.*'answer'.*'gsm8k'"):
        problems_from_records([{"question": "Q?", "answer": "42"}, {"question": 3}],
                              question_field="question", answer_field="answer",
                              answer_format="gsm8k", template="{question}", id_prefix="train")


def test_math_task_held_out_split_is_kept_as_given():
    """A dataset's own eval split is the eval split, whole and in order; train gets every row."""
    train = [Problem(f"train-{i}", f"q{i}", str(i)) for i in range(10)]
    held = [Problem(f"test-{i}", f"t{i}", str(i)) for i in range(3)]
    task = MathTask(train, held_out=held, split_seed=1)
    assert task.problems("eval") == tuple(held)
    assert sorted(p.id for p in task.problems("train")) == sorted(p.id for p in train)
    with pytest.raises(ValueError, match="unique"):
        MathTask(train, held_out=train[:1])


def test_records_task_keeps_rows_and_a_split_of_its_own():
    from echo2p2p.tasks import RecordsTask

    rows = [{"prompt": f"q{i}", "answer": i, "extra": [i]} for i in range(10)]
    task = RecordsTask(rows, eval_size=3)
    held, train = task.problems("eval"), task.problems("train")
    assert len(held) == 3 and len(train) == 7 and task.kind == "custom"
    assert {p.id for p in held} | {p.id for p in train} == {f"row-{i}" for i in range(10)}
    p = held[0]
    assert p.row["prompt"] == p.prompt and p.answer == str(p.row["answer"])
    assert [q.id for q in RecordsTask(rows, eval_size=3).problems("eval")] == [q.id for q in held]


@pytest.mark.parametrize("lines, says", [
    (['{"prompt": "a"}', '{"answer": 1}'], "row 1: needs a 'prompt': non-empty text, or a list of"),
    (['{"prompt": "a"}', 'not json'], "line 2: not valid JSON"),
    (['{"prompt": "a"}', '[1, 2]'], "line 2: expected a JSON object"),
    (['{"prompt": "a"}'], "need at least 2 rows"),
])
def test_records_task_names_the_bad_row(lines, says):
    from echo2p2p.tasks import RecordsTask

    with pytest.raises(ValueError, match=re.escape(says)):
        RecordsTask.from_lines(lines)


def test_an_environment_problems_seed_is_its_answer():
    """`Problem.episode_seed` reads the seed an environment's problem keeps in its answer, and
    refuses a problem whose answer is no number."""
    assert Problem("takeaway-12", "prompt", "12").episode_seed == 12
    with pytest.raises(ValueError):
        Problem("add-1+1", "1+1=", "two").episode_seed
