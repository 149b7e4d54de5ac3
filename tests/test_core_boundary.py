"""The house's boundaries, module by module: what each part of echo2p2p may import.

- The core (`echo2p2p/*.py`, `echo2p2p/tasks/`, and the pure adapters in PURE_ADAPTERS) is
  sans-IO: it may import only the pure standard-library modules and codecs listed in CORE_STDLIB
  and CORE_THIRD_PARTY. No clock, no threads, no files, no sockets, no processes, no event loop,
  no torch.
- Each I/O sub-package may import what its job needs (SUBPACKAGES) and the core, never the
  applications.
- The applications `hub/` and `peer/` never import each other, under either import path, and
  nothing imports them by their folder names.
- The hub's core (`hub/core/`, echo2p2p.hub.core) is sans-IO like the library's: it may import
  the library's core modules, the hub's config modules, its own modules and the pure
  standard-library modules in HUB_CORE_STDLIB; never an event loop, a socket, a thread, a
  clock, a process or torch, nor the hub's other folders (HUB_CORE_FILES).
- No module of echo2p2p, echo2p2p.hub or echo2p2p.peer imports itself through others, by any
  import: top level, inside a function or under TYPE_CHECKING (module names come from paths, so
  sub-packages are covered as they appear).
The lists are allow-lists: a new import fails here until someone decides where it belongs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "echo2p2p"

CORE_STDLIB = {"__future__", "argparse", "ast", "collections", "dataclasses", "difflib", "enum",
               "hashlib", "heapq", "json", "math", "operator", "random", "re", "string", "struct",
               "textwrap", "types", "typing", "urllib"}
# verifiers of the built-in tasks: math-verify, and reasoning-gym's generators (pure functions of
# config, seed and index, imported only when an rg: task is opened)
CORE_THIRD_PARTY = {"cryptography", "msgpack", "numpy", "zstandard", "math_verify",
                    "reasoning_gym"}
IO_COMMON = {"collections", "contextlib", "dataclasses", "logging", "math", "sys", "time",
             "typing", "__future__"}
SUBPACKAGES = {  # package -> what it may import besides the core and IO_COMMON
    "policy": {"functools", "importlib", "inspect", "os", "pathlib", "shutil", "string",
               "tempfile", "threading", "numpy", "tokenizers", "torch", "transformers", "vllm"},
    "overlay": {"asyncio", "aiohttp", "urllib"},
    "scoring": {"asyncio", "builtins", "concurrent", "ctypes", "importlib", "inspect",
                "multiprocessing", "os", "pickle", "resource", "select", "shutil", "signal",
                "subprocess", "tempfile", "threading"},
    "runtime": {"asyncio", "aiohttp", "atexit", "concurrent", "importlib", "os", "pathlib",
                "prometheus_client", "signal", "socket", "threading", "tqdm", "uvloop"},
    # what other libraries wrote, plugged in as they are: installed environments found by entry
    # point, Gymnasium's and verifiers' (imported only when a run names one), TRL's rewards
    "adapters": {"asyncio", "concurrent", "hashlib", "importlib", "inspect", "pathlib", "signal",
                 "threading", "types", "gymnasium", "verifiers"},
}
# adapter modules that are pure all the same (an environment as a task: seeds as problems): they
# are held to the core's rule
PURE_ADAPTERS = {"environment_task.py"}
APPLICATIONS = {"hub": ROOT / "hub", "peer": ROOT / "peer"}


def imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import anywhere in `tree`, nested ones too, plus
    `importlib.import_module("x")` / `__import__("x")` calls with a literal name. Relative
    imports are reported as ".name" (level dots, then the module)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "id", None) == "__import__"
                   or getattr(node.func, "attr", None) == "import_module")):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(source: str, allowed: set[str], internal_ok: set[str]) -> list[str]:
    """Imports in `source` outside `allowed` top-level names or, inside echo2p2p, outside the
    `internal_ok` second-level names ("" = the core modules themselves)."""
    bad = []
    for line, name in imports(ast.parse(source)):
        if name.startswith("."):
            continue  # inside its own package; the package's own rule covers it
        parts = name.split(".")
        if parts[0] == "echo2p2p":
            second = parts[1] if len(parts) > 1 else ""
            if second in SUBPACKAGES or second in APPLICATIONS:
                if second not in internal_ok:
                    bad.append(f"line {line}: {name}")
            continue
        if parts[0] not in allowed:
            bad.append(f"line {line}: {name}")
    return bad


CORE_FILES = sorted([*CORE.glob("*.py"), *(CORE / "tasks").glob("*.py"),
                     *(CORE / "adapters" / name for name in PURE_ADAPTERS)])
SUB_FILES = sorted((pkg, f) for pkg in SUBPACKAGES for f in (CORE / pkg).glob("*.py"))
APP_FILES = sorted((app, f) for app, d in APPLICATIONS.items() for f in d.rglob("*.py"))


def test_every_module_is_covered():
    """Each .py file under echo2p2p/ falls under one rule (a new sub-package must be given one)."""
    covered = set(CORE_FILES) | {f for _, f in SUB_FILES}
    assert CORE / "messages.py" in covered and CORE / "overlay" / "download.py" in covered
    assert all(path.exists() for path in CORE_FILES)
    assert not set(CORE.rglob("*.py")) - covered


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_is_sans_io(path):
    """A core module imports only pure standard-library modules and codecs, and no sub-package."""
    bad = violations(path.read_text(encoding="utf-8"), CORE_STDLIB | CORE_THIRD_PARTY, set())
    assert not bad, f"{path.relative_to(ROOT)} crosses the core boundary: {bad}"


@pytest.mark.parametrize("pkg,path", SUB_FILES, ids=lambda v: v if isinstance(v, str) else v.name)
def test_subpackage_imports_what_it_owns(pkg, path):
    """A sub-package imports its own tools and the core; never an application."""
    others = set(SUBPACKAGES) - {pkg}
    bad = violations(path.read_text(encoding="utf-8"), IO_COMMON | SUBPACKAGES[pkg] | CORE_STDLIB | CORE_THIRD_PARTY,
                     internal_ok=others)
    assert not bad, f"{path.relative_to(ROOT)} imports outside its rule: {bad}"


@pytest.mark.parametrize("app,path", APP_FILES, ids=lambda v: v if isinstance(v, str) else v.name)
def test_planes_never_import_each_other(app, path):
    """hub/ never imports peer/ and the reverse, as echo2p2p.hub / echo2p2p.peer or by the
    folder's name."""
    other = ({"hub", "peer"} - {app}).pop()
    bad = [f"line {line}: {name}" for line, name in
           imports(ast.parse(path.read_text(encoding="utf-8")))
           if name.split(".")[0] in APPLICATIONS or name.startswith(f"echo2p2p.{other}")]
    assert not bad, f"{path.relative_to(ROOT)} imports another plane or a bare name: {bad}"


def test_one_import_path_everywhere():
    """Code, tests and benches import the applications as echo2p2p.hub / echo2p2p.peer only."""
    files = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("examples/**/*.py"),
             *CORE.rglob("*.py"), *(f for _, f in APP_FILES)]
    bad = [f"{f.relative_to(ROOT)}:{line}: {name}" for f in files
           for line, name in imports(ast.parse(f.read_text(encoding="utf-8")))
           if name.split(".")[0] in APPLICATIONS]
    assert not bad, bad


HUB_CORE = ROOT / "hub" / "core"
HUB_CORE_FILES = sorted(HUB_CORE.glob("*.py"))
HUB_CORE_STDLIB = {"__future__", "collections", "dataclasses", "enum", "functools", "heapq",
                   "ipaddress", "itertools", "logging", "math", "operator", "random", "typing"}
HUB_CONFIG = {"..config", "..config_sections"}  # the hub's config modules, seen from hub/core
# echo2p2p.overlay.tickets is pure (a ticket's URL and signature, no I/O) but lives with the
# overlay's I/O: `Peer.server_url` reads it.
HUB_CORE_LIBRARY_EXCEPTIONS = {"echo2p2p.overlay.tickets"}


def hub_core_violations(source: str) -> list[str]:
    """Imports in a hub/core module outside its rule (see the module docstring)."""
    bad = []
    for line, name in imports(ast.parse(source)):
        if name.startswith(".."):
            ok = name in HUB_CONFIG
        elif name.startswith("."):
            ok = True  # hub/core's own modules
        elif name.split(".")[0] == "echo2p2p":
            second = name.split(".")[1] if "." in name else ""
            ok = (second not in SUBPACKAGES and second not in APPLICATIONS
                  or name in HUB_CORE_LIBRARY_EXCEPTIONS)
        else:
            ok = name.split(".")[0] in HUB_CORE_STDLIB
        if not ok:
            bad.append(f"line {line}: {name}")
    return bad


@pytest.mark.parametrize("path", HUB_CORE_FILES, ids=lambda p: p.name)
def test_hub_core_is_sans_io(path):
    """A hub/core module imports the library's core, the hub's config and pure stdlib only."""
    bad = hub_core_violations(path.read_text(encoding="utf-8"))
    assert not bad, f"{path.relative_to(ROOT)} crosses the hub core's boundary: {bad}"


def test_hub_core_rule_catches_io():
    """The hub core's rule fails on an event loop, a clock, a thread pool, the hub's shell and
    the library's I/O sub-packages (it can go red)."""
    src = ("import asyncio\nimport time\nfrom concurrent.futures import Future\n"
           "from ..serving.peers import PeerConn\nfrom echo2p2p.scoring.scorer import Scorer\n"
           "from echo2p2p import messages as m\nfrom .peer import Peer\nfrom ..config import X\n")
    assert [b.split(": ")[1] for b in hub_core_violations(src)] == [
        "asyncio", "time", "concurrent.futures", "..serving.peers", "echo2p2p.scoring.scorer"]
    assert len(HUB_CORE_FILES) >= 10


def test_scanner_catches_what_a_violation_looks_like():
    """The rules fail on a core module with a clock, a thread or a sub-package import, and on a
    plane importing the other (each rule can go red)."""
    src = ("from .errors import X\nimport time\n"
           "def f():\n    import threading\n    from echo2p2p.overlay.store import ChunkStore\n"
           "    importlib.import_module('os')\n")
    bad = violations(src, CORE_STDLIB | CORE_THIRD_PARTY, internal_ok=set())
    assert [b.split(": ")[1] for b in bad] == ["time", "threading", "echo2p2p.overlay.store", "os"]
    plane = imports(ast.parse("from echo2p2p.peer.client import PeerClient\nimport hub.server\n"))
    assert [n for _, n in plane] == ["echo2p2p.peer.client", "hub.server"]



PACKAGES = {"echo2p2p": CORE, "echo2p2p.hub": ROOT / "hub", "echo2p2p.peer": ROOT / "peer"}


def our_modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Every module of `packages` (dotted name -> folder) by its dotted name, derived from its
    path: sub-packages at any depth, a package being its __init__.py."""
    found = {}
    for package, folder in packages.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            found[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return found


def import_arrows(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules in `modules` that module `name` (at `path`) imports, wherever the import
    stands: top level, inside a function, under `if TYPE_CHECKING`. Relative imports resolve
    against the module's package. An import names the deepest module it reaches (`from a import
    b` is a.b when that is a module, else a); the packages above it are not arrows (Python
    initialises a module's packages before the module, whoever imports it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            wanted += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            wanted += [f"{base}.{alias.name}" for alias in node.names]
    arrows = set()
    for module in wanted:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if module and module != name:
            arrows.add(module)
    return arrows


def import_loops(packages: dict[str, Path]) -> list[tuple[list[str], list[str]]]:
    """The tangles (strongly connected sets) of the import graph of `packages`, each as one
    shortest loop [a, b, ..., a] from its first module a by name, and all its modules."""
    modules = our_modules(packages)
    graph = {name: import_arrows(name, path, modules) for name, path in modules.items()}

    def reach(start: str) -> dict[str, list[str]]:  # module -> a shortest path from start
        paths, todo = {start: [start]}, [start]
        for here in todo:
            for there in sorted(graph[here]):
                if there not in paths:
                    paths[there] = [*paths[here], there]
                    todo.append(there)
        return paths

    reached = {name: reach(name) for name in graph}
    loops, seen = [], set()
    for name in sorted(graph):
        tangle = sorted(other for other in reached[name] if name in reached[other])
        if name in seen or len(tangle) == 1:  # alone: no loop (its own name is no arrow)
            continue
        seen |= set(tangle)
        back = [reached[name][other] + [name] for other in tangle if name in graph[other]]
        loops.append((min(back, key=len), tangle))
    return loops


def test_no_import_loop():
    """No module of echo2p2p, echo2p2p.hub or echo2p2p.peer imports itself through others, not
    even under TYPE_CHECKING or inside a function: the house reads as layers."""
    loops = import_loops(PACKAGES)
    assert not loops, "import loops:\n" + "\n".join(
        f"{' -> '.join(loop)} (in a tangle of {len(tangle)}: {', '.join(tangle)})"
        for loop, tangle in loops)


def test_loop_finder_catches_what_a_loop_looks_like(tmp_path):
    """A loop through a type-only import, a function-level one and a relative import from a
    sub-package is found; `from package import module` is an arrow to the module, not to the
    package's __init__ (which imports the loop's first module), so it closes no loop."""
    app, sub = tmp_path / "app", tmp_path / "app" / "sub"
    sub.mkdir(parents=True)
    (app / "__init__.py").write_text("from .front import Front\n")
    (app / "front.py").write_text("from .sub.inner import f\nfrom . import plain\n")
    (app / "plain.py").write_text("import json\n")
    (sub / "__init__.py").write_text("")
    (sub / "inner.py").write_text("def f():\n    from ..back import B\n")
    (app / "back.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from app.front import Front\n")
    loop = ["app.back", "app.front", "app.sub.inner", "app.back"]
    assert import_loops({"app": app}) == [(loop, sorted(loop[:3]))]
    (app / "back.py").write_text("from app import plain\n")
    assert import_loops({"app": app}) == []
