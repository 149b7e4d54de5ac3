"""The dashboard's feed: the run's history, kept small, and the live stream to its clients.

`Feed.record` is a run log listener (`echo2p2p.hub.view.runlog.RunLog.listeners`): a step record
becomes a point of a columnar `History` (one array('d') per series: at most KEEP bucketed
means over equal step ranges whatever the run's length, the first and last points as they
were), an evaluation one of another, a propagation record one of the last VERSIONS kept; and
each goes out, serialised once, as a server-sent event to every `Subscriber`. A subscriber's
queue is bounded in bytes: one that falls behind is dropped (its `on_drop` cuts its
connection), so whoever feeds the feed never waits on a client. Knows nothing of HTTP or of
the hub; the numbers it sends are finite or null (JSON has no NaN).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KEEP = 4000  # buckets a history keeps (even: halving pairs them all)
POINTS = 2000  # points a snapshot's history has at most
VERSIONS = 200  # propagation records kept
QUEUE_BYTES = 4 << 20  # serialised events a client may have waiting before it is dropped

# A step point's series and the run log keys they come from.
STEP_SERIES = {"step": "step", "time_s": "time_s", "reward": "train/reward_mean",
               "busy": "hub/learner_busy_frac", "rollouts_per_s": "rollout/per_s",
               "staleness_mean": "rollout/staleness_mean", "usd_total": "cost/usd_total",
               "usd_per_hour": "cost/usd_per_hour", "mismatch_kl": "mismatch_kl",
               "ratio_mean": "ratio_mean", "clip_frac": "clip_frac"}
VERSION_KEYS = ("version", "peers", "t50_s", "t90_s", "t100_s", "t_bcast_s", "predicted_bcast_s",
                "cdf_s", "bytes_from_hub", "bytes_from_peers", "full_wire_bytes",
                "delta_wire_bytes", "peers_on_delta", "complete")


class History:
    """Points of named series, as bucket sums and counts: a bucket holds `width` points, and
    when KEEP buckets are full, pairs merge and the width doubles (amortised O(1) a point)."""

    def __init__(self, names: Sequence[str], whole: Sequence[str] = (), keep: int = KEEP):
        """`whole`: the series shown as integers (the x axes: steps, versions)."""
        self.names, self._whole, self._keep = tuple(names), set(whole), keep
        self._sums = [array("d") for _ in self.names]
        self._counts = array("d")
        self.width = 1  # points per full bucket
        self.points = 0
        self.first: tuple[float, ...] | None = None
        self.last: tuple[float, ...] | None = None

    @property
    def buckets(self) -> int:
        return len(self._counts)

    def add(self, values: Sequence[float]) -> None:
        """One point, a value per series (NaN: not measured)."""
        point = tuple(values)
        if self.first is None:
            self.first = point
        self.last = point
        self.points += 1
        if not self._counts or self._counts[-1] >= self.width:
            if len(self._counts) >= self._keep:
                self._halve()
            self._counts.append(0.0)
            for sums in self._sums:
                sums.append(0.0)
        self._counts[-1] += 1
        for sums, value in zip(self._sums, point):
            sums[-1] += value

    def _halve(self) -> None:
        """Merge neighbouring buckets: every bucket is full here, so all stay equal."""
        for column in (self._counts, *self._sums):
            column[:] = array("d", (column[i] + column[i + 1] for i in range(0, len(column), 2)))
        self.width *= 2

    def columns(self, limit: int = POINTS) -> dict[str, list]:
        """The series as lists of at most `limit` points: every point while they fit, else the
        first point, means of equal runs of buckets, and the last point. The x axes are
        integers in the first case; means of their ranges (one decimal) in the second, still
        strictly increasing."""
        if self.first is None:
            return {name: [] for name in self.names}
        if self.width == 1 and self.points <= limit:
            rows = [tuple(s[i] for s in self._sums) for i in range(self.points)]
            return {name: [_shown(row[i], 0 if name in self._whole else None) for row in rows]
                    for i, name in enumerate(self.names)}
        group = math.ceil(len(self._counts) / (limit - 2))
        rows = [self.first]
        for start in range(0, len(self._counts), group):
            n = sum(self._counts[start:start + group])
            if n > 1:  # else a last run of the last point alone: that point follows
                rows.append(tuple(sum(s[start:start + group]) / n for s in self._sums))
        rows.append(self.last)
        return {name: [_shown(row[i], 1 if name in self._whole else None) for row in rows]
                for i, name in enumerate(self.names)}


class Subscriber:
    """One client's serialised events, waiting to be written; bounded in bytes."""

    def __init__(self, limit_bytes: int, on_drop: Callable[[], None]):
        """`on_drop`: cuts the client's connection (its writer may be blocked on it)."""
        self._limit, self._on_drop = limit_bytes, on_drop
        self._frames: list[bytes] = []
        self._bytes = 0
        self._wake = asyncio.Event()
        self.closed = False

    def offer(self, frame: bytes) -> bool:
        """Queue `frame`; False (and the client dropped) when that is over its bound."""
        if self.closed:
            return False
        if self._bytes + len(frame) > self._limit:
            self.drop()
            return False
        self._frames.append(frame)
        self._bytes += len(frame)
        self._wake.set()
        return True

    def drop(self) -> None:
        """No more events: wake the writer and cut the connection."""
        self.closed = True
        self._frames.clear()
        self._wake.set()
        self._on_drop()

    async def wait_frames(self, timeout_s: float) -> bytes:
        """The queued events as one write, once there are some (b"" after `timeout_s`
        without any, or once dropped)."""
        if not self._frames and not self.closed:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._wake.wait()
        frames, self._frames, self._bytes = self._frames, [], 0
        return b"".join(frames)


@dataclass(frozen=True)
class FeedStatistics:
    clients: int  # subscribers now
    dropped_clients: int  # dropped for falling behind, over the feed's life
    step_points: int  # step records seen
    step_buckets: int  # what the step history keeps


class Feed:
    """The history the dashboard's snapshot shows, and the live events its clients get."""

    def __init__(self, queue_bytes: int = QUEUE_BYTES):
        self.steps = History(list(STEP_SERIES), whole=("step",))
        self.evals = History(("version", "accuracy"), whole=("version",))
        self.versions: deque[dict[str, Any]] = deque(maxlen=VERSIONS)
        self._queue_bytes = queue_bytes
        self._subscribers: set[Subscriber] = set()
        self._dropped = 0
        self._closed = False

    def record(self, record: dict[str, Any]) -> None:
        """A run log record: a step, an evaluation or a propagation record (others pass)."""
        kind = record.get("event")
        if kind is None and "step" in record:
            self._step(record)
        elif kind == "eval":
            self._eval(record["version"], record.get("eval/accuracy"))
        elif kind == "propagation":
            version = {key: record.get(key) for key in VERSION_KEYS}
            self.versions.append(version)
            self.publish("version", version)

    def _step(self, record: dict[str, Any]) -> None:
        point = {name: _number(record.get(key)) for name, key in STEP_SERIES.items()}
        self.steps.add([math.nan if v is None else v for v in point.values()])
        accuracy = _number(record.get("eval/accuracy"))
        lags = record.get("rollout/staleness_hist") or {}
        self.publish("step", {**point, "eval": accuracy, "staleness": dict(lags)})
        if accuracy is not None:
            self._eval(record["version"], accuracy)

    def _eval(self, version: int, accuracy: float | None) -> None:
        accuracy = _number(accuracy)
        self.evals.add([version, math.nan if accuracy is None else accuracy])
        self.publish("eval", {"version": version, "accuracy": accuracy})

    def snapshot(self) -> dict[str, Any]:
        """The history, downsampled to at most POINTS points a series."""
        return {"steps": self.steps.columns(), "evals": self.evals.columns(),
                "versions": list(self.versions)}

    # --- the live stream -------------------------------------------------------------

    def subscribe(self, on_drop: Callable[[], None]) -> Subscriber:
        """A new client's queue (dropped at once if the feed is closed)."""
        subscriber = Subscriber(self._queue_bytes, on_drop)
        if self._closed:
            subscriber.drop()
        else:
            self._subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)

    @property
    def clients(self) -> int:
        return len(self._subscribers)

    def publish(self, kind: str, data: Any) -> None:
        """Send `data` as a `kind` event to every client: serialised once, never waited on."""
        if not self._subscribers:
            return
        frame = event_frame(kind, data)
        for subscriber in list(self._subscribers):
            if not subscriber.offer(frame):
                self._subscribers.discard(subscriber)
                self._dropped += 1

    def close(self) -> None:
        """End every client's stream, and any later one's (the server is stopping)."""
        self._closed = True
        for subscriber in self._subscribers:
            subscriber.drop()
        self._subscribers.clear()

    def statistics(self) -> FeedStatistics:
        return FeedStatistics(len(self._subscribers), self._dropped, self.steps.points,
                              self.steps.buckets)


# `Any` below is a JSON value (a status or step record), open by nature.
def event_frame(kind: str, data: Any) -> bytes:
    """One server-sent event: `event: kind`, one `data:` line of JSON (one line: json.dumps
    escapes every newline inside strings)."""
    return f"event: {kind}\ndata: {finite_json(data)}\n\n".encode()


def finite_json(data: Any) -> str:
    """`data` as compact JSON, with NaN and infinities as null (the page's JSON.parse would
    refuse them)."""
    try:
        return json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(data), separators=(",", ":"))


def _finite(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def _number(value: Any) -> float | None:
    """A finite number of a record, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def _shown(value: float, digits: int | None) -> float | int | None:
    """A value as JSON takes it: None for NaN, rounded to `digits` (0: an int) if given."""
    if not math.isfinite(value):
        return None
    if digits is None:
        return value
    return round(value) if digits == 0 else round(value, digits)
