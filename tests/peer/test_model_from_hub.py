"""A volunteer needs nothing but the hub URL: the peer builds its engine from the model files
the hub signs and serves (`peer.model_files`), never from `welcome.model` as a path. Real hubs,
real peers (one a separate process in another working directory), real files on 127.0.0.1;
hostile hubs are real HTTP servers serving what a broken or lying hub would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.errors import SnapshotError
from echo2p2p.model_index import (ALLOWED, MAX_INDEX_BYTES, encode_index, file_digest,
                                  index_digest, index_of)
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.model_files import model_directory

from tests.conftest import serving, until, until_logged, wait_first

TIMEOUT_S = 10.0


def make_lab_model(directory: Path) -> dict[str, bytes]:
    """A model the built-in cannot stand in for: the built-in's tokenizer, an architecture of
    its own (2 layers of a narrower MLP, not 3) and fresh weights, saved as save_pretrained
    writes it. Returns the files a hub serves from it (name -> bytes)."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    from echo2p2p.policy.model import builtin_dir

    directory.mkdir(parents=True)
    config = json.loads((builtin_dir() / "config.json").read_text())
    config.update(num_hidden_layers=2, intermediate_size=384,
                  layer_types=["full_attention"] * 2)
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_dir() / name, directory / name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        Qwen3ForCausalLM(AutoConfig.from_pretrained(directory)).save_pretrained(directory)
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name in ALLOWED}


@pytest.mark.system  # a peer process
async def test_a_peer_process_elsewhere_builds_from_the_hubs_files(hub_cfg, tmp_path, monkeypatch):
    """A hub trains a lab's local directory, named relative to the hub's working directory; a
    peer process started in another directory, given only the hub URL, fetches the signed
    config and tokenizer, builds the architecture from them, loads version 0 from the overlay
    and generates: its rollouts are admitted with every one's logprobs recomputed by the hub,
    and its cache holds exactly the hub's files."""
    served = make_lab_model(tmp_path / "lab" / "finetune")
    monkeypatch.chdir(tmp_path / "lab")
    volunteer = tmp_path / "volunteer"
    volunteer.mkdir()
    cache, log_path = tmp_path / "cache", tmp_path / "peer.log"
    from echo2p2p.hub.run.start import start_hub

    cfg = hub_cfg.replace(model="finetune", spot_check_fraction=1.0, max_steps=0)
    async with start_hub(cfg, stream=None) as run:
        assert run.learner.model.config.num_hidden_layers == 2
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        with open(log_path, "wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "echo2p2p.peer.cli", "join", run.url, "--name", "far",
                "--torch-threads", "1", "--listen", "", "--model-cache", str(cache),
                cwd=volunteer, env=env, stdout=log_file, stderr=log_file)
        try:
            await wait_first(until(run.hub, lambda: (c := run.hub.statistics()).admitted_groups >= 2
                                  and c.spot_checked >= 2, 300), proc.wait(), timeout_s=300)
        finally:
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()
        log = log_path.read_text()
        c = run.hub.statistics()
        assert c.admitted_groups >= 2 and c.spot_failed == 0, (c, log[-3000:])
        digest = run.hub.core.model_index[0]
    assert "fetched from the hub" in log, log[-3000:]
    assert [p.name for p in cache.iterdir()] == [digest.hex()]  # no temporary left behind
    held = {p.name: p.read_bytes() for p in (cache / digest.hex()).iterdir()}
    assert held == served and "model.safetensors" not in held
    assert {n: file_digest(b) for n, b in held.items()} == {n: file_digest(b) for n, b in served.items()}


# --- the fetch itself, against hubs that lie ------------------------------------------------


@contextlib.asynccontextmanager
async def model_server(index: bytes, files: dict[str, bytes]):
    """GET /model/ answering `index` and /model/{name} answering `files`, as they are (a hub
    may lie in either); yields (base URL, the paths requested)."""
    requested: Counter[str] = Counter()

    async def handle(request: web.Request) -> web.Response:
        requested[request.path] += 1
        name = request.match_info.get("name")
        body = index if name is None else files.get(name)
        return web.Response(status=404) if body is None else web.Response(body=body)

    app = web.Application()
    app.router.add_get("/model/", handle)
    app.router.add_get("/model/{name}", handle)
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}", requested


def welcome(index: bytes, key: bytes | None = None, *, model: str = "lab/finetune",
            digest: bytes | None = None) -> m.Welcome:
    """A welcome naming `index`, signed by `key` (None: a fresh hub key)."""
    key = key or signing.new_private_key()
    digest = index_digest(index) if digest is None else digest
    return m.Welcome("p1", "run", model, "addition", 0, 1, 2, 1.0, 1.0, 4, 0,
                     hub_key=signing.public_key(key), model_digest=digest,
                     model_signature=signing.sign_model_files(key, digest))


FILES = {"config.json": b'{"model_type": "qwen3"}\n', "tokenizer.json": b"\x00tok" * 100,
         "chat_template.jinja": b"{{ messages }}"}
INDEX = encode_index(index_of("lab/finetune", FILES, {"eos_token_id": 1}))


async def fetch(base: str, w: m.Welcome, cache: Path) -> str:
    async with aiohttp.ClientSession() as http:
        return await model_directory(http, base, w, {}, cache=cache, timeout_s=TIMEOUT_S)


async def test_files_are_verified_installed_and_reused(tmp_path):
    """The files land byte-exact in <cache>/<index digest>; a second join reads only the
    index; a damaged cache entry is fetched again and replaced."""
    cache = tmp_path / "cache"
    async with model_server(INDEX, FILES) as (base, requested):
        w = welcome(INDEX)
        directory = Path(await fetch(base, w, cache))
        assert directory == cache / index_digest(INDEX).hex()
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == FILES
        assert await fetch(base, w, cache) == str(directory)
        assert requested == Counter({"/model/": 2, **{f"/model/{n}": 1 for n in FILES}})
        (directory / "tokenizer.json").write_bytes(b"damaged")
        assert await fetch(base, w, cache) == str(directory)
        assert (directory / "tokenizer.json").read_bytes() == FILES["tokenizer.json"]
    assert [p.name for p in cache.iterdir()] == [directory.name]


def _declaring(name: str, nbytes: int) -> bytes:
    raw = index_of("lab/finetune", FILES, {})
    raw["files"][name]["bytes"] = nbytes
    return encode_index(raw)


@pytest.mark.parametrize("case, why", [
    ("tampered file", "tokenizer.json does not match its size and digest"),
    ("longer file", "more than the"),
    ("other key", "not signed by the hub's key"),
    ("no signature", "not signed by the hub's key"),
    ("index not the signed one", "does not match the digest"),
    ("oversized index", f"more than the {MAX_INDEX_BYTES}"),
    ("file over the bound", "size"),
    ("path in the index", "not an allowed model file"),
    ("missing file", "HTTP 404"),
    ("old hub, other model", "publishes no model files"),
])
async def test_a_hub_whose_files_do_not_verify_is_refused(tmp_path, case, why):
    """Tampered bytes, a file longer than declared, a signature by another key or none, an
    index that is not the signed one or is oversized, a declared size or a name out of bounds,
    a file the hub does not serve, a hub naming a model without files: each is refused with
    its reason, and nothing is left in the cache."""
    index, files, key = INDEX, dict(FILES), signing.new_private_key()
    w = welcome(index, key)
    if case == "tampered file":
        files["tokenizer.json"] = b"\x01tok" * 100
    elif case == "longer file":
        files["tokenizer.json"] += b"x" * (1 << 20)
    elif case == "other key":
        w = replace(w, model_signature=signing.sign_model_files(signing.new_private_key(),
                                                                w.model_digest))
    elif case == "no signature":
        w = replace(w, model_signature=b"")
    elif case == "index not the signed one":
        index = encode_index(index_of("lab/finetune", {**FILES, "vocab.txt": b"a"}, {}))
    elif case in ("oversized index", "file over the bound", "path in the index"):
        index = {"oversized index": INDEX + b" " * MAX_INDEX_BYTES,
                 "file over the bound": _declaring("tokenizer.json", 1 << 40),
                 "path in the index": INDEX.replace(b'"chat_template.jinja"', b'"../.bashrc"')
                 }[case]
        w = welcome(index, key)  # a hub that signs whatever it serves
    elif case == "missing file":
        del files["chat_template.jinja"]
    elif case == "old hub, other model":
        w = replace(w, model_digest=b"", model_signature=b"")
    cache = tmp_path / "cache"
    async with model_server(index, files) as (base, requested):
        with pytest.raises(SnapshotError, match=why):
            await fetch(base, w, cache)
    if case in ("other key", "no signature", "old hub, other model"):
        assert not requested  # refused before asking the hub for anything
    assert not cache.exists() or not any(cache.iterdir())


async def test_an_old_hub_on_the_builtin_model_gets_the_builtin(tmp_path):
    """A welcome without model files naming the built-in model builds the built-in (every peer
    ships it); nothing is fetched."""
    async with model_server(b"", {}) as (base, requested):
        w = replace(welcome(INDEX), model="tiny", model_digest=b"", model_signature=b"")
        assert await fetch(base, w, tmp_path / "cache") == "tiny"
    assert not requested


async def test_a_peer_leaves_a_hub_whose_model_files_do_not_verify(hub_cfg, tmp_path, caplog):
    """A real hub whose welcome carries a signature by another key: the peer says why in one
    line, hangs up, builds nothing and joins again later (it does not crash)."""
    from echo2p2p.hub.run.start import start_hub

    caplog.set_level(logging.ERROR, logger="echo2p2p.peer.client")
    cache = tmp_path / "cache"
    async with start_hub(hub_cfg.replace(max_steps=0), stream=None) as run:
        digest, _ = run.hub.core.model_index
        run.hub.core.model_index = (digest, signing.sign_model_files(signing.new_private_key(), digest))
        peer = PeerClient(PeerConfig(hub_url=run.url, listen="", model_cache=str(cache),
                                     reconnect_max_s=0.2))
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(peer.run(stop))
            try:
                await until_logged(lambda: sum("not signed by the hub's key" in r.getMessage()
                                               for r in caplog.records) >= 2, 60)
            finally:
                stop.set()
    assert peer.swapper.engine is None and peer.welcome is None and peer.statistics().submitted == 0
    assert not cache.exists()
