"""The model's files from the hub: fetch, verify and cache the directory an engine is built from.

A welcome names the model's config and tokenizer files by the digest of the hub's index and
the hub's signature over it (`echo2p2p.model_index`, docs/protocol/scoring.md, section 9).
`model_directory` checks that signature against the welcome's hub key, fetches the index
(`GET /model/`, with the ticket header of a chunk request to the hub), checks it hashes to the
signed digest, holds it to the index bounds, fetches each file (reading no more than the size
the index declares), checks each digest, and installs the set atomically (written into a
temporary directory beside the cache entry, then renamed) as `<cache>/<index digest hex>`. An
entry already there is used when its files still match the index, so a rejoin downloads
nothing. A peer never opens `welcome.model` as a path and never downloads from the Hugging Face
hub. The directory holds no weights: the engine is built from config.json with untrained
weights (`echo2p2p.policy.model.load_policy`), and the weights arrive through the overlay as
the current version, before which the worker generates nothing. On a terminal the fetch shows
a progress bar of the index's bytes (`echo2p2p.runtime.progress`): the peer waits on it, once.

Every failure is a SnapshotError with one sentence saying what did not verify.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.errors import SnapshotError
from echo2p2p.policy.gguf_cache import install_entry
from echo2p2p.model_index import (MAX_INDEX_BYTES, ModelIndex, file_digest, index_digest,
                                  parse_index)
from echo2p2p.runtime.progress import progress_bar

log = logging.getLogger(__name__)

# echo2p2p.policy.model.BUILTIN_MODEL, named here so that deciding imports no torch: every
# peer ships the built-in model, so a welcome from a hub that names no model files may use it.
BUILTIN_MODEL = "tiny"
MIN_RATE_BPS = 256 << 10  # a fetch slower than this overall is cut off (each read: timeout_s)


async def model_directory(http: aiohttp.ClientSession, base_url: str, welcome: m.Welcome,
                          headers: Mapping[str, str], *, cache: Path, timeout_s: float) -> str:
    """The directory to build `welcome`'s engine from: the hub's model files, verified, in
    `cache` (fetched from `base_url`, the hub's http(s)://HOST:PORT, unless already there).
    A hub older than the model files that trains the built-in model gets the built-in."""
    digest = welcome.model_digest
    if not digest:
        if welcome.model == BUILTIN_MODEL:
            return BUILTIN_MODEL
        raise SnapshotError(f"the hub names model {welcome.model[:80]!r} but publishes no model "
                            "files (welcome.model_digest): it is older than this peer; upgrade it")
    if len(digest) != 32:
        raise SnapshotError("the welcome's model_digest is not 32 bytes")
    # A hub without a key (a bench rig) signs nothing: the digest alone, from the websocket.
    if welcome.hub_key and not signing.verify_model_files(welcome.hub_key, digest,
                                                          welcome.model_signature):
        raise SnapshotError("the welcome's model files are not signed by the hub's key")
    data = await _get(http, f"{base_url}/model/", headers, MAX_INDEX_BYTES, timeout_s=timeout_s,
                      what="the model index", bound="a peer accepts")
    if index_digest(data) != digest:
        raise SnapshotError("the model index the hub serves does not match the digest its "
                            "welcome signs")
    index = parse_index(data)
    target = cache / digest.hex()
    if await asyncio.to_thread(_holds, target, index):
        log.info("model %s: files from the cache, %s", index.model, target)
        return str(target)
    files = {}
    with progress_bar(index.total_bytes, "model files", show=True) as bar:  # no hub text
        for entry in index.files:
            body = await _get(http, f"{base_url}/model/{entry.name}", headers, entry.nbytes,
                              timeout_s=timeout_s, what=f"model file {entry.name}",
                              bound="its signed index declares", on_block=bar.update)
            if len(body) != entry.nbytes or file_digest(body) != entry.digest:
                raise SnapshotError(f"model file {entry.name} does not match its size and "
                                    "digest in the signed index")
            files[entry.name] = body
    await asyncio.to_thread(_install, target, files, index)
    log.info("model %s: %d files (%d bytes) fetched from the hub into %s", index.model,
             len(files), index.total_bytes, target)
    return str(target)


async def _get(http: aiohttp.ClientSession, url: str, headers: Mapping[str, str], cap: int,
               *, timeout_s: float, what: str, bound: str,
               on_block: Callable[[int], object] | None = None) -> bytes:
    """The body of GET `url`, at most `cap` bytes (`bound` says whose), under a deadline per
    read and overall; `on_block(n)` after each block of n bytes."""
    timeout = aiohttp.ClientTimeout(total=timeout_s + cap / MIN_RATE_BPS,
                                    sock_connect=timeout_s, sock_read=timeout_s)
    async with http.get(url, headers=dict(headers), timeout=timeout,
                        allow_redirects=False) as resp:
        if resp.status != 200:
            raise SnapshotError(f"the hub answered HTTP {resp.status} for {what}")
        if resp.content_length is not None and resp.content_length > cap:
            raise SnapshotError(f"{what}: the hub sends {resp.content_length} bytes, more than "
                                f"the {cap} {bound}")
        body = bytearray()
        async for block in resp.content.iter_chunked(1 << 16):
            body += block
            if len(body) > cap:
                raise SnapshotError(f"{what}: the hub sends more than the {cap} bytes {bound}")
            if on_block is not None:
                on_block(len(block))
    return bytes(body)


def _holds(target: Path, index: ModelIndex) -> bool:
    """Whether `target` holds exactly the index's files, each matching its digest."""
    try:
        if sorted(os.listdir(target)) != sorted(e.name for e in index.files):
            return False
        return all((target / e.name).stat().st_size == e.nbytes
                   and file_digest((target / e.name).read_bytes()) == e.digest
                   for e in index.files)
    except OSError:
        return False


def _install(target: Path, files: Mapping[str, bytes], index: ModelIndex) -> None:
    """Write `files` to `target` atomically: a temporary directory beside it, renamed into
    place. A damaged entry there is replaced; one another process installed meanwhile is kept."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name[:16]}-", dir=target.parent))
    except OSError as exc:
        raise SnapshotError(f"cannot write the model cache {target.parent} ({exc.strerror}): "
                            "set --model-cache to a writable directory") from None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the entry is as readable as the cache
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        install_entry(tmp, target, lambda entry: _holds(entry, index))
    except OSError as exc:
        raise SnapshotError(f"cannot write the model cache {target.parent} ({exc.strerror}): "
                            "set --model-cache to a writable directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
