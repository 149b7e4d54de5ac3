"""A run log read back: the step records, evaluations and propagation records of a run.

`read_run(run_dir)` sorts out RUN_DIR/metrics.jsonl (written by `echo2p2p.hub.view.runlog`) and
RUN_DIR/config.json into a `RunData`, for `echo2-hub report` and its figures. A line that is not
a JSON object is skipped and counted; a run log without a single step record is an error naming
it. Only reads; knows nothing of a live hub, of matplotlib or of HTML.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RunData:
    """What a run log holds, sorted out."""

    steps: list[dict[str, Any]]
    evals: list[tuple[float, float]]  # (version, held-out accuracy), the base ones too
    propagation: dict[int, dict[str, Any]]  # version -> its last propagation record
    config: dict[str, Any]
    skipped: int  # lines that were not JSON objects
    first_skipped: int | None  # the line number of the first of them
    elapsed_s: list[float]  # the run's clock at each step: its learner loops' seconds, over
    # every process of a resumed run (the hub's downtime left out)

    @property
    def run_id(self) -> str:
        return str(self.config.get("run_id") or "unknown run")


# `value`: a JSON value from the run log.
def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_run(run_dir: Path) -> RunData:
    """The run log of `run_dir`; OSError if it cannot be read, ValueError if it has no step."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no run log {path} (a run directory holds the metrics.jsonl "
                                f"and config.json that echo2-hub serve or demo wrote)")
    # Keyed by step and version: a resumed run logs again the steps after its checkpoint, and
    # the later record is the one the run went on from.
    steps, wall, evals, propagation = {}, {}, {}, {}
    skipped, first, offset, previous = 0, None, 0.0, 0.0
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                skipped, first = skipped + 1, first or number
                continue
            event = record.get("event")
            if event == "resume" and finite(record.get("time_s")):  # the run's clock goes on
                offset, previous = 0.0, record["time_s"]
            elif event == "resume":  # a run log of before: time_s counted from each process's
                offset, previous = offset + previous, 0.0  # learner loop (with the steps redone)
            elif event is None and isinstance(record.get("step"), int):
                t = record["time_s"] if finite(record.get("time_s")) else previous
                offset += previous if t < previous else 0.0  # restarted, its resume unlogged
                steps[record["step"]], wall[record["step"]], previous = record, offset + t, t
            elif event == "propagation" and isinstance(record.get("version"), int):
                propagation[record["version"]] = record
            if (event in (None, "eval") and finite(record.get("eval/accuracy"))
                    and finite(record.get("version"))):
                evals[record["version"]] = record["eval/accuracy"]
    if not steps:
        raise ValueError(f"{path} has no step records: no learner step was logged there (is it "
                         f"a run directory of echo2-hub serve or demo?)")
    try:
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    return RunData([steps[k] for k in sorted(steps)], sorted(evals.items()), propagation,
                   config if isinstance(config, dict) else {}, skipped, first,
                   [wall[k] for k in sorted(steps)])


def values(steps: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in steps if finite(r.get(key))]


def trained_lags(steps: list[dict[str, Any]]) -> dict[int, int]:
    """Groups trained on, by lag in versions, over the whole run."""
    total: dict[int, int] = {}
    for record in steps:
        hist = record.get("rollout/staleness_hist")
        for lag, n in (hist.items() if isinstance(hist, dict) else ()):
            if str(lag).isdigit() and isinstance(n, int):
                total[int(lag)] = total.get(int(lag), 0) + n
    return dict(sorted(total.items()))
