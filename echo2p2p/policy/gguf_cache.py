"""GGUF files as model directories: each file converted once, cached under its digest.

`converted_dir(path)` is `<root>/models/gguf-<first 16 hex of the file's sha256>`, root being
$ECHO2_CACHE_DIR or ~/.cache/echo2p2p. The first call converts: transformers' GGUF loader reads
the file (dequantised to fp32), its weights are copied into a plain model of the same config
(transformers refuses to save a GGUF-quantized model), and that model (fp32 safetensors), its
generation config and the tokenizer (chat template included) are saved into a temporary
directory beside the entry, with SOURCE naming the file and its full digest, then renamed into
place. So an entry exists only whole: a crash leaves a temporary (never read as an entry), and
of two processes converting at once the first rename wins and the other discards its copy.
Later calls hash the file and return the entry: the digest keys the content, so a copy
elsewhere shares the entry and an edited file gets a new one. The entry is a model directory
like any other: the hub loads it and serves its files to peers, who never read GGUF.
Needs the `gguf` and `accelerate` packages (`pip install 'echo2p2p[real]'`), imported only here
and only when a file is converted.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)

MAGIC = b"GGUF"  # the first four bytes of every GGUF file
CACHE_ENV = "ECHO2_CACHE_DIR"
SOURCE = "gguf-source.json"  # written last into an entry; not a model file, never served
REAL_EXTRA = "pip install 'echo2p2p[real]' (in a checkout: pip install -e '.[real]')"


def cache_root() -> Path:
    """Where echo2p2p caches what it makes: $ECHO2_CACHE_DIR, else ~/.cache/echo2p2p."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "echo2p2p").expanduser()


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as a GGUF file does."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def file_sha256(path: Path) -> str:
    """The hex sha256 of the file at `path`, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def converted_dir(gguf: Path) -> Path:
    """The model directory converted from the GGUF file `gguf`, in the cache: converted now
    unless already there. ConfigError on "model" for a file that is not GGUF, missing packages
    or a cache that cannot be written."""
    gguf = Path(gguf)
    if not is_gguf(gguf):
        raise ConfigError("model", f"{gguf} is a file but not a GGUF file (it does not start "
                                   "with the GGUF magic): give a .gguf file, a model directory "
                                   "written by save_pretrained, a built-in name or a hub id")
    digest = file_sha256(gguf)
    entry = cache_root() / "models" / f"gguf-{digest[:16]}"
    if finished(entry, digest):
        return entry
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError("model", f"reading the GGUF file {gguf.name} needs "
                                   f"{' and '.join(missing)}: {REAL_EXTRA}")
    log.info("converting %s into %s (once, under a minute)", gguf.name, entry)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    except OSError as exc:
        raise ConfigError("model", f"cannot write the model cache {entry.parent} "
                                   f"({exc.strerror}): set {CACHE_ENV} to a writable "
                                   "directory") from None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the entry is as readable as the cache
        convert(gguf, tmp)
        (tmp / SOURCE).write_text(json.dumps({"gguf": gguf.name, "sha256": digest}) + "\n")
        install_entry(tmp, entry, lambda e: finished(e, digest))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


def finished(entry: Path, digest: str) -> bool:
    """Whether `entry` is a whole conversion of the file whose sha256 is `digest`."""
    try:
        return json.loads((entry / SOURCE).read_text()).get("sha256") == digest
    except (OSError, ValueError, AttributeError):
        return False


def install_entry(tmp: Path, entry: Path, whole: Callable[[Path], bool]) -> None:
    """Rename the finished directory `tmp` into place as the cache entry `entry` (this cache's,
    and the peer's model-files cache's). A damaged entry there (not `whole`) is replaced; a whole
    one another process installed meanwhile is kept (and `tmp` left to the caller)."""
    if entry.exists() and not whole(entry):
        stale = tmp.with_name(tmp.name + ".stale")
        os.rename(entry, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, entry)
    except OSError:
        if not whole(entry):  # not another process that won the race: a failure
            raise


def convert(gguf: Path, out: Path) -> None:
    """Save the model in `gguf` into `out` as save_pretrained writes a model directory: config,
    generation config, fp32 safetensors, tokenizer and chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with quiet_loader(gguf.name):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32)
        # The loaded model carries a GGUF quantization_config, and save_pretrained refuses a
        # quantized model: the same architecture without it takes the (dequantised) weights,
        # built on the meta device (no random init) and given the loaded tensors themselves.
        config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                         if k != "quantization_config"})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), assign=True)  # strict: every key matches
        model.generation_config = loaded.generation_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


@contextlib.contextmanager
def quiet_loader(label: str):
    """One bar of ours while transformers reads a GGUF file, none of its own: its bars follow
    its switch, off for the duration; the GGUF reader's tqdm over the file's tensors (where the
    conversion's time goes: each is dequantised) is a plain one, so it is swapped for ours
    (`echo2p2p.runtime.progress.count_bar`: "converting `label`", tensors done of all, on a
    terminal only) for the duration (a module attribute, restored after)."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    from ..runtime.progress import count_bar

    def bar(iterable: Any, *args: Any, **kwargs: Any) -> Any:  # the reader's call: (tensors, desc=)
        return count_bar(None, f"converting {label}", "tensor", iterable=iterable)

    bars, plain = hf_logging.is_progress_bar_enabled(), reader.tqdm
    hf_logging.disable_progress_bar()
    reader.tqdm = bar
    try:
        yield
    finally:
        reader.tqdm = plain
        if bars:
            hf_logging.enable_progress_bar()
