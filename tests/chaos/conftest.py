"""The chaos suite's fixtures: a `Cluster` of real processes that is always torn down, and the
suite table (one row per scenario) printed at the end of the pytest run."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.conftest import markdown_table

from .harness import Cluster


@dataclass(frozen=True)
class Row:
    scenario: str
    admitted_lost: int
    groups_lost: int
    survivors_hold_new_versions: bool
    forger_quarantined: str  # "yes", "no", or "-" where there is no forger
    recover_s: float | None
    note: str = ""


ROWS: list[Row] = []
COLUMNS = ("scenario", "admitted lost", "prompt groups lost", "survivors hold all new versions",
           "forger quarantined", "time to recover (s)", "note")


@pytest.fixture
def cluster(tmp_path):
    """A cluster rooted in the test's tmp dir; every process it started is ended afterwards."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def report():
    """Call with a `Row` to add the scenario to the suite table."""
    return ROWS.append


def table(rows: list[Row]) -> list[str]:
    cells = [COLUMNS] + [(r.scenario, str(r.admitted_lost), str(r.groups_lost),
                          "yes" if r.survivors_hold_new_versions else "NO", r.forger_quarantined,
                          "-" if r.recover_s is None else f"{r.recover_s:.2f}", r.note)
                         for r in rows]
    return markdown_table(cells)


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    terminalreporter.write_sep("=", "chaos suite")
    for line in table(ROWS):
        terminalreporter.write_line(line)
