"""Size rules of the house (CONTRIBUTING.md, "The rules the tests hold"): no module over 400
lines unless its opening docstring says why (a line starting "Over 400 lines:"), none over 600
at all, and no function over 60; in the library, both applications and the benchmarks (bench/).
One concept per file: a long file or function hides its cases."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(f for d in ("echo2p2p", "hub", "peer", "bench") for f in (ROOT / d).rglob("*.py"))
MAX_LINES, HARD_MAX_LINES, MAX_FUNCTION_LINES = 400, 600, 60
WHY = "Over 400 lines:"


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """name (lines) of every function or method in `source` longer than `limit` lines."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size(path):
    """A module is at most 400 lines, or says why in its docstring, and never over 600."""
    source = path.read_text(encoding="utf-8")
    lines = source.count("\n")
    doc = ast.get_docstring(ast.parse(source)) or ""
    assert lines <= HARD_MAX_LINES, f"{lines} lines: split it by concept"
    assert lines <= MAX_LINES or WHY in doc, f"{lines} lines and no '{WHY}' in its docstring"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_function_size(path):
    """No function or method is longer than 60 lines."""
    assert not long_functions(path.read_text(encoding="utf-8"))


def test_rules_can_fail():
    """The function rule sees a long nested function (so a green run means something)."""
    body = "".join(f"        x{i} = {i}\n" for i in range(70))
    assert long_functions(f"class A:\n    def f(self):\n{body}") == ["f (71 lines)"]


def test_the_rules_are_the_guides():
    """The contributor guide this file cites states these limits: a limit changed in one place
    only fails here."""
    guide = (ROOT / "CONTRIBUTING.md").read_text()
    assert "tests/test_house_rules.py" in guide
    for said in (f"at most {MAX_LINES} lines", f'"{WHY}"', f"never over {HARD_MAX_LINES}",
                 f"a function is at most {MAX_FUNCTION_LINES} lines"):
        assert said in " ".join(guide.split()), said
