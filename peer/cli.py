"""`echo2-peer join <hub-url>`: lend this machine's CPU or GPU to a training run.

Heavy imports (torch, transformers, vllm) happen after argument parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable
from typing import Any

from echo2p2p.config import add_arguments, parse_args, resolve
from echo2p2p.errors import ConfigError, JoinRefused

from echo2p2p.runtime import process
from .config import GROUPS, PeerConfig, help_texts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo2-peer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", usage="%(prog)s HUB_URL [options]",
                          help="join a hub and generate rollouts until stopped")
    join.add_argument("hub_url", help="the hub: ws://HOST:PORT/ws, http://HOST:PORT or HOST:PORT")
    join.add_argument("--log-level", default="info", help="debug, info, warning (default: info)")
    join.add_argument("--debug", action="store_true",
                      help="show the traceback of a failure (else one line naming the cause and "
                           "the fix)")
    docs = help_texts(PeerConfig)
    for title, (about, names) in GROUPS.items():
        add_arguments(join.add_argument_group(title, about), PeerConfig, skip=("hub_url",),
                      docs=docs, only=names.split())
    return parser


def main(argv: list[str] | None = None, client: Callable[[PeerConfig], Any] | None = None) -> int:
    """`client`: makes the peer from its config (default: a `PeerClient`)."""
    args = parse_args(build_parser(), argv)
    process.configure(args.log_level)
    try:
        cfg = resolve(PeerConfig, None, vars(args))
    except ConfigError as exc:  # exit code 1: one line naming the field and the fix
        return process.failed("echo2-peer", exc, args.debug)
    return process.run(_join(cfg, client))


async def _join(cfg: PeerConfig, client: Callable[[PeerConfig], Any] | None) -> int:
    from .client import PeerClient

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await (client or PeerClient)(cfg).run(stop)
    except JoinRefused as exc:
        print(f"echo2-peer: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
