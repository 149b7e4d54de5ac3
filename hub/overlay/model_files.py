"""The policy's non-weight files, served read-only and signed: what a peer needs besides weights.

A peer learns the model's architecture, tokenizer, special tokens and chat template here, from
the hub URL alone: `GET /model/` answers the index (`echo2p2p.model_index`: canonical JSON
listing each file's size and digest), `GET /model/{name}` one file, byte for byte as the hub
loaded it. The welcome carries the index's digest and the hub's signature over it
(`ModelFiles.signed`), so a peer can verify every byte it fetches. Weights are never served
here: version 0 reaches a peer through the overlay (a signed manifest and chunks) like every
other version.

Only names in `ALLOWED` are ever served, and only the files that were read when the hub
started: a request names a key of an in-memory table, never a path, so no request can reach
another file (no traversal, no symlink swapped in later). A directory without config.json or a
tokenizer file is refused at start-up (ConfigError on "model"). Where the directory comes from
is the policy loader's rule (`echo2p2p.policy.model.model_source`): the shipped built-in
checkpoint for "tiny", a local directory, the snapshot of a Hugging Face hub id in the local
cache (never downloaded here), or for a GGUF file (a path, or the built-in "smollm2-135m") the
directory it was converted into once, so peers get plain model files and never read GGUF.
Knows nothing of tickets: whoever builds the routes passes `authorize`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from echo2p2p import signing
from echo2p2p.errors import ConfigError
from echo2p2p.model_index import (ALLOWED, MAX_FILE_BYTES, MAX_TOTAL_BYTES, TOKENIZER_FILES,
                                  encode_index, index_digest, index_of)

log = logging.getLogger(__name__)

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
        """Read every allowlisted file present in `directory` (blocking: call in a thread).
        ConfigError on "model" if it lacks config.json or every tokenizer file, or if the
        files are more than a peer accepts."""
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
        fix = ("point --model at a directory written by save_pretrained (the model's and the "
               "tokenizer's), a GGUF file, or a built-in name")
        if "config.json" not in files:
            raise ConfigError("model", f"{model!r} ({directory}) has no config.json, so peers "
                                       f"cannot build its architecture: {fix}")
        if not set(files) & set(TOKENIZER_FILES):
            raise ConfigError("model", f"{model!r} ({directory}) has no tokenizer file (one of "
                                       f"{', '.join(TOKENIZER_FILES)}): {fix}")
        if (total := sum(map(len, files.values()))) > MAX_TOTAL_BYTES:
            raise ConfigError("model", f"{model!r}: its config and tokenizer files total {total}"
                                       f" bytes, over the {MAX_TOTAL_BYTES} a peer accepts")
        return cls(model, files, dict(tokens or {}))

    @classmethod
    def for_model(cls, model: str, tokens: Mapping[str, Any] | None = None) -> ModelFiles:
        """The files of the model the hub trains, `model` as given to `load_policy`; a model
        that resolves to no directory is a ConfigError on "model"."""
        try:
            directory = model_dir(model)
        except FileNotFoundError as exc:
            raise ConfigError("model", str(exc)) from None
        return cls.read(directory, model, tokens)

    def with_tokens(self, tokens: Mapping[str, Any]) -> ModelFiles:
        """The same files with the token facts of the loaded tokenizer (`token_facts`)."""
        return dataclasses.replace(self, tokens=dict(tokens))

    def index(self) -> dict[str, Any]:
        """What GET /model/ answers, as a map."""
        return index_of(self.model, self.files, self.tokens)

    def index_bytes(self) -> bytes:
        """What GET /model/ answers, byte for byte (the canonical encoding)."""
        return encode_index(self.index())

    def signed(self, private_key: bytes) -> tuple[bytes, bytes]:
        """(digest, signature) of the index, for the welcome: the signature is b"" for a hub
        without a signing key (a bench rig)."""
        digest = index_digest(self.index_bytes())
        return digest, signing.sign_model_files(private_key, digest) if private_key else b""


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
    except HFValidationError:
        raise FileNotFoundError(f"{model!r} is not a built-in name, a local directory or "
                                f"file, or a Hugging Face id (org/name)") from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{model!r}: no local directory of that name, and no "
                                f"snapshot of the Hugging Face id in the local cache (the hub "
                                f"does not download: run `hf download {model}` first)") from None


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
    index = files.index_bytes()  # encoded once: its digest is what the welcome carries
    table = dict(files.files)  # what the index lists, fixed now

    def refused(request: web.Request) -> web.Response | None:
        if authorize is not None and not authorize(request):
            return web.Response(status=403, text="a ticket from this run's hub is required")
        return None

    async def handle_index(request: web.Request) -> web.Response:
        return refused(request) or web.Response(body=index, content_type="application/json")

    async def handle_file(request: web.Request) -> web.Response:
        if (no := refused(request)) is not None:
            return no
        name = request.match_info["name"]
        data = table.get(name)  # a table lookup: the name is never a path
        if data is None:
            return web.Response(status=404, text="no such model file")
        return web.Response(body=data, content_type=_TYPES.get(Path(name).suffix,
                                                               "application/octet-stream"))

    return {"/model/": handle_index, "/model/{name}": handle_file}

