"""How an echo2p2p process starts: logging under the log budget, quieter libraries, and the event
loop (uvloop if any); the loop's clock, the `now` every shell hands its sans-IO core
(`loop_now`); and how it ends on a failure the user can fix (`failed`: one line, exit code 1).

Shared by the `echo2-peer` and `echo2-hub` entry points; nothing else configures logging.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Coroutine
from typing import Any

from echo2p2p.log_budget import LogBudget, Suppressed

SUMMARY_LOGGER = "echo2p2p.log_budget"  # the summaries' own: never held back
_JUDGED = "_echo2p2p_log_budget"  # a record's verdict, kept on it for the next handler


def configure(log_level: str) -> LogBudgetFilter:
    """Root logging at `log_level`, every root handler under one log budget (returned);
    transformers' load reports and progress bars off unless debug."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    budget = LogBudgetFilter()
    for handler in logging.getLogger().handlers:
        for earlier in [f for f in handler.filters if isinstance(f, LogBudgetFilter)]:
            handler.removeFilter(earlier)
        handler.addFilter(budget)
    atexit.register(budget.close)  # before logging's own shutdown (atexit runs last in first)
    if log_level.lower() != "debug":
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return budget


class LogBudgetFilter(logging.Filter):
    """The log budget (`echo2p2p.log_budget`) on log handlers, so that no peer can fill the disk
    with lines it makes the process log: INFO and WARNING lines past the budget of their kind
    (the logger and the format string) are counted, not written, and when the window ends one
    line per kind says how many, at the highest level held back. DEBUG (asked for on purpose)
    and ERROR and above (a bug's traceback must never be hidden) always pass. The summary comes
    from a timer armed at the first line held back, so it is written even if no line follows.
    A record is judged once, whichever handler sees it first; records come from any thread.
    `held_back` and `told` count the lines held back and those the summaries have told of."""

    def __init__(self, budget: LogBudget | None = None):
        super().__init__()
        self.budget = budget or LogBudget()
        self.held_back = self.told = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        verdict = record.__dict__.get(_JUDGED)
        if verdict is None:
            verdict, told = True, []
            if logging.INFO <= record.levelno < logging.ERROR and record.name != SUMMARY_LOGGER:
                with self._lock:
                    told = self._due(record.created)
                    kind = (record.name, str(record.msg)[:200])
                    verdict = self.budget.admit(kind, record.levelno, record.created)
                    self.held_back += not verdict
                    self._arm()
            record.__dict__[_JUDGED] = verdict
            self._tell(told)
        return verdict

    def close(self) -> None:
        """Stop the timer and write what is owed now (at exit)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            end = self.budget.window_end
            told = [] if end is None else self._due(max(end, time.time()))
        self._tell(told)

    def _due(self, now: float) -> list[Suppressed]:
        """(Under the lock.) `LogBudget.due`, counted in `told`."""
        told = self.budget.due(now)
        self.told += sum(s.lines for s in told)
        return told

    def _arm(self) -> None:
        """(Under the lock.) A timer for the open window's end, once it holds a line back."""
        end = self.budget.window_end
        if self._timer is None and end is not None and self.budget.holding:
            self._timer = threading.Timer(max(0.0, end - time.time()), self._on_timer, (end,))
            self._timer.daemon = True
            self._timer.start()

    def _on_timer(self, end: float) -> None:
        with self._lock:
            self._timer = None
            now = time.time()
            if self.budget.window_end == end:  # the window it was armed for: ended, by its clock
                now = max(now, end)
            told = self._due(now)
            self._arm()  # a newer window that holds lines back gets its own
        self._tell(told)

    def _tell(self, told: list[Suppressed]) -> None:
        log = logging.getLogger(SUMMARY_LOGGER)
        for s in told:
            name, msg = s.kind if isinstance(s.kind, tuple) else ("", str(s.kind))
            log.log(s.level, "%s: %d more lines like %r in the last %.0f s (%d of a kind are "
                    "logged a window)", name or "various", s.lines, msg, s.window_s,
                    self.budget.lines_per_window)


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
