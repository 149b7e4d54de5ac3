"""How fast one connection may make the hub work: a token bucket over the frames it sends.

Every frame the hub reads costs its bytes, plus `FRAME_COST_BYTES` for handling it at all, plus
`VALUE_COST_BYTES` for each value decoding it built (a frame of many tiny values costs far more
CPU than its size says). The bucket refills at `rate_bps` up to `burst_bytes`; a frame is always
read, and may take the bucket below zero, and then `pause_s(now)` says how long the shell should
stop reading that one socket until the debt is paid. TCP backpressure does the rest: the peer's
sends block, the hub's loop and every other peer go on.

Sized so that an honest peer never waits: a 256-token rollout of G = 8 is ~24 KiB here and a
fast peer sends a few a second; 8 MiB/s is hundreds of them. A hostile peer gets at most
~2,000 frames a second, or ~8 MiB/s of decoding, or ~8 frames a second of the decoder's worst
case (16k values each, ~3 ms to build): a few percent of the loop.

No clock: `now` is an argument, in seconds on any monotonic scale.
"""

from __future__ import annotations

from dataclasses import dataclass

FRAME_COST_BYTES = 4096
VALUE_COST_BYTES = 64
RATE_BPS = 8 << 20  # bytes (of cost) a second; the unit is bytes, not bits
BURST_BYTES = 8 << 20


@dataclass(frozen=True)
class BudgetStatistics:
    charged_bytes: int  # all cost charged so far
    paused_s: float  # all pauses asked for so far
    pauses: int  # how many times a pause was asked for


class ReadBudget:
    """The read budget of one connection."""

    def __init__(self, now: float, rate_bps: float = RATE_BPS, burst_bytes: float = BURST_BYTES):
        if not (rate_bps > 0 and burst_bytes > 0):
            raise ValueError(f"rate_bps and burst_bytes must be > 0, got {rate_bps}, {burst_bytes}")
        self.rate_bps = rate_bps
        self.burst_bytes = burst_bytes
        self._tokens = float(burst_bytes)
        self._at = now
        self._charged = 0
        self._paused_s = 0.0
        self._pauses = 0

    def charge(self, nbytes: int, values: int, now: float) -> None:
        """One frame of `nbytes` that built `values` values was read at `now`."""
        self._refill(now)
        cost = nbytes + FRAME_COST_BYTES + VALUE_COST_BYTES * values
        self._tokens -= cost
        self._charged += cost

    def pause_s(self, now: float) -> float:
        """Seconds to stop reading before the next frame (0: read on)."""
        self._refill(now)
        if self._tokens >= 0:
            return 0.0
        wait = -self._tokens / self.rate_bps
        self._paused_s += wait
        self._pauses += 1
        return wait

    def _refill(self, now: float) -> None:
        elapsed = max(now - self._at, 0.0)  # a clock that steps back refills nothing
        self._tokens = min(self.burst_bytes, self._tokens + elapsed * self.rate_bps)
        self._at = max(now, self._at)

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(self._charged, self._paused_s, self._pauses)
