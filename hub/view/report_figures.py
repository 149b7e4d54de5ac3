"""The figures of `echo2-hub report`: one PNG per question a run's reader asks.

Each function draws one matplotlib `Figure` (the object API, rendered by the Agg canvas: no
display, no pyplot state) from a `echo2p2p.hub.view.run_data.RunData` and returns its PNG bytes. A
series the run log lacks (no evaluations, no propagation records, records without "cdf_s") is
left out, and a panel with nothing to draw says so. Knows the run log's keys, nothing else.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Callable
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .run_data import RunData, finite, trained_lags

SIZE_IN, DPI = (10.0, 3.8), 110  # ~1100x420 px: readable in a page and in a paper's column
LAST_VERSIONS = 5  # versions whose spread the CDF panel draws


def draw_all(data: RunData) -> dict[str, bytes]:
    """name -> PNG bytes of every figure, in the report's order."""
    drawings: dict[str, Callable[[RunData], Figure]] = {
        "reward": reward, "staleness": staleness, "utilization": utilization,
        "propagation": propagation, "cost": cost}
    return {name: png(draw(data)) for name, draw in drawings.items()}


def png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def panels(n: int, title: str) -> tuple[Figure, list[Any]]:
    figure = Figure(figsize=SIZE_IN, layout="constrained")
    axes = figure.subplots(1, n, squeeze=False)[0]
    figure.suptitle(title, fontsize=12)
    for ax in axes:
        ax.grid(alpha=0.3)
    return figure, list(axes)


def series(steps: list[dict[str, Any]], key: str, xs: list[float] | None = None
           ) -> tuple[list[float], list[float]]:
    """(x, y) of the steps whose `key` is a finite number; x: `xs` per step, else the version
    the step produced (the count of learner steps done)."""
    xs = xs if xs is not None else [r.get("version", r["step"] + 1) for r in steps]
    pairs = [(x, r[key]) for x, r in zip(xs, steps) if finite(r.get(key))]
    return [x for x, _ in pairs], [y for _, y in pairs]


def nothing(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def moving_average(ys: list[float]) -> list[float]:
    """Exponential moving average over ~1/20 of the run (the reward is noisy step to step)."""
    weight, out, mean = 2 / (max(2, len(ys) // 20) + 1), [], None
    for y in ys:
        mean = y if mean is None else (1 - weight) * mean + weight * y
        out.append(mean)
    return out


def reward(data: RunData) -> Figure:
    figure, (ax,) = panels(1, "Reward")
    xs, ys = series(data.steps, "train/reward_mean")
    ax.plot(xs, ys, color="tab:blue", alpha=0.3, lw=1, label="train reward (per step)")
    ax.plot(xs, moving_average(ys), color="tab:blue", lw=2, label="train reward (moving average)")
    if data.evals:
        versions, accuracy = zip(*sorted(data.evals))
        ax.plot(versions, accuracy, "o-", color="tab:orange", lw=2, label="held-out accuracy")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward / accuracy")
    ax.legend(loc="best", fontsize=9)
    return figure


def staleness(data: RunData) -> Figure:
    figure, (lags, dropped) = panels(2, "Staleness")
    trained = trained_lags(data.steps)
    if trained:
        bars = lags.bar(list(trained), list(trained.values()), color="tab:blue")
        groups = sum(trained.values())
        lags.bar_label(bars, [f"{n} ({100 * n / groups:.0f} %)" for n in trained.values()],
                       fontsize=8)
        lags.set_xticks(list(trained))
        lags.margins(y=0.12)  # room for the labels
    else:
        nothing(lags, "no staleness histogram in the step records")
    max_lag = data.config.get("max_lag")
    lags.set_title("groups trained on, by lag" + (f" (S = {max_lag})" if finite(max_lag) else ""),
                   fontsize=10)
    lags.set_xlabel("lag (versions)")
    lags.set_ylabel("groups")
    for key, label in (("rollout/stale_on_arrival_total", "stale on arrival"),
                       ("rollout/stale_in_queue_total", "stale in the queue")):
        dropped.plot(*series(data.steps, key), lw=2, label=label)
    dropped.set_title("groups dropped as too stale (running total)", fontsize=10)
    dropped.set_xlabel("learner step")
    dropped.set_ylabel("groups")
    dropped.legend(loc="upper left", fontsize=9)
    if not any(any(line.get_ydata()) for line in dropped.lines):
        dropped.set_ylim(0, 1)  # not matplotlib's -0.05..0.05 around a flat zero
        nothing(dropped, "no group was dropped")
    else:
        dropped.set_ylim(bottom=0)
    return figure


def utilization(data: RunData) -> Figure:
    figure, (busy, rate) = panels(2, "Utilization")
    busy.plot(*series(data.steps, "hub/learner_busy_frac"), lw=2, label="measured")
    busy.plot(*series(data.steps, "capacity/predicted_busy_frac"), lw=2, ls="--",
              label="capacity model")
    busy.set_ylim(0, 1.05)
    busy.set_title("learner busy fraction", fontsize=10)
    busy.set_xlabel("learner step")
    busy.legend(loc="lower right", fontsize=9)
    rate.plot(*series(data.steps, "rollout/per_s"), lw=1.5, label="admitted (last 60 s)")
    required = series(data.steps, "capacity/required_rollouts_per_s")
    if required[0]:
        rate.plot(*required, lw=2, ls="--", label="required (capacity model)")
    if why := unrequired(data.steps):  # the model has no requirement at these steps: say why
        rate.text(0.02, 0.98, textwrap.fill(why, 60), transform=rate.transAxes, va="top",
                  fontsize=8, color="0.35")
    rate.set_title("rollouts/s", fontsize=10)
    rate.set_xlabel("learner step")
    rate.set_ylim(bottom=0)
    rate.legend(loc="lower right", fontsize=9)
    return figure


def unrequired(steps: list[dict[str, Any]]) -> str:
    """"no required rate in N of M steps: <the capacity model's reason, the last one given>",
    or "" when every step had one."""
    missing = [r for r in steps if not finite(r.get("capacity/required_rollouts_per_s"))]
    if not missing:
        return ""
    reasons = [r["capacity/required_why"] for r in missing
               if isinstance(r.get("capacity/required_why"), str)]
    why = textwrap.shorten(reasons[-1], 90) if reasons else "no reason recorded"
    return f"no required rate in {len(missing)} of {len(steps)} steps: {why}"


def propagation(data: RunData) -> Figure:
    figure, (times, spread) = panels(2, "Propagation")
    records = [data.propagation[v] for v in sorted(data.propagation)]
    if not records:
        nothing(times, "no propagation records (no peer held a version)")
        nothing(spread, "no propagation records")
        return figure
    versions = [float(r["version"]) for r in records]
    for key, label, style in (("t50_s", "50 % of peers", "-"), ("t90_s", "90 %", "-"),
                              ("t100_s", "100 %", "-"),
                              ("t_bcast_s", "T_bcast (90 % serving)", ":"),
                              ("predicted_bcast_s", "predicted T_bcast", "--")):
        xs, ys = series(records, key, versions)
        if ys:
            times.plot(xs, ys, ls=style, marker="." if len(xs) < 80 else None, label=label)
    times.set_title("seconds until the version reached", fontsize=10)
    times.set_xlabel("version")
    times.set_ylabel("s")
    times.set_ylim(bottom=0)
    times.legend(loc="best", fontsize=8)
    spread_of(spread, records[-LAST_VERSIONS:])
    return figure


def spread_of(ax: Axes, records: list[dict[str, Any]]) -> None:
    """The CDF of when each of the last versions reached its peers: from the records' "cdf_s"
    deciles where they carry them, else from t50/t90/t100 alone."""
    deciles = all(isinstance(r.get("cdf_s"), list) for r in records)
    for r in records:
        if deciles:
            points = [(t, 10 * i) for i, t in enumerate(r["cdf_s"][:11]) if finite(t)]
        else:
            points = [(r[f"t{p}_s"], p) for p in (50, 90, 100) if finite(r.get(f"t{p}_s"))]
        if points:
            ax.plot(*zip(*points), marker=None if deciles else "o", ms=4, lw=1.5,
                    drawstyle="steps-post" if deciles else "default",
                    label=f"v{r['version']} ({r.get('peers', '?')} peers)")
    ax.set_title("share of peers holding the version" + ("" if deciles else
                 " (from t50/t90/t100)"), fontsize=10)
    ax.set_xlabel("seconds since publication")
    ax.set_ylabel("% of peers")
    ax.set_ylim(0, 105)
    ax.set_xlim(left=0)
    if ax.lines:
        ax.legend(loc="upper left", fontsize=8)


def cost(data: RunData) -> Figure:
    figure, (total, rate) = panels(2, "Cost")
    unit, seconds = next((u, s) for u, s in (("s", 1), ("min", 60), ("h", 3600))
                         if data.elapsed_s[-1] < 120 * s or u == "h")
    wall = [t / seconds for t in data.elapsed_s]
    total.plot(*series(data.steps, "cost/usd_total", wall), lw=2, color="tab:green")
    total.set_title("$ total", fontsize=10)
    rate.plot(*series(data.steps, "cost/usd_per_hour", wall), lw=2, color="tab:red")
    rate.set_title("$/h (the active peers' prices)", fontsize=10)
    for ax in (total, rate):
        ax.set_xlabel(f"wall time ({unit})")
        ax.set_ylim(bottom=0)
    if not any(r.get("cost/usd_per_hour") for r in data.steps):
        for ax in (total, rate):
            nothing(ax, "every peer was free (price 0)")
    return figure
