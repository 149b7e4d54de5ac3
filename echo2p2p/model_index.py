"""The model-files index: which non-weight files make up the run's model, byte for byte.

The hub publishes the model's config, generation config and tokenizer files (`ALLOWED`) as
one JSON index, encoded canonically (`encode_index`), hashed (`index_digest`) and signed by
the hub's key (`echo2p2p.signing.sign_model_files`); the welcome carries the digest and the
signature, so a peer that checks both may take the index (and then each file, by its digest)
from any server. `parse_index` is what a peer applies to an index it received: every name in
the allowlist, every size and the total within the bounds below, every digest well formed.
Pure: bytes in, values out; no files, no sockets (the hub's `model_files` reads the directory,
the peer's `model_files` downloads and caches).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import SnapshotError

# The files a Hugging Face causal LM keeps beside its weights: architecture, generation
# defaults, tokenizer (fast or slow form), special tokens, chat template. Nothing else, ever:
# a peer writes these names into a directory, so no other name (no path) is ever accepted.
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
# A model directory needs its architecture and one of these to be loadable without the hub.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
HASH = "blake2b-256"
# Bounds a peer holds any index to (a hub publishes nothing past them). The largest real
# tokenizers are tens of MB (Gemma's tokenizer.json is 33 MB); an index of 12 entries is ~2 KB.
MAX_FILES = len(ALLOWED)
MAX_FILE_BYTES = 256 << 20
MAX_TOTAL_BYTES = 256 << 20
MAX_INDEX_BYTES = 64 << 10
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    """One file of the index: its name (one of ALLOWED), size and hex blake2b-256 digest."""

    name: str
    nbytes: int
    digest: str


@dataclass(frozen=True)
class ModelIndex:
    """A parsed index: the model's name (for logs only: never a path), its files, and the
    token facts the hub's loader uses (docs/protocol/scoring.md, section 9)."""

    model: str
    files: tuple[FileEntry, ...]
    tokens: Mapping[str, Any]

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)


def file_digest(data: bytes) -> str:
    """The hex blake2b-256 digest the index lists for a file."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def index_digest(index_bytes: bytes) -> bytes:
    """The raw 32-byte blake2b-256 digest of an encoded index: what the welcome carries."""
    return hashlib.blake2b(index_bytes, digest_size=32).digest()


def index_of(model: str, files: Mapping[str, bytes], tokens: Mapping[str, Any]) -> dict:
    """The index of `files` (name -> bytes) as a JSON-ready map."""
    return {
        "model": model,
        "hash_algo": HASH,
        "files": {name: {"bytes": len(data), "digest": file_digest(data)}
                  for name, data in sorted(files.items())},
        "tokens": dict(tokens),
    }


def encode_index(index: Mapping[str, Any]) -> bytes:
    """The canonical bytes of an index: JSON, keys sorted, no spaces, ASCII only. A peer hashes
    the bytes it received, never a re-encoding, so only the hub ever runs this."""
    return json.dumps(index, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def parse_index(data: bytes) -> ModelIndex:
    """The index in `data`, held to the bounds; SnapshotError naming what is wrong."""
    if len(data) > MAX_INDEX_BYTES:
        raise SnapshotError(f"model index of {len(data)} bytes, over the {MAX_INDEX_BYTES} "
                            "a peer accepts")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise SnapshotError("model index is not JSON") from None
    if not isinstance(raw, dict) or raw.get("hash_algo") != HASH:
        raise SnapshotError(f"model index must be a JSON object with hash_algo {HASH!r}")
    model, files, tokens = raw.get("model"), raw.get("files"), raw.get("tokens", {})
    if not isinstance(model, str) or not isinstance(files, dict) or not isinstance(tokens, dict):
        raise SnapshotError("model index needs a string model, a files map and a tokens map")
    if len(files) > MAX_FILES:
        raise SnapshotError(f"model index lists {len(files)} files, over the {MAX_FILES} a "
                            "peer accepts")
    entries = tuple(_entry(name, files[name]) for name in sorted(files))
    total = sum(e.nbytes for e in entries)
    if total > MAX_TOTAL_BYTES:
        raise SnapshotError(f"model files total {total} bytes, over the {MAX_TOTAL_BYTES} a "
                            "peer accepts")
    names = {e.name for e in entries}
    if "config.json" not in names or not names & set(TOKENIZER_FILES):
        raise SnapshotError("model index lacks config.json or a tokenizer file "
                            f"({', '.join(TOKENIZER_FILES)})")
    return ModelIndex(model, entries, tokens)


# `name`, `raw`: the index's JSON as the hub sent it, hostile until checked here.
def _entry(name: Any, raw: Any) -> FileEntry:
    if name not in ALLOWED:  # also refuses any path: a peer writes this name to its disk
        raise SnapshotError(f"model index names {str(name)[:64]!r}, not an allowed model file")
    if not isinstance(raw, dict):
        raise SnapshotError(f"model index entry for {name} is not a map")
    nbytes, digest = raw.get("bytes"), raw.get("digest")
    if type(nbytes) is not int or not 0 <= nbytes <= MAX_FILE_BYTES:
        raise SnapshotError(f"model file {name}: size {str(nbytes)[:32]} is not within 0 to "
                            f"{MAX_FILE_BYTES} bytes")
    if not isinstance(digest, str) or _HEX64.fullmatch(digest) is None:
        raise SnapshotError(f"model file {name}: digest is not 64 hex digits")
    return FileEntry(name, nbytes, digest)
