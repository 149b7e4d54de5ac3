"""Values that fit the model trained, and where each value of the resolved config came from.

The hub's defaults are the built-in tiny model's (`lr` 1e-3, `max_new_tokens` 8): wrong by
orders of magnitude for a pretrained model. So the fields the user did not set (by flag, TOML
file or Python) are filled, under what they set, by:

- a built-in model's preset (`PRESETS`: one row per built-in name; edit the numbers there);
- for any other model (a local directory, a GGUF file, a hub id in the local cache), values
  derived from its parameter count N, read from its config.json without loading weights
  (`parameter_count`): `derive` states the rule. Toy models (N < 10 M, the built-in's size)
  get the built-in's values, so a saved copy of tiny behaves as tiny does; N >= 10 M gets
  lr = 1e-6 x sqrt(1 B / N), kept within 5e-7 .. 5e-6 (2.7e-6 at 135 M, 1e-6 at 1 B, 5e-7
  from 4 B) and max_new_tokens 256. A model whose size cannot be read keeps the defaults, and
  the resolved config says so.

Precedence, highest first: flag > file > python > preset > derived > default. `fill` applies
it and keeps a source per field ("flag", "file PATH", "python", "preset NAME", "derived (...)",
"default", "default (demo)"); `sources_table` prints the resolved config with them (logged as
a hub starts, and by `echo2-hub serve --print-config`), and `write_sources` saves them in the
run directory as config_sources.json.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from echo2p2p import config as configs

from .config import HubConfig

log = logging.getLogger(__name__)


# Built-in model name -> the values that fit it. The lead tunes these by experiment.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"lr": 1e-3, "max_new_tokens": 8, "task": "addition"},
    "tiny-takeaway": {"lr": 1e-3, "max_new_tokens": 8},
    "smollm2-135m": {  # SmolLM2-135M-Instruct: 134.5 M parameters, a chat model. Measured
        # (docs/benchmarks.md, "Post-training a real model"): greedy held-out 0.14 -> 0.35 in 4
        # steps on 2 CPU cores; answers are a few tokens, T = 0.7 keeps enough groups mixed.
        "lr": 2e-5, "max_new_tokens": 32, "temperature": 0.7, "group_size": 8,
        "prompts_per_step": 8, "learner_precision": "fp32",
        "task": "rg:chain_sum",
        "task_args": '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}',
        "eval_every": 4, "eval_problems": 200,
    },
}
# A preset's task comes as one: only when the user named no task, dataset nor environment.
TASK_FIELDS = ("task", "task_args")
NAMES_WHAT_TO_TRAIN_ON = ("task", "dataset", "env")

TOY_PARAMS = 10_000_000  # below: a toy model like the built-in, given the built-in's values
TOY_VALUES = {"lr": 1e-3, "max_new_tokens": 8}
LR_AT_1B, LR_LEAST, LR_MOST = 1e-6, 5e-7, 5e-6
MAX_NEW_TOKENS = 256  # for N >= TOY_PARAMS
DEFAULT, DEMO_DEFAULT = "default", "default (demo)"


def derive(params: int) -> dict[str, Any]:
    """lr and max_new_tokens for a model of `params` parameters (the rule in the module doc)."""
    if params < TOY_PARAMS:
        return dict(TOY_VALUES)
    lr = min(LR_MOST, max(LR_LEAST, LR_AT_1B * math.sqrt(1e9 / params)))
    return {"lr": float(f"{lr:.2g}"), "max_new_tokens": MAX_NEW_TOKENS}


def parameter_count(config: Mapping[str, Any]) -> int | None:
    """About how many parameters a model with this config.json has (decoder transformer:
    embeddings, attention with grouped KV heads and a gated MLP per layer, experts counted in
    full, RMS norms; exact for Llama, no biases); None if it lacks the sizes."""
    c = config.get("text_config") or config
    h = c.get("hidden_size") or c.get("n_embd") or c.get("d_model")
    layers = c.get("num_hidden_layers") or c.get("n_layer") or c.get("num_layers")
    vocab = c.get("vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (h, layers, vocab)):
        return None
    heads = c.get("num_attention_heads") or c.get("n_head") or 1
    head_dim = c.get("head_dim") or h // heads
    kv = (c.get("num_key_value_heads") or heads) * head_dim
    inter = c.get("moe_intermediate_size") or c.get("intermediate_size") or c.get("n_inner") or 4 * h
    experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 1
    attention = 2 * h * heads * head_dim + 2 * h * kv
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", True) else 2)
    norms = (2 * layers + 1) * h
    return int(embeddings + layers * (attention + 3 * h * inter * experts) + norms)


def model_size(model: str) -> tuple[int | None, str]:
    """The parameter count of a model that is not built in, read without loading weights, and
    where it was read (or why it could not be)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        try:
            return gguf_parameter_count(path), f"{path.name}'s tensors"
        except (OSError, ValueError, struct.error) as exc:
            return None, f"cannot read {path}: {exc}"
    file = path / "config.json"
    if not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None, f"no directory {model}"
        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a hub id either
            cached = None
        if not isinstance(cached, str):
            return None, f"no directory {model}, nor its config.json in the Hugging Face cache"
        file = Path(cached)
    try:
        params = parameter_count(json.loads(file.read_text()))
    except (OSError, ValueError, AttributeError) as exc:
        return None, f"cannot read {file}: {exc}"
    return params, "config.json" if params else "config.json gives no sizes"


# GGUF metadata value types -> struct format of a scalar (8: string, 9: array, read apart)
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                11: "q", 12: "d"}


def gguf_parameter_count(path: Path) -> int:
    """The elements of every tensor of a GGUF file (v2/v3), read from its header alone: the
    gguf package's reader maps every tensor and token first (seconds for a small model)."""
    with path.open("rb") as f:
        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(read("Q"), 1)
            elif kind == 9:
                inner, count = read("I"), read("Q")
                if inner in GGUF_SCALARS:
                    f.seek(count * struct.calcsize(GGUF_SCALARS[inner]), 1)
                else:
                    for _ in range(count):
                        skip(inner)
            elif kind in GGUF_SCALARS:
                f.seek(struct.calcsize(GGUF_SCALARS[kind]), 1)
            else:
                raise ValueError(f"unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF" or read("I") < 2:
            raise ValueError("not a GGUF file of version 2 or later")
        tensors, keys = read("Q"), read("Q")
        for _ in range(keys):
            f.seek(read("Q"), 1)  # the key
            skip(read("I"))
        total = 0
        for _ in range(tensors):
            f.seek(read("Q"), 1)  # the name
            total += math.prod(read("Q") for _ in range(read("I")))
            f.seek(4 + 8, 1)  # its type and offset
        return total


def flatten(table: Mapping[str, Any]) -> dict[str, Any]:
    """A table of flat field names and [SECTION] tables as flat names (dashes as underscores)."""
    parts, flat = configs.sections(HubConfig), {}
    for key, value in table.items():
        if key in parts and isinstance(value, Mapping):
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    return flat


def fill(given: Mapping[str, Any], sources: Mapping[str, str],
         defaults: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The table to resolve and every field's source: `given` (flat, or with section tables),
    set by the user, each from `sources` (a key not in it: "python"); under it the model's
    preset or derived values; under those `defaults` (the demo's), then the fields' own."""
    table = flatten(given)
    where = {k: sources.get(k, "python") for k in table}
    fields = configs.owners(HubConfig)
    model = str(table.get("model", HubConfig().run.model))
    below = {k: (v, DEMO_DEFAULT) for k, v in (defaults or {}).items()}
    if model in PRESETS:
        preset = dict(PRESETS[model])
        if any(k in table for k in NAMES_WHAT_TO_TRAIN_ON):
            preset = {k: v for k, v in preset.items() if k not in TASK_FIELDS}
        below.update({k: (v, f"preset {model}") for k, v in preset.items() if k in fields})
    else:
        params, read = model_size(model)
        if params is None:
            note = f"{DEFAULT} (the built-in tiny model's: {read}, so not derived)"
            below.update({k: (v, note) for k, v in TOY_VALUES.items()})
        else:
            note = f"derived ({params / 1e6:.1f} M parameters, from {read})"
            below.update({k: (v, note) for k, v in derive(params).items()})
    for key, (value, source) in below.items():
        if key not in table:
            table[key], where[key] = value, source
    return table, where


def all_sources(cfg: HubConfig, sources: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every field's source: as `sources` says, else "default" where it has the default value,
    else "python" (a config built in code)."""
    defaults = configs.as_dict(HubConfig())
    return {k: (sources or {}).get(k) or (DEFAULT if v == defaults[k] else "python")
            for k, v in configs.as_dict(cfg).items()}


def sources_table(cfg: HubConfig, sources: Mapping[str, str], *, full: bool = False) -> str:
    """The resolved config, one field a line: name, value, source. Unless `full`, the fields
    at their plain default are summed up in one line."""
    from .config import SECRETS

    values, rows, plain = configs.as_dict(cfg), [], 0
    for key, value in values.items():
        source = sources.get(key, DEFAULT)
        if source == DEFAULT and not full:
            plain += 1
            continue
        shown = "***" if key in SECRETS and value else repr(value)
        rows.append(f"  {key:<28} {shown:<24} {source}")
    if plain:
        rows.append(f"  ({plain} more at their defaults: echo2-hub serve --print-config lists all)")
    return "resolved config (field, value, source):\n" + "\n".join(rows)


def write_sources(run_dir: Path, sources: Mapping[str, str]) -> None:
    """config_sources.json in the run directory, next to config.json; a warning if the tiny
    model's lr or max_new_tokens stand for a model whose size could not be read."""
    (run_dir / "config_sources.json").write_text(json.dumps(dict(sources), indent=2) + "\n")
    guessed = [k for k, s in sources.items() if s.startswith(f"{DEFAULT} (the built-in")]
    if guessed:
        log.warning("%s: the built-in tiny model's values, which rarely fit another model; "
                    "set them (%s)", ", ".join(guessed), sources[guessed[0]])
