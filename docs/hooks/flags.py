"""MkDocs hook: the flag reference, generated from the command lines' own parsers.

A page holds `<!-- flags: echo2-hub serve -->`; this hook replaces the marker with one section
per argparse group of that (sub)command, and one row per flag: its names, its default and its
help, which is the config field's docstring. So the reference cannot drift from `--help`.
"""

from __future__ import annotations

import argparse
import re

from echo2p2p.hub.cli import build_parser as hub_parser
from echo2p2p.peer.cli import build_parser as peer_parser

MARKER = re.compile(r"<!-- flags: (echo2-hub|echo2-peer) (\w+) -->")
PROGRAMS = {"echo2-hub": hub_parser, "echo2-peer": peer_parser}


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: render(m.group(1), m.group(2)), markdown)


def subcommand(program: str, name: str) -> argparse.ArgumentParser:
    parser = PROGRAMS[program]()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(f"{program} has no subcommands")


def render(program: str, name: str) -> str:
    """One `###` section per argument group that holds a flag, in the parser's order."""
    parser = subcommand(program, name)
    out = []
    for group in parser._action_groups:
        rows = [row(a) for a in group._group_actions if a.help is not argparse.SUPPRESS
                and not isinstance(a, argparse._HelpAction)]
        if not rows:
            continue
        title = {"positional arguments": "arguments"}.get(group.title, group.title or "")
        title = title[:1].upper() + title[1:]
        out += [f"### {title}", ""]
        if group.description:
            out += [_cell(group.description), ""]
        out += ["| flag | default | what it does |", "|---|---|---|", *rows, ""]
    return "\n".join(out)


def row(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
    text, default = _help_and_default(action)
    return f"| {names} | {default} | {_cell(text)} |"


def _help_and_default(action: argparse.Action) -> tuple[str, str]:
    """The help without its "(default: X)" tail, and the default: that tail's X where the help
    names one (config fields do: their flags default to None so TOML can sit below them),
    else the action's own default."""
    text = action.help or ""
    text = text % {**vars(action), "default": action.default} if "%(" in text else text
    text = text.replace("%%", "%")
    named = re.search(r"\s*\(default: (.*)\)\s*$", text, flags=re.S)
    if named:
        return text[:named.start()], f"`{named.group(1)}`"
    if not action.option_strings or action.default in (None, argparse.SUPPRESS):
        return text, ""
    return text, f"`{action.default!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
