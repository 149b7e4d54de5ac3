"""Relay pace: whether a relay delivers chunks at about the rate its share was dealt for. Pure.

A relay that serves every chunk just inside the download deadline never stalls, so no deadline
catches it, yet every peer that pulls from it waits on it. Each receiver is told the rate it may
expect from each source (`share_rate_bps`: the relay's measured upload, shared among the members
that pull from it), and two judges apply `too_slow` to it:

- the receiver times each chunk from a relay; one far slower than expected is kept (it verified)
  but the rest of that relay's chunks come from the hub, and the relay is reported "slow";
- the hub, told so, fetches that chunk from the relay itself, timed, and routes around the relay
  only on its own measurement: a liar's report costs an honest relay nothing.

No clock (times come in as arguments), no I/O.
"""

from __future__ import annotations

import math

SLACK = 4.0  # a chunk may take this many times its expected transfer time (rates are estimates)
GRACE_S = 1.0  # and this much more: scheduling, a fresh connection's slow start
DEFAULT_WINDOW = 2  # requests a receiver keeps in flight per source (unless RelayPlan.window)


def share_rate_bps(upload_bps: float, pullers: int) -> float:
    """The rate, bits/s, that each of `pullers` receivers may expect from a relay of measured
    upload `upload_bps` while they all pull from it; 0.0 when the upload is not measured (or is
    not a positive finite number)."""
    if not (0 < upload_bps < math.inf):
        return 0.0
    return upload_bps / max(pullers, 1)


def per_request_bps(rate_bps: float, window: int) -> float:
    """The rate each of `window` requests a receiver keeps in flight to one source may expect:
    they share what the receiver may expect of it (a striped chain's 32 requests to one parent
    wait their turn for its upload slots)."""
    return rate_bps / max(window, 1)


def slow_after_s(nbytes: int, rate_bps: float, wait_s: float = 0.0) -> float:
    """Seconds from request to last byte past which a chunk of `nbytes` came far slower than
    `rate_bps` allows: `wait_s` (a long poll the relay may spend waiting for its own copy) +
    GRACE_S + SLACK times its transfer time; infinite without a usable rate."""
    if not (0 < rate_bps < math.inf):
        return math.inf
    return wait_s + GRACE_S + SLACK * 8 * nbytes / rate_bps


def too_slow(nbytes: int, elapsed_s: float, rate_bps: float, wait_s: float = 0.0) -> bool:
    """Whether a chunk of `nbytes` that took `elapsed_s` from request to its last byte came far
    slower than `rate_bps` allows (`slow_after_s`). False without a usable rate."""
    return elapsed_s > slow_after_s(nbytes, rate_bps, wait_s)


def measured_bps(nbytes: int, elapsed_s: float) -> float | None:
    """The rate, bits/s, of `nbytes` delivered in `elapsed_s` (None: nothing to say)."""
    if nbytes <= 0 or not (0 < elapsed_s < math.inf):
        return None
    return 8 * nbytes / elapsed_s
