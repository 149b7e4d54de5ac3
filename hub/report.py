"""`echo2-hub report RUN_DIR`: the figures of a run, as PNGs and one self-contained HTML page.

Reads the run log (RUN_DIR/metrics.jsonl: step records and events, see `echo2p2p.hub.runlog`)
and RUN_DIR/config.json, draws reward.png, staleness.png, utilization.png, propagation.png and
cost.png (`echo2p2p.hub.report_figures`, matplotlib) and writes report.html: a summary table
and the PNGs inline as base64 data URIs, so the one file can be mailed or attached. Only reads
the run dir and writes the output dir; knows nothing of a live hub. A line that is not a JSON
object is skipped and counted; a run log without a single step record is an error naming it.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EDGE_STEPS = 5  # "reward first/last" are means over this many steps at each end


@dataclass
class RunData:
    """What a run log holds, sorted out."""

    steps: list[dict[str, Any]]
    evals: list[tuple[float, float]]  # (version, held-out accuracy), the base ones too
    propagation: dict[int, dict[str, Any]]  # version -> its last propagation record
    config: dict[str, Any]
    skipped: int  # lines that were not JSON objects
    first_skipped: int | None  # the line number of the first of them
    elapsed_s: list[float]  # wall time at each step: the processes' learner loops added up
    # (with the time of the steps done again after a resume)

    @property
    def run_id(self) -> str:
        return str(self.config.get("run_id") or "unknown run")


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
            if event == "resume":  # time_s counts from each process's learner loop
                offset, previous = offset + previous, 0.0
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


def summary(data: RunData) -> list[tuple[str, str]]:
    """The summary table's rows, (what, value)."""
    steps, last = data.steps, data.steps[-1]
    rewards = values(steps, "train/reward_mean")
    trained = trained_lags(steps)
    groups = sum(trained.values())
    best = max(data.evals, key=lambda e: e[1], default=None)
    t90 = [r["t90_s"] for r in data.propagation.values() if finite(r.get("t90_s"))]
    edge = min(EDGE_STEPS, len(rewards))
    rows = [
        ("steps", f"{len(steps)} (last version {last.get('version', '-')})"),
        ("wall time (learner loop)", f"{data.elapsed_s[-1] / 60:.1f} min"),
        (f"reward, first / last {edge} steps (mean)",
         f"{_fmt(statistics.fmean(rewards[:edge]))} / {_fmt(statistics.fmean(rewards[-edge:]))}"
         if rewards else "-"),
        ("best held-out accuracy", f"{_fmt(best[1])} (v{best[0]:g})" if best else "-"),
        ("mean staleness (versions)",
         _fmt(sum(k * n for k, n in trained.items()) / groups, 2) if groups else "-"),
        ("learner busy fraction", _fmt(last.get("hub/learner_busy_frac"), 2)),
        ("dropped stale (on arrival / in queue)",
         f"{last.get('rollout/stale_on_arrival_total', '-')} / "
         f"{last.get('rollout/stale_in_queue_total', '-')}"),
        ("versions propagated, median t90", f"{len(data.propagation)}, "
         + (f"{statistics.median(t90):.2f} s" if t90 else "-")),
        ("$ total", _fmt(last.get("cost/usd_total"), 4)),
        ("$ per 1k rollouts", _fmt(last.get("cost/usd_per_1k_rollouts"), 4)),
    ]
    return rows


def trained_lags(steps: list[dict[str, Any]]) -> dict[int, int]:
    """Groups trained on, by lag in versions, over the whole run."""
    total: dict[int, int] = {}
    for record in steps:
        hist = record.get("rollout/staleness_hist")
        for lag, n in (hist.items() if isinstance(hist, dict) else ()):
            if str(lag).isdigit() and isinstance(n, int):
                total[int(lag)] = total.get(int(lag), 0) + n
    return dict(sorted(total.items()))


def _fmt(value: Any, places: int = 3) -> str:
    return f"{value:.{places}f}" if finite(value) else "-"


CONFIG_SHOWN = ("model", "task", "dataset", "env", "max_lag", "kappa", "prompts_per_step",
                "group_size", "lr", "max_steps")
CAPTIONS = {
    "reward": "Train reward (mean over each step's groups; line: moving average) and held-out "
              "accuracy, by learner step.",
    "staleness": "Lag in versions of the groups trained on, over the run; groups dropped as "
                 "too stale, running totals.",
    "utilization": "Learner busy fraction, measured and as the capacity model predicts it from "
                   "the active peers' rates; rollouts/s admitted against what the model requires.",
    "propagation": "Seconds from publication until 50/90/100 % of the peers held each version "
                   "(T_bcast: 90 % serving it); the spread of the last versions.",
    "cost": "What the peers cost: $ total and $/h over the run's wall time.",
}


def page(data: RunData, figures: dict[str, bytes]) -> str:
    """report.html: everything inline, every text from the run escaped."""
    e = html.escape
    config = ", ".join(f"{k} {e(str(data.config[k]))}" for k in CONFIG_SHOWN
                       if data.config.get(k) not in (None, ""))
    rows = "\n".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary(data))
    skipped = (f"<p class=note>{data.skipped} malformed line(s) of metrics.jsonl skipped (the "
               f"first: line {data.first_skipped}).</p>" if data.skipped else "")
    shown = "\n".join(
        f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}"><figcaption>{e(CAPTIONS[name])}</figcaption></figure>'
        for name, png in figures.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>echo2p2p run {e(data.run_id)}</title>
<style>
body {{ font: 15px/1.4 system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ padding: .25em .9em; border-bottom: 1px solid #ddd; text-align: left; }}
td {{ font-variant-numeric: tabular-nums; }}
img {{ max-width: 100%; }}
figure {{ margin: 2em 0; }} figcaption, .note {{ color: #555; }}
</style></head><body>
<h1>echo2p2p run {e(data.run_id)}</h1>
<p>{config}</p>
<table>
{rows}
</table>
{skipped}
{shown}
</body></html>
"""


def write_report(run_dir: Path, out: Path) -> tuple[RunData, list[Path]]:
    """Draw the figures of `run_dir` and write them and report.html into `out`."""
    from .report_figures import draw_all

    data = read_run(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = draw_all(data)
    written = []
    for name, png in figures.items():
        (out / f"{name}.png").write_bytes(png)
        written.append(out / f"{name}.png")
    (out / "report.html").write_text(page(data, figures), encoding="utf-8")
    return data, [*written, out / "report.html"]


def main(args: argparse.Namespace) -> int:
    """`echo2-hub report` with its parsed arguments."""
    try:
        import matplotlib  # noqa: F401  (an optional extra: say how to get it)
    except ImportError:
        print("echo2-hub report: drawing needs matplotlib: pip install 'echo2p2p[report]'",
              file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "report"
    try:
        data, written = write_report(args.run_dir, out)
    except (OSError, ValueError) as exc:
        print(f"echo2-hub report: {exc}", file=sys.stderr)
        return 1
    if data.skipped:
        print(f"echo2-hub report: skipped {data.skipped} malformed line(s) of "
              f"{args.run_dir / 'metrics.jsonl'} (the first: line {data.first_skipped})",
              file=sys.stderr)
    for path in written:
        print(path)
    return 0
