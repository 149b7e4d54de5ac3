"""The capacity model's inputs, measured while the run goes, and what the model says of them.

`Estimates` keeps EWMAs of T_train (the learner's forward, backward and optimiser step) and
T_bcast (publication until every peer held the version), fed by the learner loop and by the
propagation records. From them and the run's config it gives the `echo2p2p.capacity.Workload`,
the rollout throughput the active peers must deliver (which the activation pool is told), and
the `capacity/...` metrics of each step record.

Plain arithmetic over what it is fed: no clock, no peers, no I/O (the caller sums the active
peers' measured rates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from echo2p2p.capacity import Reading, Workload, predicted_busy_fraction, required_throughput

from ..config import HubConfig

EWMA_WEIGHT = 0.3  # the newest measurement's share


@dataclass
class Estimates:
    """EWMAs of the capacity model's inputs for one run."""

    cfg: HubConfig
    train_step_s: float = 0.0  # T_train; 0 before the first step was timed
    bcast_s: float | None = None  # T_bcast; None before a version reached every peer

    def observe_train_step(self, seconds: float) -> None:
        self.train_step_s = _ewma(self.train_step_s, seconds)

    def observe_broadcast(self, seconds: float) -> None:
        self.bcast_s = _ewma(self.bcast_s, seconds)

    def workload(self) -> Workload:
        """The capacity model's inputs as measured so far."""
        cfg = self.cfg
        return Workload(cfg.grpo.prompts_per_step * cfg.grpo.group_size, self.train_step_s or 1e-9,
                        self.bcast_s or 0.0, cfg.staleness.max_lag, cfg.staleness.kappa)

    def required_rollouts_per_s(self) -> float | None:
        """What the active peers must deliver (overlapped reading, which is how the hub runs with
        S >= 1); None, meaning every peer works, before a step was timed, with S = 0 (any
        throughput shortens a synchronous step) or when the broadcast breaks the rule."""
        if not self.train_step_s or self.cfg.staleness.max_lag == 0:
            return None
        return required_throughput(self.workload(), Reading.OVERLAPPED).rollouts_per_s

    def metrics(self, active_rollouts_per_s: float, required: float | None) -> dict[str, Any]:
        """The estimates, and the busy fraction they predict for active peers generating
        `active_rollouts_per_s` in all (overlapped reading); `required`: what the pool was told."""
        mu = active_rollouts_per_s
        return {
            "capacity/train_step_s": round(self.train_step_s, 4),
            "capacity/bcast_s": None if self.bcast_s is None else round(self.bcast_s, 4),
            "capacity/rollouts_per_s": round(mu, 2),
            "capacity/required_rollouts_per_s": required,
            "capacity/predicted_busy_frac": round(
                predicted_busy_fraction(self.workload(), mu, Reading.OVERLAPPED), 3),
        }


def _ewma(old: float | None, new: float, weight: float = EWMA_WEIGHT) -> float:
    return new if not old else (1 - weight) * old + weight * new
