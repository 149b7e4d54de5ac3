"""`echo2-hub report RUN_DIR`: the figures of a run, as PNGs and one self-contained HTML page.

Reads the run log (RUN_DIR/metrics.jsonl: step records and events, see `echo2p2p.hub.view.runlog`)
and RUN_DIR/config.json (`echo2p2p.hub.view.run_data`), draws reward.png, staleness.png,
utilization.png, propagation.png and cost.png (`echo2p2p.hub.view.report_figures`, matplotlib) and
writes report.html: a summary table and the PNGs inline as base64 data URIs, so the one file can
be mailed or attached. Only reads the run dir and writes the output dir; knows nothing of a
live hub.
"""

from __future__ import annotations

import argparse
import base64
import html
import statistics
import sys
from pathlib import Path
from typing import Any

from echo2p2p.rates import rate_text

from .run_data import RunData, finite, read_run, trained_lags, values

EDGE_STEPS = 5  # "reward first/last" are means over this many steps at each end


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
        ("learner busy fraction (last 60 s; capacity model)",
         f"{_fmt(last.get('hub/learner_busy_frac'), 2)}; "
         f"{_fmt(last.get('capacity/predicted_busy_frac'), 2)}"),
        ("admitted/s (last 60 s)", _rate(last.get("rollout/per_s"))),
        ("gen/s while busy, active peers (capacity model's input)",
         _rate(last.get("capacity/gen_rollouts_per_s"))),
        ("required rollouts/s (capacity model)",
         _rate(last.get("capacity/required_rollouts_per_s")) if finite(
             last.get("capacity/required_rollouts_per_s")) else
         f"none: {last.get('capacity/required_why') or 'not recorded'}"),
        ("dropped stale (on arrival / in queue)",
         f"{last.get('rollout/stale_on_arrival_total', '-')} / "
         f"{last.get('rollout/stale_in_queue_total', '-')}"),
        ("versions propagated, median t90", f"{len(data.propagation)}, "
         + (f"{statistics.median(t90):.2f} s" if t90 else "-")),
        ("$ total", _fmt(last.get("cost/usd_total"), 4)),
        ("$ per 1k rollouts", _fmt(last.get("cost/usd_per_1k_rollouts"), 4)),
    ]
    return rows


# `value`: a JSON value from the run log.
def _fmt(value: Any, places: int = 3) -> str:
    return f"{value:.{places}f}" if finite(value) else "-"


def _rate(value: Any) -> str:
    return rate_text(value) if finite(value) else "-"


CONFIG_SHOWN = ("model", "task", "dataset", "env", "max_lag", "kappa", "prompts_per_step",
                "group_size", "lr", "max_steps")
CAPTIONS = {
    "reward": "Train reward (mean over each step's groups; line: moving average) and held-out "
              "accuracy, by learner step.",
    "staleness": "Lag in versions of the groups trained on, over the run; groups dropped as "
                 "too stale, running totals.",
    "utilization": "Learner busy fraction over the last 60 s, measured and as the capacity model "
                   "predicts it from the active peers' generation rates while busy; rollouts/s "
                   "admitted over the last 60 s against what the model requires.",
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
        return 1
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
