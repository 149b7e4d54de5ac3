"""The policy's non-weight files, served read-only: what a peer needs besides the weights.

A peer written from `docs/PROTOCOL.md` learns the model's architecture, tokenizer, special
tokens and chat template here: `GET /model/` answers a JSON index, `GET /model/{name}` one file,
byte for byte as the hub loaded it. Weights are never served here: version 0 reaches a peer
through the overlay (a signed manifest and chunks) like every other version.

Only names in `ALLOWED` are ever served, and only the files that were read when the hub
started: a request names a key of an in-memory table, never a path, so no request can reach
another file (no traversal, no symlink swapped in later). Where the directory comes from is the
policy loader's rule (`echo2p2p.policy.model.model_source`): the shipped built-in checkpoint for "tiny", a
local directory, or the snapshot of a Hugging Face hub id in the local cache (never downloaded
here). Knows nothing of tickets: whoever builds the routes passes `authorize`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

# The files a Hugging Face causal LM keeps beside its weights: architecture, generation
# defaults, tokenizer (fast or slow form), special tokens, chat template. Nothing else, ever.
ALLOWED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",  # SentencePiece (Llama, Mistral, Gemma): binary, but a tokenizer
)
MAX_FILE_BYTES = 256 << 20  # a bigger "tokenizer" is not one; it is skipped with a warning
HASH = "blake2b-256"
_TYPES = {".json": "application/json", ".jinja": "text/plain", ".txt": "text/plain"}

Authorize = Callable[[web.Request], bool]


@dataclass(frozen=True)
class ModelFiles:
    """The allowlisted files of one model directory, read once, and facts about its tokens."""

    model: str  # the name the hub trains, as in Welcome.model
    files: Mapping[str, bytes]
    tokens: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: Path, model: str, tokens: Mapping[str, Any] | None = None
             ) -> ModelFiles:
        """Read every allowlisted file present in `directory` (blocking: call in a thread)."""
        files = {}
        for name in ALLOWED:
            path = directory / name
            if not path.is_file():  # follows symlinks: the HF cache links snapshots to blobs
                continue
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                log.warning("not serving %s: %d bytes, over %d", path, size, MAX_FILE_BYTES)
                continue
            files[name] = path.read_bytes()
        if "config.json" not in files:
            log.warning("model %s: no config.json in %s; peers cannot learn its architecture "
                        "from the hub", model, directory)
        return cls(model, files, dict(tokens or {}))

    @classmethod
    def for_model(cls, model: str, tokens: Mapping[str, Any] | None = None) -> ModelFiles:
        """The files of the model the hub trains, `model` as given to `load_policy`."""
        return cls.read(model_dir(model), model, tokens)

    def index(self) -> dict[str, Any]:
        """What GET /model/ answers."""
        return {
            "model": self.model,
            "hash_algo": HASH,
            "files": {name: {"bytes": len(data), "digest": _digest(data)}
                      for name, data in self.files.items()},
            "tokens": dict(self.tokens),
        }


def model_dir(model: str, *, cache_dir: str | None = None) -> Path:
    """The directory `load_policy(model)` loads from; a hub id resolves to its snapshot in the
    local Hugging Face cache (offline; FileNotFoundError if it is not there)."""
    from echo2p2p.policy.model import model_source  # the loader's own rule, so the two never disagree

    source = model_source(model)
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(source, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as exc:
        raise FileNotFoundError(f"model {model!r}: no local directory and no cached snapshot "
                                f"of the hub id: {exc}") from None


def token_facts(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The special tokens as the hub's loader set them (it makes pad = eos when a tokenizer has
    no pad token, which no file says), and the model's vocabulary size (ids at or above it are
    refused at admission)."""
    return {
        "eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_token_id,
        "pad_token": tokenizer.pad_token, "pad_token_id": tokenizer.pad_token_id,
        "bos_token": tokenizer.bos_token, "bos_token_id": tokenizer.bos_token_id,
        "vocab_size": int(vocab_size), "tokenizer_size": len(tokenizer),
    }


def model_routes(files: ModelFiles, authorize: Authorize | None = None
                 ) -> dict[str, Callable[[web.Request], Any]]:
    """GET routes for `serve`: "/model/" (the JSON index) and "/model/{name}" (one file).
    With `authorize`, a request it refuses gets 403; an unknown name gets 404."""
    index = files.index()

    def refused(request: web.Request) -> web.Response | None:
        if authorize is not None and not authorize(request):
            return web.Response(status=403, text="a ticket from this run's hub is required")
        return None

    async def handle_index(request: web.Request) -> web.Response:
        return refused(request) or web.json_response(index)

    async def handle_file(request: web.Request) -> web.Response:
        if (no := refused(request)) is not None:
            return no
        name = request.match_info["name"]
        data = files.files.get(name)  # a table lookup: the name is never a path
        if data is None:
            return web.Response(status=404, text="no such model file")
        return web.Response(body=data, content_type=_TYPES.get(Path(name).suffix,
                                                               "application/octet-stream"))

    return {"/model/": handle_index, "/model/{name}": handle_file}


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()
