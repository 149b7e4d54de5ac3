"""Datasets in TRL's formats (a "prompt" column: text, or conversational messages) train as they
are, every column reaching the reward functions, ours or TRL's (`trl.rewards`)."""

from __future__ import annotations

import json

import pytest

from echo2p2p.errors import ConfigError
from echo2p2p.hub import Run
from echo2p2p.hub.run.start import start_hub
from echo2p2p.tasks import RecordsTask

from tests.conftest import running_peers


def said_the_answer(completions, answer, **kwargs):
    """A TRL reward of the conversational format: the assistant's reply is the row's answer."""
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]


def sums(n: int) -> list[dict]:
    """The built-in model's sums as conversational rows, with TRL's `solution` column too."""
    return [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b),
             "solution": f"${a + b}$"} for a in range(10, 10 + n) for b in (3, 7)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_conversational_dataset_file_is_rows_scored_by_trls_own_reward(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", sums(20))
    setup = Run(dataset=path, reward="trl.rewards:accuracy_reward", eval_problems=8).setup()
    assert isinstance(setup.task, RecordsTask) and setup.kind == "custom"
    problem = setup.task.problems("train")[0]
    assert problem.messages == problem.row["prompt"] and problem.prompt.endswith("=")
    right = problem.row["solution"].strip("$")
    assert setup.reward(problem, f"It is $\\boxed{{{right}}}$") == 1.0
    assert setup.reward(problem, "It is $\\boxed{0}$") == 0.0


def test_a_saved_dataset_holds_out_its_evaluation_split(tmp_path):
    """A `datasets.DatasetDict` on disk in TRL's standard format (text prompts): every train row
    is trained on, the named split is what is held out."""
    import datasets

    rows = [{"prompt": f"{a}+3=", "answer": str(a + 3)} for a in range(10, 30)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:14]),
                          "test": datasets.Dataset.from_list(rows[14:])}
                         ).save_to_disk(tmp_path / "sums")
    task = Run(dataset=tmp_path / "sums", dataset_eval_split="test").setup().task
    assert sorted(p.prompt for p in task.problems("eval")) == sorted(r["prompt"] for r in rows[14:])
    assert len(task.problems("train")) == 14 and task.problems("train")[0].messages is None


def test_a_dataset_in_trls_format_needs_a_reward_unless_it_has_answers(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "answer"} for r in sums(4)]
    with pytest.raises(ConfigError, match="give --reward") as err:
        Run(dataset=write_jsonl(tmp_path / "no_answer.jsonl", rows)).setup()
    assert err.value.field == "reward"
    setup = Run(dataset=write_jsonl(tmp_path / "answers.jsonl", sums(4))).setup()
    assert setup.reward(setup.task.problems("train")[0], "nope") == 0.0  # exact_match


def test_a_malformed_conversation_names_its_row(tmp_path):
    rows = sums(2) + [{"prompt": [{"role": "user"}], "answer": "1"}]
    with pytest.raises(ConfigError, match="row 4: a conversational 'prompt'") as err:
        Run(dataset=write_jsonl(tmp_path / "bad.jsonl", rows)).setup()
    assert err.value.field == "dataset"


@pytest.mark.timeout(300)
async def test_a_trl_reward_on_conversational_rows_trains_a_real_run(tmp_path):
    """The built-in model on conversational rows (rendered as their text: it has no chat
    template) with a TRL-signature reward: peers claim nothing, the hub's workers score, and
    the steps train on those rewards."""
    run = Run(dataset=sums(30), reward=said_the_answer, port=0, prompts_per_step=4, group_size=4,
              eval_every=0, max_steps=3, run_dir=str(tmp_path / "run"), torch_threads=1)
    async with start_hub(run.config, setup=run.setup()) as hub_run, \
            running_peers(hub_run.url, 1, torch_threads=1):
        await hub_run.finished.wait()
    steps = [r for r in hub_run.records if "step" in r]
    assert len(steps) == 3 and steps[-1]["hub/score_failures_total"] == 0
    assert any(r["train/reward_mean"] > 0 for r in steps)  # the base model adds well
