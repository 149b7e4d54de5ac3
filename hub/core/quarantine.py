"""What follows, on the hub, from a peer's trust record: quarantine and its consequences.

`TrustGuard` counts trust events against a peer's identity (`echo2p2p.trust.TrustBook` keeps
the scores and decides when an identity is quarantined) and, when one tips it into quarantine,
carries that out: the peer's open leases go back to the queue, its admitted groups still
queued are withdrawn (journaled, so a resumed hub does not bring them back), every relay plan
is re-dealt around it, and the quarantine record goes to the run log (a dated `Record`) with a
lease pass asked for (`EndTurn`: the budget it held is dealt anew). A peer's record also sets
how often its rollouts are spot-checked. It never judges a rollout or a chunk itself
(`hub.core.admission` and `hub.overlay.relay_checks` do, and report here).
"""

from __future__ import annotations

import logging
from typing import Protocol

from echo2p2p.buffer import RolloutBuffer
from echo2p2p.leases import LeaseBook
from echo2p2p.trust import TrustBook

from .actions import EndTurn, Journal, Outbox, Record
from .counters import Counters
from .peer import Peer


class RoutesAround(Protocol):
    """What re-deals a quarantined peer's chunks in every broadcast (`hub.core.tracker`)."""

    def route_around(self, peer_id: str) -> None: ...

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side


class TrustGuard:
    """The trust book, and what the hub does when a peer is quarantined."""

    def __init__(self, trust: TrustBook, leases: LeaseBook, buffer: RolloutBuffer,
                 counters: Counters, outbox: Outbox):
        """`outbox`: the core's (journal records, the run log, lease passes). `overlay`, set
        once the tracker is built: re-deals a quarantined peer's chunks (None: a rig without)."""
        self.book = trust
        self.leases, self.buffer, self.counters, self.outbox = leases, buffer, counters, outbox
        self.overlay: RoutesAround | None = None

    def quarantined(self, conn: Peer) -> bool:
        return conn.identity in self.book.quarantined

    def check_fraction(self, conn: Peer, base: float) -> float:
        """The share of `conn`'s rollouts to spot-check now, `base` for a long clean record
        (`echo2p2p.trust.check_fraction`)."""
        return self.book.check_fraction(conn.identity, base)

    def good(self, conn: Peer) -> None:
        """`conn` passed a check: a point in its favour."""
        self.book.good(conn.identity)

    def distrust(self, conn: Peer, event: str) -> None:
        """Count `event` against `conn`; on quarantine: no more leases (open ones go back to
        the queue), its queued groups withdrawn (admitted ones may be forged too: most were
        never checked), its relays routed around, and a run log record."""
        if not self.book.record(conn.identity, event):
            return
        back = self.leases.release_peer(conn.peer_id)
        withdrawn = self.withdraw(conn.identity)
        if self.overlay is not None:
            self.overlay.route_around(conn.peer_id)
        record = {"event": "quarantine", "peer": conn.peer_id,
                  "name": conn.hello.name, "identity": conn.identity,
                  "score": round(self.book.score(conn.identity), 3),
                  "events": self.book.events[conn.identity], "leases_requeued": len(back),
                  "groups_withdrawn": withdrawn}
        log.warning("quarantined %s (%s): %s", conn.peer_id, conn.hello.name, record["events"])
        self.outbox.emit(Record(record, dated=True))
        self.outbox.emit(EndTurn())

    def withdraw(self, identity: str) -> int:
        """`identity`'s admitted groups still queued leave the buffer (it was quarantined: any
        of them may be forged), journaled so a resumed hub does not bring them back; how many."""
        gone = self.buffer.withdraw(identity)
        if gone:
            self.outbox.emit(Journal(("withdraw", [g.lease_id for g in gone])))
            self.counters.withdrawn_groups += len(gone)
        for group in gone:  # tests/chaos reads it
            log.debug("withdrew %s (v%d) of %s: quarantined", group.lease_id, group.version,
                      identity)
        return len(gone)
