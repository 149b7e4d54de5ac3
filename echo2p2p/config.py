"""Frozen-dataclass configs: field docstrings become `--help`, TOML and flags override defaults.

A config class is a frozen dataclass whose every field carries a docstring right below it (the
CleanRL `Args` convention). `add_arguments` turns the fields into flags (`max_lag` ->
`--max-lag`); `resolve` layers defaults < TOML table < flags and names the field on any bad
value. No I/O here: the shell that defines a config class reads its source
(`inspect.getsource`) and passes the text to `field_docs`; the TOML file is read by the caller.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import textwrap
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import ConfigError

C = TypeVar("C")


def field_docs(source: str) -> dict[str, str]:
    """The docstring under each field of the dataclass whose source text is `source` (the class
    statement, as `inspect.getsource` gives it), by field name."""
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (), *,
                  docs: Mapping[str, str]) -> None:
    """One `--flag` per field, helped by `docs` (`field_docs` of the class's source); defaults
    are left as None so TOML can sit underneath."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        # argparse %-formats help strings: a literal "%" in a docstring ("10 % more") must be
        # doubled, or `--help` raises ValueError.
        help_text = f"{docs.get(f.name, '')} (default: {f.default!r})".replace("%", "%%")
        if hints[f.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(flag, default=None, metavar=f.name.upper(), help=help_text)


def resolve(cls: type[C], toml_table: dict[str, Any] | None = None,
            flags: dict[str, Any] | None = None) -> C:
    """defaults < TOML < flags, each value converted to the field's type."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in (toml_table or {}).items():
        name = key.replace("-", "_")
        if name not in names:
            raise ConfigError(key, f"unknown field; known: {', '.join(sorted(names))}")
        values[name] = value
    values.update({k: v for k, v in (flags or {}).items() if k in names and v is not None})
    converted = {name: _convert(name, value, hints[name]) for name, value in values.items()}
    try:
        return cls(**converted)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(cls.__name__, str(exc)) from None


def _convert(name: str, value: Any, typ: Any) -> Any:
    if typing.get_origin(typ) is not None:  # `str | None`
        if value is None or value == "":
            return None
        typ = next(t for t in typing.get_args(typ) if t is not type(None))
    if isinstance(value, typ) and not (typ is int and isinstance(value, bool)):
        return value
    if typ is bool and isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
    try:
        if typ in (int, float, str) and not isinstance(value, bool):
            return typ(value)
    except (TypeError, ValueError):
        pass
    raise ConfigError(name, f"expected {typ.__name__}, got {value!r}")


def as_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain values, for logging and saving with the run."""
    return dataclasses.asdict(config)
