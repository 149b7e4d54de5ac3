"""The hostile suite's fixtures: the suite table (one row per attack, from measured values
only, printed at the end of the pytest run) and the honest baseline run that the poisoning
attacks' held-out accuracy is compared with."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from dataclasses import dataclass, replace

import pytest

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.run.start import start_hub

from tests.conftest import markdown_table, running_peers

ACCURACY_STEPS = 40
# |accuracy difference| within noise (as tests/hub/learning/test_learning.py: ~3 standard errors)
NOISE = 0.1


def accuracy_cfg(run_dir: str) -> HubConfig:
    """The learning run of tests/hub/learning/test_learning.py (~0.25 -> ~0.75 in 40 steps),
    with every rollout group spot-checked, as the report of the text lie had it."""
    return HubConfig.from_flat(port=0, max_steps=ACCURACY_STEPS, max_lag=2, prompts_per_step=8,
                     group_size=8, eval_every=ACCURACY_STEPS, eval_problems=200,
                     spot_check_fraction=1.0, run_dir=run_dir, torch_threads=1, seed=1)


@dataclass
class Row:
    """One attack as the table shows it; a test fills it in as it measures."""

    attack: str
    reaction: str = "?"
    hub_alive: str = "?"
    honest_training: str = "?"
    steps_per_min: str = "-"  # "without / with" the attacker, measured in one run
    accuracy: str = "-"  # "without / with" for poisoning attacks
    note: str = ""
    result: str = "?"


ROWS: list[Row] = []
COLUMNS = ("attack", "hub's reaction (close code, reason, counter/trust event)", "hub alive",
           "honest peer still training", "steps/min without / with attacker",
           "held-out accuracy without / with attacker", "note", "test")


_OUTCOME = pytest.StashKey[str]()  # the test's outcome, for its row


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" or (report.when == "setup" and report.failed):
        item.stash[_OUTCOME] = report.outcome
    return report


@pytest.fixture
def row(request):
    """A `Row` for this test's attack, added to the table whether the test passes or not."""
    made: list[Row] = []

    def start(attack: str) -> Row:
        made.append(Row(attack))
        return made[-1]

    yield start
    outcome = request.node.stash.get(_OUTCOME, "error")
    for r in made:
        ROWS.append(replace(r, result={"passed": "pass", "failed": "FAIL"}.get(outcome, outcome)))


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def cell_accuracy(without: float, with_: float) -> str:
    return f"{without:.3f} / {with_:.3f}"


@dataclass(frozen=True)
class Baseline:
    base: float  # v0, before training
    final: float  # after ACCURACY_STEPS steps, one honest peer, no attacker


@pytest.fixture(scope="session")
def honest_baseline(tmp_path_factory) -> Baseline:
    """The honest run (one peer, no attacker) that every poisoning attack is compared with:
    run once per session, on its own event loop in a thread, so any test loop can use it."""

    async def honest() -> Baseline:
        cfg = accuracy_cfg(str(tmp_path_factory.mktemp("baseline") / "run"))
        async with start_hub(cfg, stream=None) as run, running_peers(run.url, 1, torch_threads=1):
            await asyncio.wait_for(run.finished.wait(), 240)
        evals = [r["eval/accuracy"] for r in run.records if "eval/accuracy" in r]
        return Baseline(evals[0], evals[-1])

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        baseline = pool.submit(asyncio.run, honest()).result()
    assert baseline.final - baseline.base >= 0.25, f"the honest run did not learn: {baseline}"
    return baseline


def _by_item(r: Row) -> tuple[tuple[int, ...], str]:
    """Rows in the issues' order: attacks are labelled "<item number>. ..." (an earlier round),
    "R3-<item number>. ..." (issue 28's round three) or "<issue>-<item number>. ..." (issue 42
    on, after round three), optionally with a letter ("5a.")."""
    label = r.attack.split(". ", 1)[0]
    numbers = tuple(int(n) for n in re.findall(r"\d+", label))
    return (numbers if label.startswith("R") or "-" in label else (0, *numbers)), r.attack


def table(rows: list[Row]) -> list[str]:
    return markdown_table([COLUMNS] + [(r.attack, r.reaction, r.hub_alive, r.honest_training,
                                        r.steps_per_min, r.accuracy, r.note, r.result)
                                       for r in rows])


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    terminalreporter.write_sep("=", "hostile-peer suite")
    for line in table(sorted(ROWS, key=_by_item)):
        terminalreporter.write_line(line)
