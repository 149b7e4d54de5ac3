"""Rates over a sliding window of timed amounts: the one definition of every rate the hub shows.

Two different quantities, named apart so that no one compares them:

  admitted/s        completions the hub admitted over the last RATE_WINDOW_S seconds of its own
                    admission events, divided by the seconds covered (the window, or less since
                    the first event it counts from: a peer's join, the run's first join). What
                    the learner is fed; per peer and overall. `rollout/per_s`, "admitted/s".
  gen/s while busy  a peer's completions over the seconds it spent making them (from a lease's
                    grant or its previous submission, whichever is later, to the submission),
                    both summed over the window: what the peer can do when it has work, the
                    capacity model's mu_i. `capacity/gen_rollouts_per_s` sums it over the active
                    peers. It exceeds admitted/s whenever peers wait for leases.

A ratio of sums, never a mean of per-event ratios: submissions arrive at the hub in bursts (its
loop was busy), so one lease's "time" can be a millisecond, and an average of samples/busy_s is
dominated by such bursts (it read 10-50x the true rate). The learner's busy fraction is the same
window sum: one minus the seconds it waited for a batch in the window over the seconds covered.

No clock: callers pass `now` (any monotonic seconds, the same clock for one WindowSum).
Every view writes a rate with `rate_text`: at least two significant figures, so a real model's
peer at 0.4 rollouts/s shows 0.4, not 0 (the tiny model's hundreds a second keep their one
decimal, or none).
"""

from __future__ import annotations

from collections import deque

RATE_WINDOW_S = 60.0
"""Seconds every windowed rate of the hub covers (dashboard, status, /metrics, run log)."""


def rate_text(per_s: float) -> str:
    """A rate as the dashboard, `echo2-hub status`, the live line and the report show it: one
    decimal from 1/s (12.3), none from 100/s (925), two significant figures below 1/s (0.4,
    0.043). The page's dashboard.js (`rate`) follows the same rule."""
    size = abs(per_s)
    if size >= 100:
        return f"{per_s:.0f}"
    if size >= 1:
        return f"{per_s:.1f}"
    return f"{per_s:.2g}"


class WindowSum:
    """Amounts added at times, summed over the last `window_s` seconds."""

    def __init__(self, since: float, window_s: float = RATE_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.since, self.window_s = since, window_s
        self._events: deque[tuple[float, float]] = deque()  # (time, amount), oldest first
        self._total = 0.0

    def add(self, now: float, amount: float) -> None:
        self._events.append((now, amount))
        self._total += amount
        self._expire(now)

    def total(self, now: float) -> float:
        """The sum of the amounts added in (now - window_s, now]."""
        self._expire(now)
        return max(self._total, 0.0) if self._events else 0.0

    def covered_s(self, now: float) -> float:
        """Seconds the window spans at `now`: window_s, or less since `since`."""
        return min(self.window_s, max(now - self.since, 0.0))

    def per_s(self, now: float) -> float:
        """The window's sum per second covered (0.0 before any time has passed)."""
        covered = self.covered_s(now)
        return self.total(now) / covered if covered > 0 else 0.0

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._total -= self._events.popleft()[1]


class BusyRate:
    """A peer's generation rate while busy: completions / seconds spent on them, over the window.
    Keeps the last rate when the window empties (a peer on standby still has its measure)."""

    def __init__(self, since: float, window_s: float = RATE_WINDOW_S) -> None:
        self.samples, self.busy_s = WindowSum(since, window_s), WindowSum(since, window_s)
        self.last = 0.0  # 0.0: never measured (on trial)

    def add(self, now: float, samples: int, busy_s: float) -> float:
        """One submission's completions and the seconds spent on them; returns the new rate."""
        self.samples.add(now, samples)
        self.busy_s.add(now, busy_s)
        busy = self.busy_s.total(now)
        if busy > 0:
            self.last = self.samples.total(now) / busy
        return self.last
