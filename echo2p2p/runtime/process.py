"""How an echo2p2p process starts: logging, quieter libraries, and the event loop (uvloop if any);
the loop's clock, the `now` every shell hands its sans-IO core (`loop_now`); and how it ends on a
failure the user can fix (`failed`: one line, exit code 1).

Shared by the `echo2-peer` and `echo2-hub` entry points; nothing else configures logging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any


def configure(log_level: str) -> None:
    """Root logging at `log_level`; transformers' load reports and progress bars off unless debug."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if log_level.lower() != "debug":
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def run(main: Coroutine[Any, Any, int]) -> int:
    """Run `main` to completion on uvloop when installed, else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def loop_now() -> float:
    """The running event loop's clock (monotonic seconds): what the shells pass their cores as
    `now`, so that timers and the core agree on one clock."""
    return asyncio.get_running_loop().time()


def failed(prog: str, exc: BaseException, debug: bool = False) -> int:
    """A failure the user can fix (a bad config, a busy port, a missing file) as one line on
    stderr, `prog: what went wrong and the fix`, and exit code 1; with `debug` (--debug) the
    traceback instead. Unexpected exceptions (our bugs) never come here: they keep theirs."""
    if debug:
        raise exc
    print(f"{prog}: {exc}", file=sys.stderr)
    return 1
