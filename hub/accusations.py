"""What the hub does with an accusation of a relay: it looks for itself before anything follows.

A `relay_report` names a peer and a fault. On the tracker and the striped chain the hub fetches
the chunk from the accused's chunk route with its own ticket (`hub.relays.RelayJudge`); on
gossip it dials the accused's `/gossip` as a fresh peer of its own and asks for the piece
(`hub.gossip_check.GossipJudge`). Nonsense (an unknown or departed peer, oneself, an unknown
fault) is dropped here, before it is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.overlay.tickets import Credentials

from .gossip_check import GossipJudge
from .peers import PeerConn
from .relays import RelayCheck, RelayJudge

log = logging.getLogger("echo2p2p.hub.server")  # one logger for the hub's peer-facing side


class Accusations:
    """The hub's two relay judges, and which one hears a report."""

    def __init__(self, hub: Any, signing_key: bytes, new_peer_id: Callable[[], str]):
        """`hub`: the `Hub` (its peers, tracker, counters, trust guard, run log and step);
        `new_peer_id`: an id never handed out, for the gossip judge's own link."""
        self.hub = hub
        run_id = hub.run_id
        credentials = Credentials(run_id, "hub", signing_key, signing.sign_ticket(
            signing_key, run_id, "hub", hub.hub_key)) if signing_key else None
        failed = lambda conn: hub.tracker.route_around(conn.peer_id)  # noqa: E731
        on_event = lambda r: hub.on_event({**r, "step": hub.step})  # noqa: E731
        self.relays = RelayJudge(RelayCheck(credentials), distrust=hub.guard.distrust,
                                 failed=failed, on_event=on_event)
        self.gossip = GossipJudge(signing_key, run_id, new_peer_id=new_peer_id,
                                  distrust=hub.guard.distrust, failed=failed, on_event=on_event)

    def heard(self, conn: PeerConn, msg: m.RelayReport) -> None:
        """`conn` accuses `msg.peer_id`: counted, then checked by the judge of the overlay."""
        hub = self.hub
        accused = hub.peers.get(msg.peer_id)
        if accused is None or accused is conn or msg.reason not in m.RELAY_FAULTS:
            return  # nonsense, or about a peer already gone (and so already routed around)
        hub.counters.relay_reports[(msg.peer_id, msg.reason)] += 1
        log.info("%s reports relay %s on v%d: %s", conn.peer_id, msg.peer_id, msg.version,
                 msg.reason)
        key = (msg.version, msg.base_version)
        snap = hub.tracker.snapshot(*key)
        if hub.cfg.overlay.relay != "gossip":
            self.relays.heard(conn, accused, msg, hub.tracker.broadcasts.get(key), snap)
        elif snap is not None:
            self.gossip.accused(conn, accused, msg.reason, snap.manifest, msg.index)

    async def close(self) -> None:
        await self.relays.close()
        await self.gossip.close()
