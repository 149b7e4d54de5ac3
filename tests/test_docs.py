"""The docs site: it builds with no warning, the protocol's test vectors are the code's, and
every module or file a page, a docstring or a comment names exists.

The vectors are read out of the pages as a reader sees them (docs/protocol/signing.md, section
11; docs/protocol/wire.md, section 13), never copied into this file, so a wrong byte or length
on a page fails here. Each signature is checked twice: the code signs the page's message to the
page's bytes, and the page's signature verifies, under the page's public key, over the message
this test builds from the page's own description of it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from echo2p2p import messages as m
from echo2p2p import model_index, signing

ROOT = Path(__file__).resolve().parents[1]
SIGNING = (ROOT / "docs" / "protocol" / "signing.md").read_text()
WIRE = (ROOT / "docs" / "protocol" / "wire.md").read_text()

HUB_SEED = bytes(range(32))  # "Hub private key (seed) `00 01 02 … 1f`"
PEER_SEED = bytes(range(32, 64))  # "peer private key (seed) bytes 32 to 63"
NONCE = bytes(range(16))  # "`nonce` = bytes 0 to 15"


def test_site_builds_with_no_warning(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav or a flag
    reference that does not render fails the build."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout + done.stderr
    flags = (tmp_path / "site" / "reference" / "flags" / "index.html").read_text()
    for flag in ("--max-lag", "--lr", "--max-new-tokens", "--workers", "--hub-key"):
        assert f"<code>{flag}</code>" in flags, flag


def _after(text: str, label: str, pattern: str) -> str:
    found = re.search(re.escape(label) + pattern, text, re.S)
    assert found, f"no {label!r} in the page"
    return found.group(1)


def _hex_block(text: str, label: str) -> bytes:
    return bytes.fromhex(_after(text, label, r".*?```\n([0-9a-f]+)\n```"))


def _verifies(public: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except Exception:  # cryptography's InvalidSignature, or a malformed key or signature
        return False
    return True


def the_manifest() -> m.Manifest:
    """The worked example's manifest, as the page describes it."""
    return m.Manifest(version=3, base_version=None, codec="zstd", hash_algo="blake2b-256",
                      chunk_bytes=4, total_bytes=4,
                      tensors=[m.TensorEntry("w", "bfloat16", [2], 0, 4)],
                      chunks=[m.ChunkEntry(4, 13, b"\x22" * 32)], digest=b"\x11" * 32)


def test_hub_public_key_is_the_seeds():
    documented = bytes.fromhex(_after(SIGNING, "public key\n", r"`([0-9a-f]{64})`"))
    assert signing.public_key(HUB_SEED) == documented


def test_signed_manifest_length_and_signature():
    signed = signing.manifest_bytes(the_manifest())
    assert len(signed) == int(_after(SIGNING, "The ", r"(\d+) signed bytes"))
    assert signed.startswith(b"echo2p2p-manifest-v1\x00\x89\xa7version\x03\xacbase_version\xc0")
    documented = _hex_block(SIGNING, "Its signature (hex, 64 bytes):")
    assert signing.sign_manifest(HUB_SEED, the_manifest()) == documented
    assert _verifies(signing.public_key(HUB_SEED), documented, signed)


def test_proof_ticket_and_auth_vectors():
    peer_key = signing.public_key(PEER_SEED)
    table = dict(re.findall(r"^(peer_key|proof|ticket|auth p2|auth hub)\s+([0-9a-f]+)$",
                            SIGNING, re.M))
    assert bytes.fromhex(table["peer_key"]) == peer_key
    hub = signing.public_key(HUB_SEED)
    # The messages as the page's table spells them, and the lengths the page states.
    proof_msg = b"echo2p2p-welcome-v1\x00" + bytes([16]) + NONCE + b"r1\x00p1\x00" + peer_key
    ticket_msg = b"echo2p2p-ticket-v2\x00r1\x00p1\x00" + peer_key
    assert len(proof_msg) == int(_after(SIGNING, "proof message (", r"(\d+) bytes\)"))
    assert len(ticket_msg) == int(_after(SIGNING, "ticket message (", r"(\d+) bytes\)"))
    cases = {
        "proof": (signing.sign_welcome(HUB_SEED, NONCE, "r1", "p1", peer_key), hub, proof_msg),
        "ticket": (signing.sign_ticket(HUB_SEED, "r1", "p1", peer_key), hub, ticket_msg),
        "auth p2": (signing.chunk_auth(PEER_SEED, "r1", "p2"), peer_key,
                    b"echo2p2p-chunk-auth-v1\x00r1\x00p2"),
        "auth hub": (signing.chunk_auth(PEER_SEED, "r1", "hub"), peer_key,
                     b"echo2p2p-chunk-auth-v1\x00r1\x00hub"),
    }
    for name, (signed, public, message) in cases.items():
        documented = bytes.fromhex(table[name])
        assert signed == documented, name
        assert _verifies(public, documented, message), name


def test_model_files_vectors():
    index = model_index.index_of("tiny", {"config.json": b"{}"}, {"eos_token_id": 1})
    encoded = model_index.encode_index(index)
    documented = _after(SIGNING, "is these ", r"\d+ bytes.*?```\n(.+?)\n```").encode()
    assert encoded == documented
    assert len(encoded) == int(_after(SIGNING, "is these ", r"(\d+) bytes"))
    digest = bytes.fromhex(_after(SIGNING, "its `model_digest` is\n", r"`([0-9a-f]{64})`"))
    assert model_index.index_digest(encoded) == digest
    message = b"echo2p2p-model-files-v1\x00" + b"\x33" * 32
    assert len(message) == int(_after(SIGNING, "signed message\nis the ", r"(\d+) bytes"))
    signature = _hex_block(SIGNING, "`model_signature` is")
    assert signing.sign_model_files(HUB_SEED, b"\x33" * 32) == signature
    assert _verifies(signing.public_key(HUB_SEED), signature, message)


def test_worked_frames():
    """Section 13: the heartbeat, a lease request and the hello, byte for byte or by length. A
    frame carries its connection's version (one this release speaks, the one the page shows);
    the hello is always framed with the base version, 2."""
    for msg, text in ((m.Heartbeat(), "i.e. "), (m.LeaseRequest(n=2), "with `n = 2` is ")):
        shown = bytes.fromhex(_after(WIRE, text, r"`([0-9a-f ]+)`"))
        protocol = msgpack.unpackb(shown)["p"]
        assert protocol in m.SUPPORTED_PROTOCOLS
        assert m.encode(msg, protocol) == shown
    hello = m.Hello(name="n", engine="transformers", device="cpu", price_per_hour=0.0,
                    listen_addr=None, token="", nonce=NONCE,
                    peer_key=signing.public_key(PEER_SEED))
    encoded = m.encode(hello)
    assert len(encoded) == int(_after(WIRE, "no token), ", r"(\d+) bytes"))
    assert msgpack.unpackb(encoded)["p"] == m.BASE_PROTOCOL
    shown = int(_after(WIRE, 'a1 "p" ', r"([0-9a-f]{2})"), 16)
    assert shown == m.BASE_PROTOCOL, "the worked hello shows another protocol version"
    assert json.loads("[" + _after(WIRE, "frame always carries exactly `", r"(\d+)`") + "]") == [
        m.BASE_PROTOCOL]


# Names the architecture page cites from other projects, as models: not ours to define.
ELSEWHERE = {"Protocol"}
FILE = r"\.(py|yml|toml|json|jsonl|md|html|png)$"  # a file's name, not a Python name


def _code_names() -> tuple[set[str], dict[str, str], set[str]]:
    """Every name the code defines, each class's body by name, and every module's name."""
    files = [p for d in ("echo2p2p", "hub", "peer") for p in (ROOT / d).rglob("*.py")]
    code = "\n".join(p.read_text() for p in files)
    defined = set(re.findall(r"^\s*(?:async def|def|class) (\w+)", code, re.M))
    defined |= set(re.findall(r"^\s*(?:self\.)?(\w+)\s*(?::[^=\n]*)?=", code, re.M))
    bodies = {name: body for name, body in
              re.findall(r"^class (\w+)\b.*?\n(.*?)(?=^\S|\Z)", code, re.M | re.S)}
    return defined, bodies, {p.stem for p in files} | {p.parent.name for p in files}


def test_architecture_cites_names_that_exist():
    """Every `Class.member`, `function()` or class the page names is defined in the code: a
    renamed method fails here instead of misleading a reader."""
    defined, bodies, modules = _code_names()
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for token in re.findall(r"`([A-Za-z_][\w.]*)(\(.*?\))?`", text):
        name, called = token
        parts = name.split(".")
        if parts[-1] in modules or parts[-1] in ELSEWHERE or re.search(FILE, name):
            continue
        if len(parts) == 2 and parts[0] in bodies:  # Class.member: in that class's body
            if not re.search(rf"(def {parts[1]}\b|^\s+{parts[1]}\s*[:=]|self\.{parts[1]}\s*[:=])",
                             bodies[parts[0]], re.M):
                missing.append(name)
        elif (called or len(parts) > 1 or name[:1].isupper()) and parts[-1] not in defined:
            missing.append(name)
    assert not missing, f"docs/architecture.md names what the code does not define: {missing}"


def test_capacity_guide_states_what_the_plan_drops_at_a_smaller_s(capsys, monkeypatch):
    """The capacity guide's "the example above with `--max-lag N`: P % would be dropped, and
    cost-aware's busy fraction falls to B" is what `echo2-hub plan` prints for that example."""
    from echo2p2p.hub.cli import main

    page = (ROOT / "docs" / "guides" / "capacity.md").read_text()
    example = re.search(r"<!-- plan-example[^>]*-->\n```\n\$ echo2-hub (.+?)\n", page).group(1)
    said = re.search(r"example above with `--max-lag (\d+)`: (\d+) % would be dropped, and\s+"
                     r"cost-aware's busy fraction falls to\s+([\d.]+)\)", page)
    assert said, "the capacity guide lost its --max-lag example"
    argv = re.sub(r"--max-lag \d+", f"--max-lag {said.group(1)}", example).split()
    monkeypatch.chdir(ROOT)
    assert main(argv + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["S"] == int(said.group(1))
    assert round(100 * plan["stale_frac"]) == int(said.group(2)), plan["stale_frac"]
    assert f"{plan['policies']['cost-aware']['busy_frac']:.2f}" == said.group(3), plan["policies"]


def test_watching_guide_reads_the_live_lag_column_as_the_terminal_prints_it():
    """The guide's "`lag 0/2/6` ...: of the step's groups, 0 ... 2 ... and 6 ..." is the live
    line of a step whose groups were 0 at lag 0, 2 at lag 1 and 6 at lag 2."""
    from echo2p2p.hub.view.runlog import live_line

    page = " ".join((ROOT / "docs" / "guides" / "watching.md").read_text().split())
    said = re.search(r"`lag (\d+)/(\d+)/(\d+)` is that histogram: of the step's groups, (\d+) were "
                     r"generated by the version being trained, (\d+) by the one before and (\d+) by",
                     page)
    assert said and said.groups()[:3] == said.groups()[3:], "the watching guide lost its lag example"
    hist = dict(zip("012", map(int, said.groups()[:3])))
    line = live_line({"step": 3, "version": 4, "train/reward_mean": 0.5, "rollout/per_s": 80.0,
                      "rollout/staleness_hist": hist, "hub/learner_busy_frac": 0.5,
                      "hub/peers": 2})
    assert f"lag {'/'.join(said.groups()[:3])} " in line, line


# --- Every module path and file path the docs and the code's docstrings and comments name exists.

PY_DIRS = ("echo2p2p", "hub", "peer", "bench", "tests", "examples")
PAGES = ("README.md", "CONTRIBUTING.md")
# The folder each import root lives in: echo2p2p.hub is hub/, echo2p2p.peer is peer/.
FOLDERS = {"echo2p2p": "echo2p2p", "hub": "hub", "peer": "peer"}
# `echo2p2p.hub.serving.server`, `hub.view.feed`, `echo2p2p.messages.Hello`; not `[hub.grpo]`
# (a TOML table), not part of a longer word, path or URL.
DOTTED = re.compile(r"(?<![\w/.\-\[])((?:echo2p2p|hub|peer)(?:\.[A-Za-z_]\w*)+)(?![\w*<{(-])")
# `hub/view/dashboard.py`, `tests/hub/serving/`, `docs/guides/tasks.md`; not a glob or a pattern.
PATH = re.compile(r"(?<![\w/.\-~$])((?:echo2p2p|hub|peer|bench|tests|docs|examples)/[\w/.\-]*\w)"
                  r"(?![\w*<{])")
# A dotted name ending in one of these is a file's name (`peer.log`, `hub.crt`), not a module.
FILE_NAMES = {"py", "md", "toml", "json", "jsonl", "yml", "html", "png", "log", "crt", "key"}
# What a script writes, named where it is written: not in the tree until it runs.
OUTPUTS = {"bench/real_learning.png"}
KNOWN: set[tuple[str, str]] = set()  # (file, path) named stale on purpose: none


@functools.cache
def _entry_point_groups() -> set[str]:
    """Entry-point groups (`echo2p2p.environments`): dotted names that are not modules."""
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"])


def defines(path: Path, name: str) -> bool:
    """`path` defines or imports `name` (a def, a class, an assignment, an import, a line of a
    parenthesised import): not merely says it, as a package's docstring may say its own path."""
    return name.startswith("__") or bool(re.search(
        rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b[^\n]*\b{name}\b"
        rf"|^\s+{name},?\s*$", path.read_text(encoding="utf-8"), re.M))


def module_exists(dotted: str, root: Path = ROOT) -> bool:
    """`dotted` is a module or package of the tree, optionally followed by a name it defines:
    the longest prefix that is a folder or a file, then the next part spelled in that file."""
    parts = dotted.split(".")
    if parts[-1] in FILE_NAMES or dotted in _entry_point_groups():
        return True
    if parts[:2] in (["echo2p2p", "hub"], ["echo2p2p", "peer"]):
        parts = parts[1:]
    here = root / FOLDERS[parts[0]]
    for i, part in enumerate(parts[1:], 1):
        if (here / part).is_dir():
            here = here / part
            continue
        module = here / f"{part}.py"
        if module.is_file():
            return i + 1 == len(parts) or defines(module, parts[i + 1])
        init = here / "__init__.py"  # a name the package itself defines or re-exports
        return init.is_file() and defines(init, part)
    return True


def path_exists(path: str, root: Path = ROOT) -> bool:
    """A file or folder of the tree (`tests/envs/vf_sums` may drop its `.py`), or a metric key:
    `hub/learner_busy_frac` is an area and a name (a folder is written `hub/view/`)."""
    metric = re.fullmatch(r"(hub|peer)/\w+", path)
    return (bool(metric) or path in OUTPUTS or (root / path).exists()
            or (root / f"{path}.py").is_file())


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Every module path and file path `text` names that the tree does not hold."""
    return ([d for d in DOTTED.findall(text) if not module_exists(d, root)]
            + [p for p in PATH.findall(text) if "NAME" not in p and not path_exists(p, root)])


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings: what it says, not what it does."""
    import ast
    import io
    import tokenize

    source = path.read_text(encoding="utf-8")
    said = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                said.append((node.body[0].lineno, doc))
    return said


def stale_paths() -> list[tuple[str, int, str]]:
    """(file, line, path) of every path named in the code's prose or a page that does not exist."""
    found = []
    for path in sorted(p for d in PY_DIRS for p in (ROOT / d).rglob("*.py")):
        name = str(path.relative_to(ROOT))
        found += [(name, line, bad) for line, text in _prose(path) for bad in missing_paths(text)]
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / p for p in PAGES]
    for page in (p for p in pages if p.exists()):
        name = str(page.relative_to(ROOT))
        found += [(name, line, bad) for line, text in enumerate(page.read_text().splitlines(), 1)
                  for bad in missing_paths(text)]
    return found


def test_named_paths_exist():
    """No docstring, comment or page names a module or file the tree does not hold: a module
    moved or renamed fails here instead of sending a reader to a file that is gone."""
    found = stale_paths()
    stale = [f"{name}:{line}: {bad}" for name, line, bad in found if (name, bad) not in KNOWN]
    assert not stale, "stale paths:\n" + "\n".join(stale)
    fixed = KNOWN - {(name, bad) for name, _, bad in found}
    assert not fixed, f"fixed, so out of KNOWN: {sorted(fixed)}"


def test_named_paths_rule_can_fail():
    """A made-up module, name or file is caught; real ones, a TOML table, a file's name, an
    entry-point group, a placeholder and a metric key are not."""
    made_up = ("see echo2p2p.hub.serving.nowhere, hub.view.feed.NoSuchThing, hub.durable, "
               "hub.core.nothing.Core, "
               "echo2p2p.peer.ghost and hub/view/nothing.py, tests/hub/test_gone.py, docs/no.md")
    assert missing_paths(made_up) == [
        "echo2p2p.hub.serving.nowhere", "hub.view.feed.NoSuchThing", "hub.durable",
        "hub.core.nothing.Core",
        "echo2p2p.peer.ghost", "hub/view/nothing.py", "tests/hub/test_gone.py", "docs/no.md"]
    real = ("echo2p2p.hub.run.loop.HubRun, hub.serving.server, echo2p2p.messages.Hello, "
            "echo2p2p.hub.Run, `[hub.grpo]`, peer.log, echo2p2p.environments, "
            "hub/view/dashboard.py, tests/envs/vf_sums, docs/guides/, bench/NAME.py, "
            "hub/learner_busy_frac")
    assert missing_paths(real) == []


def test_contributing_guide_names_commands_and_flags_that_exist():
    """CONTRIBUTING.md is read as the README and the docs pages are (tests/test_readme_flags.py):
    every `echo2-hub` / `echo2-peer` command's flags are its subcommand's, and every other
    `--flag` is one of ours, of a bench script or of a tool the pages name; and the guide cites
    each house test, so the table of rules cannot drop one unnoticed."""
    from tests import test_readme_flags as flags

    guide = (ROOT / "CONTRIBUTING.md").read_text()
    assert not flags.unknown_flags(guide)
    known = flags.every_flag() | flags.bench_flags() | set(flags.OTHERS)
    named = {f for line in flags.snippets(guide) for f in flags.ANY_FLAG.findall(line)}
    assert named and not named - known, named - known
    house = {p.name for p in ROOT.glob("tests/test_*.py")} - {"test_real_model.py"}
    assert not {t for t in house if f"tests/{t}" not in guide}, "a house test the guide omits"


def test_architecture_graph_is_the_houses():
    """The page's graph of folders and imports is the one bench/house.py draws from the code (no
    numbers: they change with every commit). A folder added or an import between two folders
    that did not import each other fails here: `python bench/house.py --page` redraws it."""
    from bench import house

    page = (ROOT / "docs" / "architecture.md").read_text()
    assert house.page_graph(page) == house.mermaid(house.house(), numbers=False), (
        "docs/architecture.md's graph is stale: python bench/house.py --page")
