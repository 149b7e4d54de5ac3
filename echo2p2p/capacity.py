"""The overlap capacity model: how much rollout throughput keeps the learner busy.

Pure arithmetic over plain numbers (DESIGN.md, "An overlap-based capacity model"); it knows
nothing of peers, prices or clocks. Symbols: R rollouts (completions) per learner step, T_train
seconds per step, T_bcast seconds for a version to reach the workers, kappa the publication
period in steps, S the staleness bound, mu the pool's aggregate rollouts/s.

Within one publication period of kappa steps the workers must make the kappa*R rollouts the
learner will eat. Two readings of that rule, and a plan always says which one it used:

  sequential  the download and the generation share the period:
              T_bcast + kappa*R/mu <= kappa*T_train  =>  mu >= kappa*R / (kappa*T_train - T_bcast),
              which needs kappa*T_train > T_bcast.
  overlapped  workers keep generating on the old version while the new one downloads, so only
              the rate matters: mu >= R / T_train, with T_bcast <= kappa*T_train (else versions
              arrive slower than they are published and the pool falls ever further behind).

T_bcast itself is estimated by `broadcast_s` for every worker receiving each version, from the
hub's uplink B_hub and the workers' uplinks: with the overlay (gossip or the pipelined tracker),
the max-flow bound of upload-limited broadcast, M / min(B_hub, (B_hub + sum of uplinks) / N),
times PIPELINED_OVER_BOUND as measured by `bench/broadcast.py`; with the striped chain,
M / min(B_hub, N / (N - 1) * the slowest uplink) times the same; with a star, N * M / B_hub.

Invariants: a Requirement never carries a negative or infinite throughput (infeasible is
`rollouts_per_s=None` plus a sentence), and a busy fraction is in [0, 1], equal to 1 exactly
when the pool meets a feasible requirement.
"""

from __future__ import annotations

import enum
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ConfigError
from .staleness import check_schedule

PIPELINED_OVER_BOUND = 1.4
"""Measured completion time / max-flow bound of the overlay: 1.43 (uniform) and 1.34
(heterogeneous) with 16 peers on tbf-shaped links (`bench/broadcast.py`)."""


class Reading(enum.Enum):
    """Which form of the provisioning rule a plan uses (see the module docstring)."""

    SEQUENTIAL = "sequential"
    OVERLAPPED = "overlapped"


@dataclass(frozen=True)
class Workload:
    """What the learner consumes and how fast versions travel."""

    rollouts_per_step: float
    """R: completions (samples, not prompt groups) one learner step consumes."""
    train_step_s: float
    """T_train: seconds of one learner step."""
    bcast_s: float
    """T_bcast: seconds from publication until the workers hold the version (0 = instant)."""
    max_lag: int
    """S: a rollout of version x may train step t iff t - x <= S."""
    kappa: int
    """Publication period in steps; 1 <= kappa <= S + 1."""

    def __post_init__(self) -> None:
        for name in ("rollouts_per_step", "train_step_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a finite number > 0, got {value}")
        # A zero broadcast is the co-located limit (and what a hub reports before it has
        # measured one), so only negative, NaN and infinite values are refused.
        if not (math.isfinite(self.bcast_s) and self.bcast_s >= 0):
            raise ConfigError("bcast_s", f"must be a finite number >= 0, got {self.bcast_s}")
        try:
            check_schedule(self.max_lag, self.kappa)
        except ConfigError as exc:
            raise ConfigError({"publish_every": "kappa"}.get(exc.field, exc.field),
                              exc.problem) from None


@dataclass(frozen=True)
class Requirement:
    """The verdict of the provisioning rule for one workload and reading."""

    feasible: bool
    rollouts_per_s: float | None
    """Aggregate throughput the active workers must reach; None when infeasible."""
    reading: Reading
    reason: str
    """One sentence: the arithmetic when feasible, what to change when not."""


def _fits(kappa_train_s: float, bcast_s: float, reading: Reading) -> bool:
    """Whether a broadcast fits the publication period in this reading."""
    if reading is Reading.SEQUENTIAL:
        return kappa_train_s > bcast_s  # equality leaves zero time to generate
    return bcast_s <= kappa_train_s


def required_throughput(w: Workload, reading: Reading) -> Requirement:
    """The aggregate rollouts/s the active set must reach, or why no pool can suffice."""
    period_s = w.kappa * w.train_step_s
    if not _fits(period_s, w.bcast_s, reading):
        verb = "takes at least" if reading is Reading.SEQUENTIAL else "takes longer than"
        least = _smallest_kappa(w.train_step_s, w.bcast_s, reading)
        fix = f" (kappa >= {least} fits, with S >= {least - 1})" if least <= 1000 else ""
        return Requirement(False, None, reading,
                           f"a broadcast ({w.bcast_s:.1f} s) {verb} kappa*T_train "
                           f"({period_s:.1f} s): raise kappa or S{fix}, or speed up the broadcast")
    if reading is Reading.SEQUENTIAL:
        mu = w.kappa * w.rollouts_per_step / (period_s - w.bcast_s)
        why = (f"sequential reading: sum(mu) >= kappa*R/(kappa*T_train - T_bcast) = "
               f"{w.kappa}*{w.rollouts_per_step:g}/({period_s:g} - {w.bcast_s:g}) = {mu:.4g}/s")
    else:
        mu = w.rollouts_per_step / w.train_step_s
        why = (f"overlapped reading: sum(mu) >= R/T_train = {w.rollouts_per_step:g}/"
               f"{w.train_step_s:g} = {mu:.4g}/s; the broadcast ({w.bcast_s:g} s) fits in "
               f"kappa*T_train ({period_s:g} s)")
    if not math.isfinite(mu):  # a gap so small that kappa*R/gap overflows
        return Requirement(False, None, reading,
                           f"kappa*T_train ({period_s:g} s) exceeds the broadcast ({w.bcast_s:g} s)"
                           " by too little to generate anything: raise kappa or S")
    return Requirement(True, mu, reading, why)


def _smallest_kappa(train_step_s: float, bcast_s: float, reading: Reading) -> int:
    """The least kappa >= 1 whose period fits the broadcast."""
    if not (math.isfinite(train_step_s) and train_step_s > 0):
        raise ConfigError("train_step_s", f"must be a finite number > 0, got {train_step_s}")
    if not (math.isfinite(bcast_s) and bcast_s >= 0):
        raise ConfigError("bcast_s", f"must be a finite number >= 0, got {bcast_s}")
    ratio = bcast_s / train_step_s
    if not math.isfinite(ratio):
        return 2**63  # no period of any practical length fits
    kappa = max(1, math.ceil(ratio) - 1)  # a guess a step low, then walk up
    while not _fits(kappa * train_step_s, bcast_s, reading):
        kappa += 1
    return kappa


def feasible_schedules(train_step_s: float, bcast_s: float, reading: Reading,
                       max_lag_limit: int = 16) -> list[tuple[int, int]]:
    """Every (S, kappa) with S <= max_lag_limit and kappa <= S + 1 that the reading allows.

    Feasibility depends on kappa alone (kappa*T_train against T_bcast); S enters only through
    kappa <= S + 1. Sorted by (S, kappa), so the first entry is the least stale schedule.
    """
    low = _smallest_kappa(train_step_s, bcast_s, reading)
    return [(s, k) for s in range(max_lag_limit + 1) for k in range(low, s + 2)]


def smallest_schedule(train_step_s: float, bcast_s: float, reading: Reading,
                      max_lag_limit: int = 16) -> tuple[int, int] | None:
    """The least S (then least kappa) that fits: (kappa_min - 1, kappa_min), or None."""
    kappa = _smallest_kappa(train_step_s, bcast_s, reading)
    return (kappa - 1, kappa) if kappa - 1 <= max_lag_limit else None


def predicted_busy_fraction(w: Workload, total_rollouts_per_s: float, reading: Reading) -> float:
    """Fraction of wall time the learner computes rather than waits, for a pool of throughput mu.

    Sequential: a period needs kappa*T_train of learner work and, on the worker side,
    T_bcast + kappa*R/mu before the next period's rollouts exist; the slower side sets the
    period, so busy = kappa*T_train / max(kappa*T_train, T_bcast + kappa*R/mu).
    Overlapped: the pool makes R rollouts in R/mu while the learner eats them in T_train, so
    busy = T_train / max(T_train, R/mu). If the broadcast is longer than the period
    (T_bcast > kappa*T_train), versions can be published only once per T_bcast, which stretches
    the period by T_bcast / (kappa*T_train): busy is scaled by kappa*T_train / T_bcast.
    A pool with mu == 0 never feeds the learner: 0. The result is exactly 1 iff the pool meets a
    feasible requirement, and rounding can never make a starved learner read as fully busy.
    """
    mu = total_rollouts_per_s
    if not (math.isfinite(mu) and mu >= 0):
        raise ValueError(f"total_rollouts_per_s must be finite and >= 0, got {mu}")
    if mu == 0:
        return 0.0
    need = required_throughput(w, reading)
    if need.feasible and mu >= need.rollouts_per_s:
        return 1.0
    period_s = w.kappa * w.train_step_s
    if reading is Reading.SEQUENTIAL:
        busy = period_s / max(period_s, w.bcast_s + w.kappa * w.rollouts_per_step / mu)
    else:
        busy = w.train_step_s / max(w.train_step_s, w.rollouts_per_step / mu)
        if w.bcast_s > period_s:
            busy *= period_s / w.bcast_s
    return min(busy, math.nextafter(1.0, 0.0))  # short of the requirement: never a full 1


def predicted_staleness(w: Workload) -> dict[int, float]:
    """Share of consumed rollouts at each lag t - x, in a steady pipelined run.

    Assumptions (the pipeline the hub runs when S >= 1): step t runs over [t, t+1) in units of
    T_train; version v exists at v and, if published (v a multiple of kappa), every worker holds
    it at v + b with b = T_bcast / T_train; a worker starts each rollout on the newest version
    it holds; the rollouts step t consumes were started evenly over the step before, [t-1, t)
    (the pool runs at the required rate and the hub leases one batch ahead); steps are equally
    likely in every phase modulo kappa. Then lag = t - kappa*floor((u - b)/kappa) for a start
    time u: it runs from 1 to kappa + ceil(b), with mean b + (kappa + 1)/2. Lags above S are
    rollouts the hub will drop as stale (see `predicted_stale_fraction`).
    With S = 0 the hub does not pipeline (the learner waits for rollouts of its own version), so
    every rollout has lag 0.
    """
    if w.max_lag == 0:
        return {0: 1.0}
    k, b = w.kappa, w.bcast_s / w.train_step_s
    shares: dict[int, float] = defaultdict(float)
    base = k * (math.ceil(b / k) + 2)  # a step late enough that every version index is >= 0
    for t in range(base, base + k):
        lo, hi = t - 1 - b, t - b  # u - b over the start window u in [t-1, t)
        m = math.floor(lo / k)
        while k * m < hi:
            overlap = min(hi, k * (m + 1)) - max(lo, k * m)
            if overlap > 0:
                shares[t - k * m] += overlap / k
            m += 1
    return dict(sorted(shares.items()))


def predicted_stale_fraction(w: Workload) -> float:
    """Share of rollouts the hub would drop as older than S, under `predicted_staleness`'s
    assumptions. Lags reach kappa + ceil(b), so a pipelined schedule drops nothing only if
    S >= kappa + ceil(T_bcast / T_train): kappa <= S + 1 alone is not enough."""
    return math.fsum(share for lag, share in predicted_staleness(w).items() if lag > w.max_lag)


def broadcast_s(nbytes: float, hub_bps: float, uplinks_bps: Sequence[float], relay: str) -> float:
    """Estimated seconds for a version of `nbytes` to reach every one of the workers whose
    uplinks are `uplinks_bps`, from a hub sending at `hub_bps`, by `relay` (one of
    `echo2p2p.relay.STRATEGIES`; see the module docstring)."""
    n = max(len(uplinks_bps), 1)
    if relay == "star":
        return n * 8 * nbytes / hub_bps
    if relay == "striped-chain" and n > 1:  # every chunk crosses every uplink in the ring
        slowest = min(uplinks_bps) * n / (n - 1)
        return PIPELINED_OVER_BOUND * 8 * nbytes / min(hub_bps, slowest)
    rate = min(hub_bps, (hub_bps + sum(uplinks_bps)) / n)
    return PIPELINED_OVER_BOUND * 8 * nbytes / rate
