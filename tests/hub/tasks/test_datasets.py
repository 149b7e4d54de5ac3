"""Datasets as tasks: real parquet, JSONL and arrow files and a local Hugging Face cache, read by
the hub with `datasets`; bad input is one ConfigError naming the fix; and a real hub leasing a
dataset's prompts through a chat template sends the ids the template renders."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

datasets = pytest.importorskip("datasets")

from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.tasks.dataset_task import open_dataset_task
from echo2p2p.hub.run.start import start_hub
from echo2p2p.hub.tasks.task_setup import open_task
from echo2p2p.policy.engines import TransformersEngine

from tests.conftest import running_peers
from tests.echo2p2p.policy.test_prompts import QWEN3_STYLE_TEMPLATE


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` writes an arrow copy of what it reads under its cache: keep it in tmp_path."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


def gsm8k_rows(n: int, start: int = 0) -> dict[str, list]:
    """GSM8K's shape: a question, and a worked answer ending in "#### <number>"."""
    rows = [(f"Tom has {a} apples and buys {a + 1} more. How many now?",
             f"{a} + {a + 1} = <<{a}+{a + 1}={2 * a + 1}>>{2 * a + 1}\n#### {2 * a + 1}")
            for a in range(start, start + n)]
    return {"question": [q for q, _ in rows], "answer": [a for _, a in rows]}


def math_rows(n: int) -> dict[str, list]:
    """MATH's shape: a problem and a solution whose last \\boxed{} is the answer."""
    return {"problem": [f"Simplify $\\frac{{{2 * k}}}{{{4 * k}}}$." for k in range(1, n + 1)],
            "solution": [f"Divide by {2 * k}: $\\boxed{{\\frac{{1}}{{2}}}}$." for k in range(1, n + 1)],
            "level": ["Level 1"] * n}


def cfg_for(path, **fields) -> HubConfig:
    return HubConfig.from_flat(dataset=str(path), eval_problems=5, seed=3, **fields)


def test_parquet_gsm8k_file_is_a_task(tmp_path):
    """A GSM8K-style parquet file: answers extracted after ####, eval rows held out of train,
    rewards by math-verify, and open_task picks the dataset over the built-in task."""
    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_dict(gsm8k_rows(30)).to_parquet(str(path))
    task = open_task(cfg_for(path, answer_format="gsm8k"))
    train, held = task.problems("train"), task.problems("eval")
    assert task.kind == "math" and (len(train), len(held)) == (25, 5)
    assert not {p.id for p in train} & {p.id for p in held}
    by_id = {p.id: p for p in [*train, *held]}
    assert by_id["train-4"].answer == "9" and "Tom has 4 apples" in by_id["train-4"].prompt
    assert task.reward("9", "4 + 5 = 9, so \\boxed{9}") == 1.0
    assert task.reward("9", "\\boxed{10}") == 0.0


def test_jsonl_math_file_with_a_field_mapping(tmp_path):
    """A MATH-style JSONL file, problem/solution fields: the last \\boxed{} is the gold answer."""
    path = tmp_path / "math.jsonl"
    datasets.Dataset.from_dict(math_rows(12)).to_json(str(path))
    task = open_dataset_task(cfg_for(path, dataset_question_field="problem",
                                     dataset_answer_field="solution", answer_format="math").tasks)
    problems = [*task.problems("train"), *task.problems("eval")]
    assert len(problems) == 12 and {p.answer for p in problems} == {"\\frac{1}{2}"}
    assert task.reward("\\frac{1}{2}", "It is \\boxed{0.5}") == 1.0


def test_arrow_files_and_saved_folders_with_an_eval_split(tmp_path):
    """A save_to_disk folder with train and test splits (test held out whole), and one .arrow
    file of a saved split read on its own."""
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(gsm8k_rows(20)),
                          "test": datasets.Dataset.from_dict(gsm8k_rows(4, start=100))}
                         ).save_to_disk(str(folder))
    task = open_dataset_task(cfg_for(folder, dataset_eval_split="test").tasks)
    assert len(task.problems("train")) == 20
    assert [p.answer for p in task.problems("eval")] == ["201", "203", "205", "207"]
    (arrow,) = (folder / "train").glob("*.arrow")
    single = open_dataset_task(cfg_for(arrow).tasks)
    assert len(single.problems("train")) + len(single.problems("eval")) == 20


def test_a_dataset_name_resolves_in_the_local_hub_cache(tmp_path):
    """"org/name" with a config, as openai/gsm8k's README declares them, from the local Hugging
    Face cache only."""
    cache = tmp_path / "hub-cache"
    revision = "0" * 40
    snapshot = cache / "datasets--org--tiny-gsm8k" / "snapshots" / revision
    (snapshot / "main").mkdir(parents=True)
    (cache / "datasets--org--tiny-gsm8k" / "refs").mkdir()
    (cache / "datasets--org--tiny-gsm8k" / "refs" / "main").write_text(revision)
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
        "    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n")
    datasets.Dataset.from_dict(gsm8k_rows(10)).to_parquet(str(snapshot / "main" / "train-0.parquet"))
    datasets.Dataset.from_dict(gsm8k_rows(3, 50)).to_parquet(str(snapshot / "main" / "test-0.parquet"))
    cfg = HubConfig.from_flat(dataset="org/tiny-gsm8k", dataset_config="main", dataset_eval_split="test")
    task = open_dataset_task(cfg.tasks, cache_dir=str(cache))
    assert len(task.problems("train")) == 10
    assert [p.answer for p in task.problems("eval")] == ["101", "103", "105"]
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache|nor a dataset in "
                                          "the local Hugging Face cache.*hf download") as err:
        open_dataset_task(HubConfig.from_flat(dataset="org/absent").tasks, cache_dir=str(cache))
    assert err.value.field == "dataset"


@pytest.fixture
def parquet(tmp_path):
    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_dict(gsm8k_rows(10)).to_parquet(str(path))
    return path


@pytest.mark.parametrize("fields, field, message", [
    ({"dataset_question_field": "prompt"}, "dataset_question_field",
     "no column 'prompt'; its columns: question, answer"),
    ({"dataset_answer_field": "solution"}, "dataset_answer_field",
     "no column 'solution'; its columns: question, answer"),
    ({"dataset_split": "validation"}, "dataset_split", "no split 'validation'; its splits: train"),
    ({"dataset_eval_split": "test"}, "dataset_eval_split", "no split 'test'; its splits: train"),
    ({"answer_format": "math"}, "answer_format", "no usable row.*'answer'.*'math'"),
])
def test_a_wrong_mapping_names_what_the_dataset_has(parquet, fields, field, message):
    """A column or split that is not there names the ones that are; a format that finds no
    answer in any row names the fields and the format."""
    with pytest.raises(ConfigError, match=message) as err:
        open_dataset_task(cfg_for(parquet, **fields).tasks)
    assert err.value.field == field


def test_missing_files_and_missing_datasets_library(tmp_path, parquet, monkeypatch):
    """A file that is not there, a file of a kind `datasets` does not read, a config naming the
    task twice, and no `datasets` installed: each one sentence naming the fix."""
    with pytest.raises(ConfigError, match="no such file or folder"):
        open_dataset_task(cfg_for(tmp_path / "absent.parquet").tasks)
    (tmp_path / "rows.xlsx").write_bytes(b"PK")
    with pytest.raises(ConfigError, match="not a file `datasets` reads.*\\.parquet"):
        open_dataset_task(cfg_for(tmp_path / "rows.xlsx").tasks)
    with pytest.raises(ConfigError, match="both name the task"):
        HubConfig.from_flat(dataset=str(parquet), task="examples/sums.jsonl")
    with pytest.raises(ConfigError, match="another split"):
        HubConfig.from_flat(dataset=str(parquet), dataset_eval_split="train")
    with pytest.raises(ConfigError, match="only applies with --dataset"):
        HubConfig.from_flat(dataset_eval_split="test")
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without it does
    with pytest.raises(ConfigError, match=r"pip install 'echo2p2p\[data\]'") as err:
        open_dataset_task(cfg_for(parquet).tasks)
    assert err.value.field == "dataset"


class RecordingEngine:
    """The real engine, keeping the prompt ids of every lease it generates for."""

    def __init__(self, model_dir: str):
        self.inner = TransformersEngine(model_dir)
        self.tokenizer = self.inner.tokenizer
        self.prompt_ids: list[list[int]] = []

    def load_weights(self, state):
        self.inner.load_weights(state)

    def generate(self, prompt_ids, n, **kw):
        self.prompt_ids.append(list(prompt_ids))
        return self.inner.generate(prompt_ids, n, **kw)


async def test_a_real_hub_leases_the_chat_rendered_ids_of_a_dataset(hub_cfg, tmp_path):
    """Hub with a chat-template model on a parquet dataset: the leases a peer receives carry
    exactly the ids the template renders (system prompt, thinking off), and training runs."""
    from echo2p2p.policy.model import load_policy

    model, tokenizer = load_policy("tiny")
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_dict(gsm8k_rows(16)).to_parquet(str(path))
    cfg = hub_cfg.replace(model=str(tmp_path / "model"), dataset=str(path), eval_problems=4,
                  eval_every=1, max_steps=1, prompt_format="chat", system_prompt="Be brief.",
                  chat_template_args=json.dumps({"enable_thinking": False}))
    engine = RecordingEngine(str(tmp_path / "model"))
    async with start_hub(cfg, stream=None) as run, running_peers(run.url, 1, engines=[engine]):
        await asyncio.wait_for(run.finished.wait(), 120)
    tok = engine.tokenizer
    rendered = {}
    for p in run.hub.setup.task.problems("train"):
        ids = tok.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": p.prompt}],
            add_generation_prompt=True, return_dict=False, enable_thinking=False)
        rendered[tuple(ids)] = p
    assert engine.prompt_ids and all(tuple(ids) in rendered for ids in engine.prompt_ids)
    text = tok.decode(engine.prompt_ids[0])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTom has ")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert [r["step"] for r in run.records if "step" in r] == [0]
    assert any("eval/accuracy" in r for r in run.records)


async def test_chat_on_a_tokenizer_without_a_template_fails_before_serving(hub_cfg):
    """prompt_format = "chat" on the built-in model (no template): start_hub raises the one
    ConfigError naming prompt_format, before it listens."""
    with pytest.raises(ConfigError, match="'chat' needs a chat template.*'tiny'") as err:
        async with start_hub(hub_cfg.replace(prompt_format="chat"), stream=None):
            pytest.fail("the hub served")
    assert err.value.field == "prompt_format"
