"""The sans-IO boundary: no module under echo2p2p/ imports an IO, clock or tensor library."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "echo2p2p"
FORBIDDEN = {"asyncio", "aiohttp", "torch", "transformers", "vllm", "uvloop", "socket", "time"}
CORE_FILES = sorted(CORE.rglob("*.py"))


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
    """The scan sees the core package (guards against a wrong path passing vacuously)."""
    assert CORE / "messages.py" in CORE_FILES


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_imports_no_io(path):
    """A core module imports none of asyncio, aiohttp, torch, transformers, vllm, uvloop,
    socket or time, at top level or inside a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = [f"line {line}: {root}" for line, root in imported_roots(tree) if root in FORBIDDEN]
    assert not bad, f"{path.relative_to(CORE.parent)} crosses the core boundary: {bad}"


def test_scanner_catches_nested_and_dynamic_imports():
    """The scanner finds imports inside functions and importlib calls, and skips relative ones."""
    src = ("from .errors import X\n"
           "def f():\n    import torch.nn as nn\n    from time import monotonic\n"
           "    importlib.import_module('asyncio')\n")
    assert {root for _, root in imported_roots(ast.parse(src))} == {"torch", "time", "asyncio"}
