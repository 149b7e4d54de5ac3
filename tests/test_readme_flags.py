"""Every `echo2-hub` / `echo2-peer` command the README and the docs show uses flags that exist.

The commands are read out of README.md and every page under docs/ as a reader sees them: each
fenced code block (line continuations joined, a `$ ` prompt allowed) and each inline code span,
from the program's name (`echo2-hub`, `echo2-peer`, or `-m echo2p2p.hub.cli` /
`-m echo2p2p.peer.cli` under python or torchrun) to the end of that command (a `#` comment, `&&`,
`||`, `;`, `|` or the line's end). Its subcommand is looked up in the program's own parser
(`build_parser`, the one `--help` prints), and each of its `--flag` or `--flag=value` tokens must
be an option of that subcommand, spelled out in full: argparse would take an unambiguous prefix,
a reader copying it should not have to. A command naming no subcommand is checked against the
program's top-level options. A flag named alone in the text (`--standby cold`) must be an option
of some subcommand of either program, of a script under bench/, or one of another tool's that
the pages name (`OTHERS`). So a renamed or mistyped flag on any page fails here.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from echo2p2p.hub.cli import build_parser as hub_parser
from echo2p2p.peer.cli import build_parser as peer_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PROGRAMS = {"echo2-hub": hub_parser, "echo2-peer": peer_parser,
            "echo2p2p.hub.cli": hub_parser, "echo2p2p.peer.cli": peer_parser}

FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)  # indented too (lists)
INLINE = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # a span may wrap, within its paragraph
PROGRAM = re.compile(r"(?<![\w./-])(echo2-hub|echo2-peer|echo2p2p\.hub\.cli|echo2p2p\.peer\.cli)"
                     r"(?![\w.:-])")  # `echo2-hub: ...` is a message, not a command
END = re.compile(r"\s(?:#|&&|\|\|?|;)")  # a comment or the next command in the shell line
FLAG = re.compile(r"--?[A-Za-z]")  # an option, not a negative number
ANY_FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# Other tools' flags the pages show, with the tool (the benches' own are read from bench/).
OTHERS = {"--no-deps": "pip", "--strict": "mkdocs build", "--standalone": "torchrun",
          "--nnodes": "torchrun", "--rdzv-backend": "torchrun", "--rdzv-endpoint": "torchrun"}


def snippets(text: str) -> Iterator[str]:
    """The page's code: each fenced block's lines (continuations joined), then each inline code
    span outside the blocks."""
    for block in FENCE.findall(text):
        yield from block.replace("\\\n", " ").splitlines()
    yield from (" ".join(span.split()) for span in INLINE.findall(FENCE.sub("", text)))


def commands(line: str) -> Iterator[list[str]]:
    """Each command in `line`, as argv from the program's name to the command's end."""
    for found in PROGRAM.finditer(line):
        tail = END.split(line[found.start():])[0]
        try:
            yield shlex.split(tail)
        except ValueError:  # an unbalanced quote in a prose span: words are enough for flags
            yield tail.split()


def subcommand(argv: list[str]) -> tuple[argparse.ArgumentParser, str]:
    """The parser that reads `argv`'s options: its subcommand's, else the program's top level;
    and the command's name as a reader would call it."""
    parser = PROGRAMS[argv[0]]()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and len(argv) > 1:
            if argv[1] in action.choices:
                return action.choices[argv[1]], f"{argv[0]} {argv[1]}"
    return parser, argv[0]


def unknown_flags(text: str) -> list[str]:
    """'COMMAND: --flag' for each flag of a shown command that its parser does not have, and
    'COMMAND: no subcommand WORD' for a word where a subcommand belongs."""
    wrong = []
    for line in snippets(text):
        for argv in commands(line):
            parser, name = subcommand(argv)
            if name == argv[0] and len(argv) > 1 and re.fullmatch(r"[a-z]+", argv[1]):
                wrong.append(f"{name}: no subcommand {argv[1]}")
            for token in argv[1:]:
                flag = token.split("=", 1)[0]
                if FLAG.match(flag) and flag not in parser._option_string_actions:
                    wrong.append(f"{name}: {flag}")
    return wrong


def every_flag() -> set[str]:
    """Every option of every subcommand of both programs."""
    flags = set()
    for build in (hub_parser, peer_parser):
        for action in build()._actions:
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    flags |= set(parser._option_string_actions)
    return flags


def test_every_documented_flag_exists():
    wrong = [f"{page.relative_to(ROOT)}: {problem}"
             for page in PAGES for problem in unknown_flags(page.read_text())]
    assert not wrong, "\n".join(wrong)


def bench_flags() -> set[str]:
    """Every option a script under bench/ adds to its parser."""
    return {flag for path in (ROOT / "bench").rglob("*.py")
            for flag in re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text())}


def test_every_flag_named_in_the_text_exists():
    known = every_flag() | bench_flags() | set(OTHERS)
    wrong = [f"{page.relative_to(ROOT)}: {flag}" for page in PAGES
             for line in snippets(page.read_text()) for flag in ANY_FLAG.findall(line)
             if flag not in known]
    assert not wrong, "\n".join(wrong)


def test_the_commands_are_found():
    """The reader above sees what a reader sees: the README's recipe, a `$ `-prompted block, a
    torchrun line and inline spans, so a page whose commands were all skipped cannot pass."""
    found = {" ".join(argv[:2]) for page in PAGES for line in snippets(page.read_text())
             for argv in commands(line)}
    assert {"echo2-hub serve", "echo2-hub demo", "echo2-peer join", "echo2-hub plan",
            "echo2-hub token", "echo2-hub status", "echo2-hub report",
            "echo2p2p.hub.cli serve"} <= found, found


def test_a_mistyped_flag_is_caught():
    page = ("Run\n\n```sh\n$ echo2-hub serve --model ./m \\\n    --max-lagg 4  # S\n```\n\n"
            "then `echo2-peer join ws://h:1/ws --price-per-hour=1 --pricee 2 && echo2-hub\n"
            "demo --peers 2`, `echo2-hub serv --lr 1`, "
            "`torchrun -m echo2p2p.hub.cli demo --max-step 3` and `echo2-hub --max-lag 2`.")
    assert unknown_flags(page) == [
        "echo2-hub serve: --max-lagg", "echo2-peer join: --pricee", "echo2-hub: no subcommand serv",
        "echo2-hub: --lr", "echo2p2p.hub.cli demo: --max-step", "echo2-hub: --max-lag"]
