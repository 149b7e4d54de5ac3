"""What the hub does with an accusation of a relay: it looks for itself before anything follows.

A `relay_report` names a peer and a fault. On the tracker and the striped chain the hub fetches
the chunk (for "slow", one of the accused's newest share, timed) from the accused's chunk route
(`hub.overlay.relay_checks.RelayJudge`); on gossip it dials the accused's `/gossip` and asks
for the piece (`hub.overlay.gossip_check.GossipJudge`). Either way it asks as a new receiver
would: under an id of its peer-id sequence, never handed out before, a fresh key and a ticket
of this run, so the accused cannot serve the check well and its receivers badly. Nonsense (an
unknown or departed peer, oneself, an unknown fault) is dropped here, before it is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.failover import HUB
from echo2p2p.overlay.tickets import Credentials

from .gossip_check import GossipJudge
from ..core.peer import Peer as PeerConn
from ..core.quarantine import TrustGuard
from .relay_checks import RelayCheck, RelayJudge, newest_share
from .tracker import VersionTracker

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side


class Accusations:
    """The hub's two relay judges, and which one hears a report."""

    def __init__(self, relay: str, peers: Mapping[str, PeerConn], tracker: VersionTracker,
                 guard: TrustGuard, counters: Any, signing_key: bytes, run_id: str, *,
                 new_peer_id: Callable[[], str], on_event: Callable[[dict[str, Any]], None]):
        """`relay`: the overlay (`OverlayConfig.relay`); `counters`: the hub's `Counters`;
        `signing_key`: the hub's, for its own ticket (its probes of a new chunk server) and
        the tickets of its checks (b"": a rig without tickets); `new_peer_id`: an id never
        handed out (and journaled), for each check; `on_event`: the run log."""
        self.relay, self.peers, self.tracker, self.counters = relay, peers, tracker, counters
        hub = Credentials(run_id, HUB, signing_key, signing.sign_ticket(
            signing_key, run_id, HUB, signing.public_key(signing_key))) if signing_key else None
        mint = lambda: (Credentials.issued(signing_key, run_id, new_peer_id())  # noqa: E731
                        if signing_key else None)
        failed = lambda conn: tracker.route_around(conn.peer_id)  # noqa: E731
        self.relays = RelayJudge(
            RelayCheck(hub, mint), failed=failed, distrust=guard.distrust, on_event=on_event,
            newest=lambda peer_id: newest_share(peer_id, tracker.broadcasts, tracker.snapshot))
        self.gossip = GossipJudge(signing_key, run_id, new_peer_id=new_peer_id,
                                  distrust=guard.distrust, failed=failed, on_event=on_event)

    def heard(self, conn: PeerConn, msg: m.RelayReport) -> None:
        """`conn` accuses `msg.peer_id`: counted, then checked by the judge of the overlay."""
        accused = self.peers.get(msg.peer_id)
        if accused is None or accused is conn or msg.reason not in m.RELAY_FAULTS:
            return  # nonsense, or about a peer already gone (and so already routed around)
        self.counters.relay_reports[(msg.peer_id, msg.reason)] += 1
        log.info("%s reports relay %s on v%d: %s", conn.peer_id, msg.peer_id, msg.version,
                 msg.reason)
        key = (msg.version, msg.base_version)
        snap = self.tracker.snapshot(*key)
        if self.relay != "gossip":
            self.relays.heard(conn, accused, msg, self.tracker.broadcasts.get(key), snap)
        elif snap is not None:
            self.gossip.accused(conn, accused, msg.reason, snap.manifest, msg.index)

    async def close(self) -> None:
        await self.relays.close()
        await self.gossip.close()
