"""The hub's shell stays a pump: at most 12 public names on `Hub` (issue 44), counted from the
source (methods, class attributes and the attributes `__init__` sets), so a new public helper
has to push another out or live in the core."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[3] / "hub" / "serving" / "server.py"


def public_names(source: str, cls: str) -> set[str]:
    tree = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = {b.name for b in tree.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {t.id for b in tree.body if isinstance(b, ast.Assign) for t in b.targets
              if isinstance(t, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
              and isinstance(n.value, ast.Name) and n.value.id == "self"
              and isinstance(n.ctx, ast.Store)}
    return {n for n in names if not n.startswith("_")}


def test_the_shell_has_at_most_twelve_public_names():
    names = public_names(SERVER.read_text(encoding="utf-8"), "Hub")
    assert len(names) <= 12, sorted(names)
    assert {"feed", "until", "core"} <= names  # the one way in, the waits, the decisions


def test_the_count_sees_methods_attributes_and_properties():
    src = ("class Hub:\n    x = property(lambda self: 1)\n    def __init__(self):\n"
           "        self.a, self._b = 1, 2\n    def f(self): ...\n    async def _g(self): ...\n")
    assert public_names(src, "Hub") == {"x", "a", "f"}
