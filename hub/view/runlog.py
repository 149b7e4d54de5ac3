"""The run log: one JSON line per learner step in <run_dir>/metrics.jsonl, plus a live line.

Knows nothing about training; it formats and writes what the hub hands it, and hands every
record on to its `listeners` (the dashboard's feed, experiment trackers). Keys follow
`area/name` (train/..., rollout/..., hub/..., eval/...).
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from echo2p2p.rates import rate_text

log = logging.getLogger(__name__)

LEGEND = ("(lag a/b/c: the step's groups by staleness, made 0/1/2... versions behind the "
          "learner; admitted/s: completions admitted per second, and busy: the learner's share "
          "of time not waiting for rollouts, both over the last 60 s)")


class RunLog:
    """Appends step records and prints the live line."""

    def __init__(self, run_dir: Path, config: dict[str, Any], stream: TextIO | None = sys.stdout):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        self._file = (run_dir / "metrics.jsonl").open("a", buffering=1)
        self._stream = stream
        self.staleness = Counter()  # lag in versions -> groups trained on, over the whole run
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # each gets every record
        self._legend_shown = False  # printed once, before the first live line

    def step(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._hand_on(record)
        if self._stream is not None:
            if not self._legend_shown:
                print(LEGEND, file=self._stream)
                self._legend_shown = True
            print(live_line(record), file=self._stream, flush=True)

    def event(self, record: dict[str, Any], text: str | None = None) -> None:
        """A record that is not a learner step (a base evaluation, a version's propagation);
        `text` is printed too unless None."""
        self._file.write(json.dumps(record) + "\n")
        self._hand_on(record)
        if self._stream is not None and text is not None:
            print(text, file=self._stream, flush=True)

    def close(self) -> None:
        self._file.close()

    def _hand_on(self, record: dict[str, Any]) -> None:
        """Each listener's failure is its own: logged, and the run goes on."""
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("run log listener %r failed on a record", listener)


def live_line(r: dict[str, Any]) -> str:
    """`step   12 v  12 reward 0.41 eval 0.38 lag 0/1/0 admitted/s 96.2 busy 0.71` (LEGEND)."""
    acc = r.get("eval/accuracy")
    hist = r.get("rollout/staleness_hist", {})
    lag = "/".join(str(hist.get(str(k), 0)) for k in range(max((int(k) for k in hist), default=0) + 1))
    return (f"step {r['step']:5d}  v{r['version']:<5d} reward {r['train/reward_mean']:.3f}  "
            f"eval {'  -  ' if acc is None else f'{acc:.3f}'}  lag {lag or '-':<8s} "
            f"admitted/s {rate_text(r['rollout/per_s']):>7s}  busy {r['hub/learner_busy_frac']:.2f}  "
            f"peers {r['hub/peers']}" + (f"  ${usd:.2f}" if (usd := r.get("cost/usd_total")) else "")
            + (f"  filtered {n}" if (n := r.get("rollout/filtered_groups")) else ""))


def propagation_line(r: dict[str, Any]) -> str:
    """`v20 reached 4 peers: 50% 0.21 s, 90% 0.30 s, 100% 0.31 s; the hub uploaded 1.02 ...`."""
    times = ", ".join(f"{p}% {'-' if r[f't{p}_s'] is None else format(r[f't{p}_s'], '.2f') + ' s'}"
                      for p in (50, 90, 100))
    bcast = "-" if r.get("t_bcast_s") is None else f"{r['t_bcast_s']:.2f} s"
    return (f"v{r['version']} reached {r['peers']} peers: {times} (90% serving it: {bcast}); "
            f"the hub uploaded {r['hub_upload_copies']} full copies' worth, "
            f"{r['peers_on_delta']} peers took a delta")
