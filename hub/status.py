"""What `GET /status` answers: a quick look at a live hub, as JSON-able data.

The run (step, published version, hub key), each connected peer (engine, held version, relay,
upload, trust, activation account), the capacity estimates, the cost meter, the queue and the
last step record. Reads the hub and the run, never changes them; knows nothing of HTTP (the
route in `echo2p2p.hub.trainer.start_hub` serialises what this returns).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .trainer import HubRun


def status(run: HubRun) -> dict[str, Any]:
    """What /status answers."""
    hub, stats = run.hub, run.hub.statistics()
    now = hub.now()
    accounts = hub.pool.per_peer(now)  # price, active, rollouts/s, admitted, $
    return {
        "run_id": hub.run_id, "step": stats.step, "hub_key": hub.hub_key.hex(),
        "published_version": stats.newest_version,
        "peers": {p.peer_id: {"name": p.hello.name, "engine": p.hello.engine,
                              "held_version": p.held_version, "relay_url": p.server_url,
                              "relay": p.relay, "upload_mbps": round(p.upload_bps / 1e6, 2),
                              "trust": round(hub.trust.score(p.identity), 3),
                              "quarantined": p.identity in hub.trust.quarantined,
                              **accounts.get(p.peer_id, {})}
                  for p in hub.peers.values()},
        "capacity": run.capacity_metrics(),
        "cost": hub.pool.meter(now),
        "queued_groups": stats.queued_groups, "open_leases": stats.open_leases,
        "last": run.records[-1] if run.records else None,
    }
