"""What `GET /status` answers: a quick look at a live hub, as JSON-able data.

The run (step, published version, hub key), each connected peer (engine, held version, relay,
upload, trust, activation account, state, seconds since it was last heard), the capacity
estimates, the cost meter with the LP bound, the staleness of what was trained and dropped, the
queue and the last step record; or, for whoever lacks the dashboard token, only the run's public
part (`public_status`). Reads the hub and the run, never changes them; knows nothing of HTTP
(the routes in `echo2p2p.hub.dashboard` serialise what this returns).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .peers import PeerConn
    from .server import Hub
    from .trainer import HubRun


def status(run: HubRun) -> dict[str, Any]:
    """What /status answers."""
    hub, stats = run.hub, run.hub.statistics()
    now = hub.now()
    accounts = hub.pool.per_peer(now)  # price, active, rollouts/s, admitted, $
    return {
        "run_id": hub.run_id, "step": stats.step, "hub_key": hub.hub_key.hex(),
        "published_version": stats.newest_version, "max_lag": run.cfg.staleness.max_lag,
        "kappa": run.cfg.staleness.kappa,
        "peers": {p.peer_id: {"name": p.hello.name, "engine": p.hello.engine,
                              "held_version": p.held_version, "relay_url": p.server_url,
                              "relay": p.relay, "upload_mbps": round(p.upload_bps / 1e6, 2),
                              "trust": round(hub.trust.score(p.identity), 3),
                              "quarantined": p.identity in hub.trust.quarantined,
                              **accounts.get(p.peer_id, {}), "state": peer_state(hub, p),
                              "last_seen_s": round(p.protocol.silent_for(now), 1)}
                  for p in hub.peers.values()},
        "capacity": run.capacity_metrics(),
        "cost": {**hub.pool.meter(now), "lp_bound_usd_per_hour": hub.pool.lp_bound()},
        "staleness": staleness(run),
        "queued_groups": stats.queued_groups, "open_leases": stats.open_leases,
        "last": run.records[-1] if run.records else None,
    }


def public_status(run: HubRun) -> dict[str, Any]:
    """What /status on the peers' port answers without the dashboard token: what any peer
    learns from its welcome (run, hub key, version, S) and the step. No peer's name, address,
    trust or leases."""
    hub = run.hub
    return {"run_id": hub.run_id, "step": hub.step, "hub_key": hub.hub_key.hex(),
            "published_version": hub.tracker.newest_version, "max_lag": run.cfg.staleness.max_lag,
            "kappa": run.cfg.staleness.kappa, "public": True}


def peer_state(hub: Hub, conn: PeerConn) -> str:
    """quarantined (its identity is), active (leased work by the pool) or standby."""
    if conn.identity in hub.trust.quarantined:
        return "quarantined"
    return "active" if hub.pool.is_active(conn.peer_id) else "standby"


def staleness(run: HubRun) -> dict[str, dict[str, int]]:
    """Groups by lag in versions over the run: trained on, and dropped as stale (on arrival,
    or aged out in the queue)."""
    return {"trained": {str(k): n for k, n in sorted(run.runlog.staleness.items())},
            "dropped": {str(k): n for k, n in sorted(dropped_lags(run.hub).items())}}


def dropped_lags(hub: Hub) -> Counter[int]:
    """Groups dropped as stale by their lag in versions: on arrival, and aged out in the queue."""
    return hub.counters.stale_lags + hub.buffer.dropped_lags
