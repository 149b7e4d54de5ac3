"""What `GET /status` answers: a quick look at a live hub, as JSON-able data.

The run (step, published version, hub key), each connected peer (engine, held version, relay,
upload, trust, activation account, state, seconds since it was last heard), the capacity
estimates, the cost meter with the LP bound, the staleness of what was trained and dropped, the
queue, the last step record and the evaluation under way (its version, problems done of all;
null when none runs); or, for whoever lacks the dashboard token, only the run's public
part (`public_status`). Reads the hub's `statistics()` and `peer_views()` and the run, never
changes them; knows nothing of HTTP
(the routes in `echo2p2p.hub.view.dashboard` serialise what this returns).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import HubConfig
    from ..learning.held_out import EvalProgress
    from ..serving.counters import HubStatistics
    from ..serving.server import Hub
    from .runlog import RunLog


class HubRun(Protocol):
    """What the views read of a running hub (`echo2p2p.hub.run.loop.HubRun`, a layer above
    them: `tests/test_hub_layers.py`): its config, its hub, its run log and step records."""

    cfg: HubConfig
    hub: Hub
    runlog: RunLog
    records: list[dict[str, Any]]
    resumed: bool
    evaluating: EvalProgress | None

    def capacity_metrics(self, hub: HubStatistics | None = None) -> dict[str, Any]: ...


def status(run: HubRun) -> dict[str, Any]:
    """What /status answers."""
    hub, stats = run.hub, run.hub.statistics()
    return {
        "run_id": hub.core.run_id, "step": stats.step, "hub_key": hub.core.hub_key.hex(),
        "published_version": stats.newest_version, "max_lag": run.cfg.staleness.max_lag,
        "kappa": run.cfg.staleness.kappa,
        "peers": {p.peer_id: {"name": p.name, "engine": p.engine,
                              "held_version": p.held_version, "relay_url": p.server_url,
                              "relay": p.relay, "upload_mbps": round(p.upload_bps / 1e6, 2),
                              "trust": round(p.trust, 3), "quarantined": p.state == "quarantined",
                              **p.account, "state": p.state, "last_seen_s": round(p.silent_s, 1)}
                  for p in hub.peer_views().values()},
        "capacity": run.capacity_metrics(),
        "cost": {**stats.cost, "lp_bound_usd_per_hour": stats.lp_bound_usd_per_hour},
        "staleness": staleness(run.runlog.staleness, stats),
        "queued_groups": stats.queued_groups, "open_leases": stats.open_leases,
        "frames_dropped": dict(stats.frames_dropped),
        "last": run.records[-1] if run.records else None,
        "evaluating": None if (evaluating := run.evaluating) is None else evaluating.as_dict(),
    }


def public_status(run: HubRun) -> dict[str, Any]:
    """What /status on the peers' port answers without the dashboard token: what any peer
    learns from its welcome (run, hub key, version, S) and the step. No peer's name, address,
    trust or leases."""
    hub, newest = run.hub, run.hub.core.tracker.snapshot()  # not statistics(): anyone may ask, often
    return {"run_id": hub.core.run_id, "step": hub.core.step, "hub_key": hub.core.hub_key.hex(),
            "published_version": None if newest is None else newest.manifest.version,
            "max_lag": run.cfg.staleness.max_lag, "kappa": run.cfg.staleness.kappa, "public": True}


def staleness(trained: Mapping[int, int], stats: HubStatistics) -> dict[str, dict[str, int]]:
    """Groups by lag in versions over the run: `trained` on, and dropped as stale (on arrival,
    or aged out in the queue)."""
    return {"trained": {str(k): n for k, n in sorted(trained.items())},
            "dropped": {str(k): n for k, n in sorted(stats.dropped_lags.items())}}
