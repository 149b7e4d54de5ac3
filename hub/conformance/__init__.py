"""A conformance kit for peer implementations: `python -m echo2p2p.hub.conformance --peer
"CMD {url}"` runs a hub of its own, starts the peer under test against it and checks it rule
by rule against docs/protocol/ (docs/guides/conformance.md). One line per rule, each named by
its spec section: pass, FAIL (what was seen) or skipped (why); the exit status is 1 if any
rule failed.

It lives under the hub because it runs one (`hub.run.start.start_hub`); it knows the
peer only by what crosses the wire.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path

from .verdicts import PHASES, Report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The kit's options (also `echo2-hub conformance`'s)."""
    parser.add_argument("--peer", default="",
                        help="the command line that starts the peer under test, {url} standing "
                             "for the hub's websocket URL (e.g. \"echo2-peer join {url}\"); "
                             "without it the kit prints the URL and waits for a peer started "
                             "by hand")
    parser.add_argument("--only", default=",".join(PHASES),
                        help=f"the phases to run, comma-separated, of {', '.join(PHASES)} "
                             "(default: all); the join, the first version and the close-code "
                             "rule are always checked")
    parser.add_argument("--work-dir", default="",
                        help="where the hub's run and the peer's output go (default: a new "
                             "temporary directory)")


def run(args: argparse.Namespace) -> int:
    """Run the kit; 0 if the peer conforms, 1 if any rule failed, 2 for an unknown phase."""
    phases = {p.strip() for p in args.only.split(",") if p.strip()}
    if unknown := phases - set(PHASES):
        print(f"conformance: unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")
    from .kit import check

    report = Report()
    with tempfile.TemporaryDirectory(prefix="echo2-conformance-") as tmp:
        work_dir = Path(args.work_dir or tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        asyncio.run(check(args.peer or None, phases, work_dir, report))
    print(report.summary(), flush=True)
    return 1 if report.failed else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m echo2p2p.hub.conformance`."""
    parser = argparse.ArgumentParser(prog="python -m echo2p2p.hub.conformance",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
