"""The run log record of one learner step, built from plain values.

`step_record` lays out the record `hub.run.loop` logs after every step (the run log, the
dashboard's feed, /metrics' last-step gauges and the report read it): the learner's own
metrics and off-policy diagnostics, the staleness of the batch, rates over the recent window,
and the hub's totals from `Hub.statistics()`. It reads no part of the hub and no clock: the
caller measures the times.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from echo2p2p.rates import RATE_WINDOW_S

from ..serving.counters import HubStatistics


def step_record(step: int, hub: HubStatistics, learner: Mapping[str, Any], leases: list[str],
                lags: Counter[int], *, time_s: float, rollouts_per_s: float, busy_frac: float,
                tokens_per_s: float, capacity: Mapping[str, Any],
                off_policy: Mapping[str, Any] | None = None, filtered: int = 0) -> dict[str, Any]:
    """The record of learner step `step` (which produced version `HubCore.step`): `learner`, the
    step's own metrics; `leases`, its batch's lease ids; `lags`, their lags in versions;
    `time_s`, the run's clock (`HubRun.elapsed_s`: learner loop seconds over every process of
    a resumed run); `rollouts_per_s` admitted per second and `busy_frac` the share of time the
    learner did not wait for a batch, both over the last `RATE_WINDOW_S` s (`echo2p2p.rates`);
    `capacity`, the capacity model's metrics;
    `off_policy`, the step's off-policy diagnostics by lag (`hub.learning.off_policy.summary`:
    mismatch_kl, mismatch_abs_mean/max, ratio_mean/min/max, clip_frac, by_lag); `filtered`,
    the groups admitted with all G rewards equal since the last step's record and so never
    trained (`grpo.dynamic_sampling`; `rollout/filtered_groups_total` is the run's)."""
    scoring = hub.scoring
    return {
        "step": step, "version": hub.step, "time_s": round(time_s, 3),
        **learner,
        "rollout/staleness_hist": {str(k): v for k, v in sorted(lags.items())},
        "rollout/staleness_mean": sum(k * v for k, v in lags.items()) / len(leases),
        "rollout/leases": leases,
        "rollout/per_s": round(rollouts_per_s, 3),
        "rollout/rate_window_s": RATE_WINDOW_S,
        "rollout/admitted_groups_total": hub.admitted_groups,
        "rollout/stale_on_arrival_total": hub.stale_on_arrival,
        "rollout/stale_in_queue_total": hub.stale_in_queue,
        "rollout/rejected_total": hub.rejected,
        "rollout/rejected_by": dict(hub.rejected_by),
        "rollout/spot_checked_total": hub.spot_checked,
        "rollout/spot_failed_total": hub.spot_failed,
        "rollout/withdrawn_total": hub.withdrawn_groups,
        "rollout/filtered_groups": filtered,
        "rollout/filtered_groups_total": hub.filtered_groups,
        "hub/learner_busy_frac": round(busy_frac, 4),
        "hub/peers": hub.peers,
        "hub/closed_for_protocol_total": hub.closed_for_protocol,
        "hub/score_timeouts_total": scoring.timeouts if scoring else 0,
        "hub/score_failures_total": scoring.failures if scoring else 0,
        "train/tokens_per_s": tokens_per_s,
        **capacity,
        **hub.cost,
        **(off_policy or {}),
    }
