"""The capacity model's inputs, measured while the run goes, and what the model says of them.

`Estimates` keeps EWMAs of T_train (the learner loop's whole time per step but waiting for a
batch and evaluating: the forward, backward and optimiser step, the publication and checkpoint,
the step's record; what limits how fast it can eat rollouts, whatever the peers do) and
T_bcast (publication until every peer held the version), fed by the learner loop and by the
propagation records. From them and the run's config it gives the `echo2p2p.capacity.Workload`,
the rollout throughput the active peers must deliver (which the activation pool is told), and
the `capacity/...` metrics of each step record.

The model's mu is `capacity/gen_rollouts_per_s`: the active peers' generation rates while busy
(`echo2p2p.rates`), what they could deliver if never left waiting for leases; it is not the
admitted rate (`rollout/per_s`), and the busy fraction it predicts is the learner's if the peers
delivered that much. The required throughput is None only where the model has none, and
`capacity/required_why` then says why in words (no step timed yet, S = 0, a broadcast slower
than a publication period).

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
        S >= 1); None, meaning every peer works, where `required_why` says why."""
        return self.required()[0]

    def required(self) -> tuple[float | None, str]:
        """(the required throughput or None, the model's sentence on it)."""
        if not self.train_step_s:
            return None, "needs a measured learner step (every peer works until then)"
        if self.cfg.staleness.max_lag == 0:
            return None, "none at S = 0: any throughput shortens a synchronous step"
        need = required_throughput(self.workload(), Reading.OVERLAPPED)
        return need.rollouts_per_s, need.reason

    def metrics(self, gen_rollouts_per_s: float, required: float | None) -> dict[str, Any]:
        """The estimates, and the busy fraction they predict for active peers generating
        `gen_rollouts_per_s` in all while busy (overlapped reading); `required`: what the pool
        was told (None: `capacity/required_why` says why)."""
        mu = gen_rollouts_per_s
        return {
            "capacity/train_step_s": round(self.train_step_s, 4),
            "capacity/bcast_s": None if self.bcast_s is None else round(self.bcast_s, 4),
            "capacity/gen_rollouts_per_s": round(mu, 2),
            "capacity/required_rollouts_per_s": None if required is None else round(required, 2),
            "capacity/required_why": None if required is not None else self._why_none(),
            "capacity/predicted_busy_frac": round(predicted_busy_fraction(
                self.workload(), mu, Reading.OVERLAPPED), 3) if self.train_step_s else None,
        }

    def _why_none(self) -> str:
        """Why the pool was told no requirement: the model's sentence, or, where the model has
        one since (a broadcast measured between two steps), that the next step plans it."""
        required, why = self.required()
        return why if required is None else "planned at the next step"


def _ewma(old: float | None, new: float, weight: float = EWMA_WEIGHT) -> float:
    return new if not old else (1 - weight) * old + weight * new
