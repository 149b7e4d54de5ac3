"""Frozen-dataclass configs: field docstrings become `--help`, TOML and flags override defaults.

A config class is a frozen dataclass whose every field carries a docstring right below it (the
CleanRL `Args` convention), or a frozen dataclass of such classes, its sections (the hub's).
`add_arguments` turns the fields into flags (`max_lag` -> `--max-lag`), one argument group per
section; `resolve` layers defaults < TOML table < flags and names the field on any bad value.
A sectioned config keeps flat names outside: flags, TOML keys (a `[section]` table works too)
and `as_dict` use the field names, unique across sections. No I/O here: the shell that defines
a config class reads its source (`inspect.getsource`) and passes the text to `field_docs`; the
TOML file is read by the caller.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import dataclasses
import textwrap
import typing
from collections.abc import Collection, Mapping
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


def sections(cls: type) -> dict[str, type]:
    """The sections of a config made of sections, by field name ({} for a flat config)."""
    hints = typing.get_type_hints(cls)
    types = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    if all(dataclasses.is_dataclass(t) for t in types.values()):
        return types
    return {}


def owners(cls: type) -> dict[str, str]:
    """The section of each field of a sectioned config, by field name; ValueError if two
    sections share a field name (flags and TOML keys are flat)."""
    owner: dict[str, str] = {}
    for section, kind in sections(cls).items():
        for f in dataclasses.fields(kind):
            if f.name in owner:
                raise ValueError(f"{f.name} is a field of both {owner[f.name]} and {section}")
            owner[f.name] = section
    return owner


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                  skip: tuple[str, ...] = (), *, docs: Mapping[str, str],
                  only: Collection[str] | None = None) -> None:
    """One `--flag` per field (of `only` if given), helped by `docs` (`field_docs` of the
    class's source); defaults are left as None so TOML can sit underneath. A sectioned config's
    flags go in one argument group per section, titled with its name and described by its
    docstring's first line."""
    if parts := sections(cls):
        for name, kind in parts.items():
            about = (kind.__doc__ or "").strip().splitlines()[0]
            add_arguments(parser.add_argument_group(name, about), kind, skip, docs=docs)
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or only is not None and f.name not in only:
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


def resolve(cls: type[C], toml_table: Mapping[str, Any] | None = None,
            flags: Mapping[str, Any] | None = None) -> C:
    """defaults < TOML < flags, each value converted to the field's type. For a sectioned
    config the TOML table holds field names, or section tables of them."""
    parts = sections(cls)
    if not parts:
        return _resolve_flat(cls, toml_table or {}, flags or {})
    tables = _split(cls, toml_table or {})
    return cls(**{name: _resolve_flat(kind, tables[name], flags or {})
                  for name, kind in parts.items()})


def from_flat(cls: type[C], fields: Mapping[str, Any]) -> C:
    """A sectioned config from field names (`HubConfig.from_flat(lr=0.01)`); values are used as
    given, unconverted."""
    split = _split(cls, fields)
    return cls(**{name: kind(**split[name]) for name, kind in sections(cls).items()})


# `Any` below: a field's value, from TOML or the command line, before `_convert` types it.
def replace(config: C, **fields: Any) -> C:
    """`config` with the fields named (flat names) changed, every section checked again."""
    changed = _split(type(config), fields)
    return dataclasses.replace(config, **{  # type: ignore[type-var]
        name: dataclasses.replace(getattr(config, name), **values)
        for name, values in changed.items() if values})


def as_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain values, by field name (a sectioned config's flattened),
    for logging and saving with the run."""
    if not sections(type(config)):
        return dataclasses.asdict(config)
    return {k: v for f in dataclasses.fields(config)
            for k, v in dataclasses.asdict(getattr(config, f.name)).items()}


def _split(cls: type, table: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A table of field names and section tables, split by section; ConfigError naming a key
    that is neither."""
    parts, owner = sections(cls), owners(cls)
    split: dict[str, dict[str, Any]] = {name: {} for name in parts}
    for key, value in table.items():
        if key in parts and isinstance(value, Mapping):
            for inner, v in value.items():
                name = inner.replace("-", "_")
                if owner.get(name) != key:
                    raise ConfigError(f"{key}.{inner}", f"not a field of [{key}]; its fields: "
                                      f"{', '.join(f.name for f in dataclasses.fields(parts[key]))}")
                split[key][name] = v
            continue
        name = key.replace("-", "_")
        if name not in owner:
            raise ConfigError(key, f"unknown field; known: {', '.join(sorted(owner))}")
        split[owner[name]][name] = value
    return split


def _resolve_flat(cls: type[C], toml_table: Mapping[str, Any], flags: Mapping[str, Any]) -> C:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in toml_table.items():
        name = key.replace("-", "_")
        if name not in names:
            raise ConfigError(key, f"unknown field; known: {', '.join(sorted(names))}")
        values[name] = value
    values.update({k: v for k, v in flags.items() if k in names and v is not None})
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


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, except that an unknown flag is reported by the subcommand it
    was given to (its usage, not the top level's), with the closest flag it has: `--max-lagg`
    -> "did you mean --max-lag?". Exits 2, as argparse does for any usage error."""
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    command = parser
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            command = action.choices.get(getattr(args, action.dest, None), parser)
    flags = [s for a in command._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in filter(lambda a: a.startswith("--"), extra):
        name = arg.split("=")[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.8)
        if name in flags:  # given before the subcommand's name
            hints.append(f"{name} goes after the subcommand: {command.prog} {name} ...")
        elif close:
            hints.append(f"did you mean {close[0]}?")
    command.error(f"unrecognized arguments: {' '.join(extra)}"
                  + (f" ({'; '.join(hints)})" if hints else ""))
