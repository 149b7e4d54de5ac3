"""`--help` of every command and subcommand answers (exit 0, some text), walking each parser's
subcommand tree so that a subcommand added later is covered too."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from echo2p2p.config import add_arguments, field_docs, sections
from bench.assets import make_tiny_base
from bench import sync_baseline
from echo2p2p.hub import cli as hub_cli
from echo2p2p.hub.config import HubConfig
from echo2p2p.peer import cli as peer_cli
from echo2p2p.peer.config import GROUPS, PeerConfig


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple]:
    """Every command path of `parser`: () for the top level, ("serve",), ..."""
    paths = [prefix]
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths += command_paths(sub, prefix + (name,))
    return paths


HUB_PATHS = command_paths(hub_cli.build_parser())
PEER_PATHS = command_paths(peer_cli.build_parser())


def test_the_walk_finds_the_subcommands():
    """The walk sees the subcommands we know of (guards against passing over nothing)."""
    assert {("serve",), ("demo",), ("plan",), ("token",), ("status",),
            ("report",)} <= set(HUB_PATHS)
    assert ("join",) in PEER_PATHS


def _help(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr().out
    assert exit_.value.code == 0, f"{argv} exited {exit_.value.code}"
    return out


@pytest.mark.parametrize("path", HUB_PATHS, ids=lambda p: " ".join(("echo2-hub",) + p))
def test_hub_help(path, capsys):
    """`echo2-hub [SUBCOMMAND] --help` exits 0 and prints usage."""
    out = _help(hub_cli.main, [*path, "--help"], capsys)
    assert out.startswith("usage: echo2-hub") and len(out) > 100


@pytest.mark.parametrize("action", ["create", "list", "revoke"])
def test_hub_token_actions_help(action, capsys):
    """`echo2-hub token ACTION --help` answers too (the action is a positional, not a parser)."""
    assert "create" in _help(hub_cli.main, ["token", action, "--help"], capsys)


@pytest.mark.parametrize("path", PEER_PATHS, ids=lambda p: " ".join(("echo2-peer",) + p))
def test_peer_help(path, capsys):
    """`echo2-peer [SUBCOMMAND] --help` exits 0 and prints usage."""
    out = _help(peer_cli.main, [*path, "--help"], capsys)
    assert out.startswith("usage: echo2-peer") and len(out) > 100


@pytest.mark.parametrize("main", [make_tiny_base.main, sync_baseline.main],
                         ids=["bench.assets.make_tiny_base", "bench.sync_baseline"])
def test_module_entrypoints_help(main, capsys):
    """The `python -m` entrypoints answer `--help` as well."""
    assert _help(main, ["--help"], capsys).startswith("usage:")


def test_percent_in_a_field_docstring_is_literal(capsys):
    """A "%" in a config field's docstring shows as itself in `--help` (argparse would
    otherwise read it as a format directive and raise)."""

    @dataclasses.dataclass(frozen=True)
    class Knobs:
        margin: float = 0.1
        """Provision 10 % more, or 100%."""

    parser = argparse.ArgumentParser(prog="knobs")
    add_arguments(parser, Knobs, docs=field_docs(inspect.getsource(Knobs)))
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "Provision 10 % more, or 100%." in " ".join(capsys.readouterr().out.split())


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices[name]


def _groups(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The argument groups of `parser` by title (argparse keeps them nowhere public)."""
    return {g.title: g for g in parser._action_groups}


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_hub_flags_are_grouped_by_config_section(command):
    """`serve --help` (and `demo --help`) show the hub's flags in one argument group per section
    of HubConfig, titled with its name and described by its docstring, each field's flag in
    its own section's group (the docs render the flag reference from these groups)."""
    groups = _groups(_subparser(hub_cli.build_parser(), command))
    for name, kind in sections(HubConfig).items():
        assert groups[name].description and groups[name].description in kind.__doc__
        assert {a.dest for a in groups[name]._group_actions} == {
            f.name for f in dataclasses.fields(kind)}, name
    assert any("--lr" in a.option_strings for a in groups["grpo"]._group_actions)  # flag names stay


def test_peer_flags_are_grouped():
    """`join --help` shows every PeerConfig field's flag in exactly one described group."""
    groups = _groups(_subparser(peer_cli.build_parser(), "join"))
    grouped = [a.dest for title in GROUPS for a in groups[title]._group_actions]
    assert all(groups[title].description for title in GROUPS)
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(PeerConfig)
                                     if f.name != "hub_url")
