"""Experiment trackers (`--report-to wandb,tensorboard`): the run log's records as their charts.

Each tracker is a run log listener (`echo2p2p.hub.view.runlog.RunLog.listeners`) and charts what
`points` takes from a record, under the run log's own names: a learner step's numbers at its
step (`train/reward_mean`, `hub/learner_busy_frac`, `rollout/per_s`, ...), its staleness
histogram as one curve per lag (`rollout/staleness_hist/1`: groups trained at lag 1; at most
S + 1 curves) and so its off-policy diagnostics (`by_lag/1/ratio_mean`), an evaluation's
`eval/accuracy` at its version (the base policy at 0), and a version's propagation
(`propagation/t90_s`, `propagation/serving/t90_s`, `propagation/bytes_from_hub`, ...) against
the version. Lists (a step's leases) and per-peer
tables (cost events, peers' upload rates: unbounded, and named by peers) are not charted.

A tracker never holds the learner loop up for long: `wandb.log` hands the row to wandb's own
process, and TensorBoard's writer queues events for a writer thread. A tracker that fails on a
record is logged by the run log and the run goes on. Knows nothing of training: only records.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from echo2p2p.errors import ConfigError

from ..config import SECRETS
from ..config_sections import ViewConfig, names

log = logging.getLogger(__name__)

STEP, VERSION = "step", "propagation/version"  # the two x axes
WANDB_PROJECT = "echo2p2p"  # unless WANDB_PROJECT names another
# Of a propagation record: per-peer maps stay in the run log (256 peers would be 256 series).
NOT_CHARTED = ("event", "version", "peer_upload_mbps", "done_by_peer_s", "chunks_dealt")


def points(record: dict[str, Any]) -> tuple[str, int, dict[str, float]] | None:
    """(x axis, x, {name: number}) of what the trackers chart from a run log record, or None
    for a record they leave to the run log (cost, activation, quarantine, resume, ...)."""
    kind = record.get("event")
    if kind is None:  # a learner step
        return STEP, record["step"], {k: v for k, v in numbers(record) if k != "step"}
    if kind == "eval":
        return STEP, record["version"], {"eval/accuracy": record["eval/accuracy"]}
    if kind == "propagation":
        kept = {k: v for k, v in record.items() if k not in NOT_CHARTED}
        return VERSION, record["version"], dict(numbers(kept, "propagation/"))
    return None


def numbers(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numbers of `record` by name, nested dicts flattened (`a/b`); None, flags, strings
    and lists left out."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from numbers(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


class TensorBoard:
    """Event files in <run_dir>/tensorboard: one scalar per name, at its x."""

    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("report_to", "tensorboard needs the tensorboard package: pip "
                                           "install 'echo2p2p[tensorboard]'") from None
        # Events queue for the writer's thread and are on disk within flush_secs; a full
        # queue is written out in the caller's thread, so it is long (10, the default, costs
        # a step record of ~50 numbers 3x the time).
        self._writer = SummaryWriter(str(run_dir / "tensorboard"), max_queue=1000, flush_secs=10)
        self._writer.add_text("config", f"```\n{json.dumps(config, indent=2)}\n```")

    def __call__(self, record: dict[str, Any]) -> None:
        if (found := points(record)) is not None:
            _, x, values = found
            for name, value in values.items():
                self._writer.add_scalar(name, value, x)

    def close(self) -> None:
        self._writer.close()


class Wandb:
    """A wandb run named and identified by the run id (`serve --resume` continues it), in
    <run_dir>/wandb; WANDB_MODE=offline keeps it on this machine (`wandb sync` uploads it)."""

    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError("report_to", "wandb needs the wandb package: pip install "
                                           "'echo2p2p[wandb]'") from None
        try:
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
                                   name=run_id, id=run_id, resume="allow", config=config,
                                   dir=str(run_dir))
        except wandb.errors.Error as exc:  # no API key, a refused login: the user's to fix
            wandb.teardown()
            raise ConfigError("report_to", f"wandb could not start the run ({exc}): `wandb "
                                           f"login`, or WANDB_MODE=offline to keep it on this "
                                           f"machine") from None
        self._charted: set[str] = set()

    def __call__(self, record: dict[str, Any]) -> None:
        if (found := points(record)) is None:
            return
        axis, x, values = found
        # Each name is charted against its own axis (wandb's own step only counts rows): a
        # version's propagation is reported steps after the version, and a resumed run
        # repeats the steps since its checkpoint.
        for name in values.keys() - self._charted:
            self._run.define_metric(name, step_metric=axis)
            self._charted.add(name)
        self._run.log({axis: x, **values})

    def close(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()  # stops its process: a later run here reads WANDB_* afresh


OPENERS: dict[str, Callable[[Path, str, dict[str, Any]], Any]] = {
    "tensorboard": TensorBoard, "wandb": Wandb}


class Trackers:
    """The run's trackers: each one of the run log's listeners; `close` when the run ends."""

    def __init__(self, opened: list[tuple[str, Any]]):
        self._opened = opened
        self.listeners: list[Callable[[dict[str, Any]], None]] = [t for _, t in opened]

    def close(self) -> None:
        """Close each (wandb finishes its run); one that fails is logged, the others close."""
        for name, tracker in self._opened:
            try:
                tracker.close()
            except Exception:
                log.exception("closing the %s tracker failed", name)


def open_trackers(view: ViewConfig, run_dir: Path, run_id: str, config: dict[str, Any]
                  ) -> Trackers:
    """The trackers view.report_to names, started with the run's `config` (blocking: wandb
    starts its process; call it in a thread). ConfigError on report_to if one's package is
    missing, with the ones already started closed."""
    shared = {k: v for k, v in config.items() if k not in SECRETS}
    opened: list[tuple[str, Any]] = []
    try:
        for name in names(view.report_to):
            opened.append((name, OPENERS[name](run_dir, run_id, shared)))
    except BaseException:
        Trackers(opened).close()
        raise
    if opened:
        log.info("reporting to %s", ", ".join(name for name, _ in opened))
    return Trackers(opened)
