"""The sans-IO boundary: no core module under echo2p2p/ imports an IO, clock or tensor library.

The sub-packages that do I/O by nature are listed in SUBPACKAGES with what they may import
beyond the core; they still never import torch, transformers, vllm or a network library.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "echo2p2p"
FORBIDDEN = {"asyncio", "aiohttp", "torch", "transformers", "vllm", "uvloop", "socket", "time"}
# scoring: reward functions in worker processes under a deadline (driver threads, the clock,
# and futures awaited from the event loop).
SUBPACKAGES = {"scoring": {"asyncio", "time"}}
CORE_FILES = sorted(CORE.rglob("*.py"))


def allowed_for(path: Path) -> set[str]:
    """What `path` may import beyond the core's rule (nothing for a core module)."""
    parts = path.relative_to(CORE).parts
    return SUBPACKAGES.get(parts[0], set()) if len(parts) > 1 else set()


def imported_roots(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import anywhere in `tree`, nested ones too,
    plus `importlib.import_module("x")` / `__import__("x")` calls with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "id", None) == "__import__"
                   or getattr(node.func, "attr", None) == "import_module")):
            found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def test_core_files_found():
    """The scan sees the core package and its sub-packages (guards against a wrong path
    passing vacuously), and a listed sub-package exists."""
    assert CORE / "messages.py" in CORE_FILES and CORE / "scoring" / "scorer.py" in CORE_FILES
    assert all((CORE / name).is_dir() for name in SUBPACKAGES)


def test_only_listed_subpackages_are_exempt():
    """Core modules, and tasks/, get no exemption; scoring/ gets asyncio and time only."""
    assert allowed_for(CORE / "messages.py") == set()
    assert allowed_for(CORE / "tasks" / "math.py") == set()
    assert allowed_for(CORE / "scoring" / "scorer.py") == {"asyncio", "time"}


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_imports_no_io(path):
    """A core module imports none of asyncio, aiohttp, torch, transformers, vllm, uvloop,
    socket or time, at top level or inside a function; a listed sub-package only what it is
    allowed besides."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    forbidden = FORBIDDEN - allowed_for(path)
    bad = [f"line {line}: {root}" for line, root in imported_roots(tree) if root in forbidden]
    assert not bad, f"{path.relative_to(CORE.parent)} crosses the core boundary: {bad}"


def test_scanner_catches_nested_and_dynamic_imports():
    """The scanner finds imports inside functions and importlib calls, and skips relative ones."""
    src = ("from .errors import X\n"
           "def f():\n    import torch.nn as nn\n    from time import monotonic\n"
           "    importlib.import_module('asyncio')\n")
    assert {root for _, root in imported_roots(ast.parse(src))} == {"torch", "time", "asyncio"}
