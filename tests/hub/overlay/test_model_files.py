"""GET /model/ and /model/{name}: the policy's non-weight files, allowlisted, byte-exact, on a
real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil


import aiohttp
import pytest
from aiohttp import web

from echo2p2p import signing
from echo2p2p.errors import ConfigError
from echo2p2p.hub.overlay.model_files import ALLOWED, ModelFiles, model_dir, model_routes
from echo2p2p.model_index import encode_index, parse_index

from tests.conftest import running_peers, serving

CONFIG = b'{"architectures": ["Qwen3ForCausalLM"], "eos_token_id": 1}\n'
TOKENIZER = bytes(range(256)) * 3  # any bytes: served as read, never re-encoded


@pytest.fixture
def model_tree(tmp_path):
    """A model directory with allowlisted files, weights, and files beside and above it."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_bytes(CONFIG)
    (d / "tokenizer.json").write_bytes(TOKENIZER)
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "notes.txt").write_text("not allowlisted")
    (d / "sub").mkdir()
    (d / "sub" / "config.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("outside the model directory")
    return d


@contextlib.asynccontextmanager
async def served(files: ModelFiles, authorize=None):
    app = web.Application()
    for path, handler in model_routes(files, authorize).items():
        app.router.add_get(path, handler)
    async with serving(app) as port:
        yield port


async def raw_status(port: int, target: str) -> int:
    """The status of `GET target` sent as raw bytes, so no client normalises the path."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 30)
    writer.close()
    return int(line.split()[1])


async def test_index_and_files_served_byte_exact(model_tree):
    """The index lists the allowlisted files present with sizes and digests; each is served
    exactly as on disk, and weights or other files are not served."""
    files = ModelFiles.read(model_tree, "local", {"eos_token_id": 1})
    assert set(files.files) == {"config.json", "tokenizer.json", "chat_template.jinja"}
    async with served(files) as port, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{port}/model/"
        async with http.get(base) as resp:
            assert resp.status == 200
            index = json.loads(await resp.read())
        assert index["model"] == "local" and index["tokens"] == {"eos_token_id": 1}
        digest = hashlib.blake2b(TOKENIZER, digest_size=32).hexdigest()
        assert index["files"]["tokenizer.json"] == {"bytes": len(TOKENIZER), "digest": digest}
        for name, body in (("config.json", CONFIG), ("tokenizer.json", TOKENIZER)):
            async with http.get(base + name) as resp:
                assert resp.status == 200
                assert await resp.read() == body
        assert resp.content_type == "application/json"
        for name in ("model.safetensors", "notes.txt", "special_tokens_map.json", "sub"):
            async with http.get(base + name) as resp:
                assert resp.status == 404, name


async def test_traversal_attempts_get_404(model_tree):
    """No spelling of a path outside the table reaches a file: dot segments, encoded slashes,
    absolute paths, NUL bytes, subdirectories."""
    async with served(ModelFiles.read(model_tree, "local")) as port:
        for target in ("/model/../secret.txt", "/model/..%2Fsecret.txt",
                       "/model/%2e%2e%2fsecret.txt", "/model/..%5csecret.txt",
                       "/model/sub/config.json", "/model/sub%2Fconfig.json", "/model//etc/passwd",
                       "/model/%2Fetc%2Fpasswd", "/model/config.json%00",
                       "/model/./config.json/", "/model/CONFIG.JSON", "/model/model.safetensors"):
            assert await raw_status(port, target) in (400, 404), target
        assert await raw_status(port, "/model/config.json") == 200


async def test_authorize_refuses_index_and_files(model_tree):
    """With `authorize`, a request it refuses gets 403 on the index and on every file."""
    files = ModelFiles.read(model_tree, "local")
    admit = lambda request: request.headers.get("X-Echo2-Ticket") == "good"  # noqa: E731
    async with served(files, admit) as port, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{port}/model/"
        for url in (base, base + "config.json", base + "nonexistent"):
            async with http.get(url) as resp:
                assert resp.status == 403
        async with http.get(base + "config.json", headers={"X-Echo2-Ticket": "good"}) as resp:
            assert resp.status == 200 and await resp.read() == CONFIG


def test_the_index_served_is_the_canonical_one_signed(model_tree):
    """GET /model/ answers the canonical encoding byte for byte, which parses back to the files
    read, and `signed` gives its digest and the hub key's signature over it."""
    files = ModelFiles.read(model_tree, "local", {"eos_token_id": 1})
    assert files.index_bytes() == encode_index(files.index())
    parsed = parse_index(files.index_bytes())
    assert {e.name: e.nbytes for e in parsed.files} == {n: len(b) for n, b in files.files.items()}
    key = signing.new_private_key()
    digest, signature = files.signed(key)
    assert digest == hashlib.blake2b(files.index_bytes(), digest_size=32).digest()
    assert signing.verify_model_files(signing.public_key(key), digest, signature)
    assert files.signed(b"") == (digest, b"")


@pytest.mark.parametrize("remove, why", [(("config.json",), "no config.json"),
                                         (("tokenizer.json",), "no tokenizer file")])
async def test_a_model_directory_missing_files_is_refused_at_start(hub_cfg, tmp_path, remove, why):
    """A hub asked to train a directory without config.json, or without any tokenizer file,
    refuses at start-up with one sentence on the "model" field naming the fix."""
    from echo2p2p.hub.run.start import start_hub
    from echo2p2p.policy.model import builtin_dir

    lab = tmp_path / "lab-model"
    shutil.copytree(builtin_dir(), lab)
    for name in remove:
        (lab / name).unlink()
    with pytest.raises(ConfigError, match=why) as info:
        async with start_hub(hub_cfg.replace(model=str(lab), max_steps=0)):
            pass
    assert info.value.field == "model" and "save_pretrained" in str(info.value)
    assert not (tmp_path / "run").exists()  # refused before anything was loaded or written


def test_a_hub_id_not_in_the_cache_is_a_config_error():
    """A model that is no directory and no cached hub id is refused on the "model" field."""
    with pytest.raises(ConfigError, match="org/not-cached") as info:
        ModelFiles.for_model("org/not-cached")
    assert info.value.field == "model"


def test_builtin_model_resolves_to_the_shipped_checkpoint():
    """"tiny" is the shipped directory the loader uses; its files but never its weights."""
    from echo2p2p.policy.model import builtin_dir

    assert model_dir("tiny") == builtin_dir()
    files = ModelFiles.for_model("tiny")
    assert "model.safetensors" not in files.files
    assert files.files["config.json"] == (builtin_dir() / "config.json").read_bytes()
    assert set(files.files) <= set(ALLOWED)


def test_hub_id_resolves_offline_from_the_cache(tmp_path, model_tree):
    """A hub id is the snapshot in the local cache, found without the network; an id that is
    not cached is a FileNotFoundError naming the model."""
    repo = tmp_path / "cache" / "models--org--name"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / commit).symlink_to(model_tree, target_is_directory=True)
    resolved = model_dir("org/name", cache_dir=str(tmp_path / "cache"))
    assert resolved == repo / "snapshots" / commit
    assert ModelFiles.read(resolved, "org/name").files["config.json"] == CONFIG
    with pytest.raises(FileNotFoundError, match="org/missing"):
        model_dir("org/missing", cache_dir=str(tmp_path / "cache"))


async def test_hub_serves_the_model_it_trains(hub_cfg):
    """A running hub answers /model/ beside /ws: the built-in model's files and its EOS, for a
    request carrying a ticket as a chunk request to the hub would."""
    from echo2p2p.policy.model import builtin_dir
    from echo2p2p.hub.run.start import start_hub

    async with start_hub(hub_cfg.replace(max_steps=0)) as run, aiohttp.ClientSession() as http:
        key = signing.new_private_key()
        pub = signing.public_key(key)
        ticket = signing.sign_ticket(run.signing_key, run.hub.core.run_id, "p99", pub)
        auth = signing.chunk_auth(key, run.hub.core.run_id, "hub")
        headers = {"X-Echo2-Ticket": f"p99.{pub.hex()}.{ticket.hex()}.{auth.hex()}"}
        base = f"http://127.0.0.1:{run.port}/model/"
        async with http.get(base, headers=headers) as resp:
            assert resp.status == 200
            body = await resp.read()
        index = json.loads(body)
        assert index["model"] == "tiny"
        # The welcome's digest is the served bytes', signed by the hub's key.
        digest, signature = run.hub.core.model_index
        assert digest == hashlib.blake2b(body, digest_size=32).digest()
        assert signing.verify_model_files(run.hub.core.hub_key, digest, signature)
        assert index["tokens"]["eos_token_id"] == run.tokenizer.eos_token_id
        async with http.get(base + "config.json", headers=headers) as resp:
            assert await resp.read() == (builtin_dir() / "config.json").read_bytes()
        async with http.get(base + "model.safetensors", headers=headers) as resp:
            assert resp.status == 404
        async with running_peers(run.url, 1, engine="relay", listen="") as [peer]:
            await peer.wait_welcomed()
        assert (peer.welcome.model_digest, peer.welcome.model_signature) == (digest, signature)
