"""The log budget on real logging handlers (`process.LogBudgetFilter`): a flood of one kind
writes its budget and one summary line, written by the timer when no further line comes;
errors and debug lines always pass; a record is judged once whatever the handlers."""

from __future__ import annotations

import logging
import threading

import pytest

from echo2p2p.log_budget import LogBudget
from echo2p2p.runtime import process
from echo2p2p.runtime.process import SUMMARY_LOGGER, LogBudgetFilter

GUARD_S = 30.0  # a summary that never comes fails here; nothing here is timed


class Lines(logging.Handler):
    """Keeps what it is given to write; `told` is set by the first summary line."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[logging.LogRecord] = []
        self.told = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record)
        if record.name == SUMMARY_LOGGER:
            self.told.set()


@pytest.fixture
def logged():
    """A function making a logger of its own whose records go through a `LogBudgetFilter` (of
    a `LogBudget(**kwargs)`) to two `Lines` handlers, and the summaries too; undone after."""
    made = []

    def make(**kwargs):
        budget = LogBudgetFilter(LogBudget(**kwargs))
        handlers = [Lines(), Lines()]
        loggers = [logging.getLogger("tests.peer_facing"), logging.getLogger(SUMMARY_LOGGER)]
        for handler in handlers:
            handler.addFilter(budget)
        for logger in loggers:
            logger.setLevel(logging.DEBUG)
            for handler in handlers:
                logger.addHandler(handler)
        made.append((budget, handlers, loggers))
        return loggers[0], handlers, budget

    yield make
    for budget, handlers, loggers in made:
        budget.close()
        for logger in loggers:
            for handler in handlers:
                logger.removeHandler(handler)
            logger.setLevel(logging.NOTSET)


def test_a_flood_of_one_kind_writes_its_budget_then_one_summary(logged):
    """10,000 lines of one call site: 60 written (to each handler: judged once), the rest told
    in one line when the window closes; another kind keeps its own budget."""
    log, (first, second), budget = logged()
    for i in range(10_000):
        log.info("p%d reports relay %s on v%d: %s", 7, "p1", i, "stall")
    log.info("peer joined: %s", "p9")
    assert len(first.lines) == len(second.lines) == 61
    budget.close()  # as at exit: what is owed is written now
    [summary] = [r.getMessage() for r in first.lines if r.name == SUMMARY_LOGGER]
    assert "9940 more lines like 'p%d reports relay %s on v%d: %s'" in summary
    assert "tests.peer_facing" in summary


def test_errors_and_debug_lines_always_pass(logged):
    """A bug's traceback is never held back, nor a line the operator asked for with debug."""
    log, (lines, _), _ = logged()
    for _ in range(500):
        log.error("a bug: %s", "boom")
        log.debug("chunk %d", 1)
    assert len(lines.lines) == 1000


def test_the_summary_is_written_when_no_further_line_comes(logged):
    """The summary comes from the timer armed at the first line held back, at the window's end,
    with no later record to carry it."""
    log, (lines, _), _ = logged(lines_per_window=2, window_s=0.2)
    for _ in range(50):
        log.warning("cutting off %s: not reading", "p3")
    assert lines.told.wait(GUARD_S)
    summary = lines.lines[-1]
    assert summary.levelno == logging.WARNING and "48 more lines" in summary.getMessage()
    assert len(lines.lines) == 3


def test_configure_puts_every_root_handler_under_one_budget(monkeypatch):
    """`process.configure` (both mains call it) adds one budget to each root handler."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [Lines(), Lines()])
    budget = process.configure("info")
    try:
        assert all(budget in h.filters for h in root.handlers)
        again = process.configure("info")  # a second call replaces it, never stacks two
        assert all(h.filters == [again] for h in root.handlers)
        again.close()
    finally:
        budget.close()
