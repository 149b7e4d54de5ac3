"""What the hub does with an accusation of a relay: it looks for itself before anything follows.

A `relay_report` names a peer and a fault. On the tracker and the striped chain the hub fetches
the chunk (for "slow", one of the accused's newest share, timed) from the accused's chunk route;
on gossip it dials the accused's `/gossip` and asks for the piece. Either way it asks as a new
receiver would (`hub.overlay.relay_checks`, `hub.overlay.gossip_check`: the shell runs the
`CheckRelay` and `CheckGossip` this part emits, under an id of the hub's peer-id sequence never
handed out before, a fresh key and a ticket of this run), so the accused cannot serve the check
well and its receivers badly. Nonsense (an unknown or departed peer, oneself, an unknown fault)
is dropped here, before it is counted.

The verdicts come back here (`relay_checked`, `gossip_checked`) and are judged here: a chunk
that arrives whole and matches the signed manifest's digest clears the accused (and a
"corrupt" accuser has lied); a wrong digest convicts it (`bad_chunk`, once per chunk); no
answer in time keeps it out of relaying (`VersionTracker.route_around`). Accused of "slow", it
is asked for a random chunk of its share in the newest version it relays, and judged by the
receivers' own rule (`echo2p2p.pace`). Every advertised chunk server is probed first
(`ProbeRelay`, heard back in `probed`): only one the hub reached relays. Nothing here waits,
reads a clock or touches a socket.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from echo2p2p import messages as m
from echo2p2p.pace import DEFAULT_WINDOW, measured_bps, per_request_bps, too_slow
from echo2p2p.relay import Broadcast

from .actions import Outbox, Record
from .overlay_actions import CheckGossip, CheckRelay, ProbeRelay
from .peer import Peer
from .tracker import VersionTracker

# What the publisher made (`hub.overlay.versions`): the core reads their fields, never builds one.
Snapshot = Any  # hub.overlay.versions.Snapshot

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side

RECEIVER_STALL_S = 10.0  # a check asks as a receiver of the peers' default relay_stall_s does:
# wait = half of it, asked again after a 503 until it has passed (then a "stall")
MAX_PENDING = 256  # probes and checks waiting at most; accusations past that are not checked
MAX_REMEMBERED = 1 << 16  # gossip accusations and checked chunks kept before all are forgotten
PENDING = "pending"  # a check's chunk never came in (503 to the end): no pace is judged by it
VERDICTS = ("intact", "corrupt", "stall", "unreachable", "slow", PENDING)


@dataclass(frozen=True)
class Share:
    """The chunks a relay serves in one manifest, and the rate, bits/s, that each request a
    receiver sends it may expect (`echo2p2p.pace.per_request_bps`)."""

    manifest: m.Manifest
    chunks: list[int]
    rate_bps: float


@dataclass(frozen=True)
class Case:
    """One check under way: who accused whom of what, and which chunk the hub asked for."""

    accuser: Peer
    accused: Peer
    reason: str
    manifest: m.Manifest  # the reported one
    index: int  # the reported chunk
    asked: Share  # what was fetched: the reported chunk, or for "slow" the newest share
    chunk: int  # the chunk of `asked` fetched


def newest_share(peer_id: str, broadcasts: Mapping[tuple[int, int | None], Broadcast],
                 snapshot: Callable[[int, int | None], Snapshot | None]) -> Share | None:
    """What `peer_id` relays in the newest manifest (full before delta) in which it owns any
    chunk, as the plan a receiver joining now gets tells it (the owners' plan); None if none."""
    for key in sorted(broadcasts, key=lambda k: (k[0], k[1] is None), reverse=True):
        broadcast, snap = broadcasts[key], snapshot(*key)
        owned = [i for i in range(broadcast.n_chunks) if broadcast.owner(i) == peer_id]
        if owned and snap is not None:
            plan = broadcast.plan()
            rate_bps = next((s.rate_bps for s in plan.sources if s.peer_id == peer_id), 0.0)
            return Share(snap.manifest, owned,
                         per_request_bps(rate_bps, plan.window or DEFAULT_WINDOW))
    return None


class Accusations:
    """Who may relay, on the hub's own evidence, and which check hears a report."""

    def __init__(self, relay: str, peers: Mapping[str, Peer], tracker: VersionTracker,
                 outbox: Outbox, counters: Any, *, distrust: Callable[[Peer, str], None],
                 tickets: bool, min_rate_bytes_s: float, rng: random.Random | None = None):
        """`relay`: the overlay (`OverlayConfig.relay`); `counters`: the hub's `Counters`;
        `distrust(peer, event)`: count a trust event; `tickets`: the hub issues tickets (a
        gossip check needs one to dial with); `min_rate_bytes_s`: the receivers' stall floor
        (`echo2p2p.overlay.fetch.MIN_RATE_BYTES_S`); `rng`: which chunk a pace check asks."""
        self.relay, self.peers, self.tracker, self.counters = relay, peers, tracker, counters
        self.outbox, self._distrust, self._tickets = outbox, distrust, tickets
        self._min_rate_bytes_s, self._rng = min_rate_bytes_s, rng or random.Random()
        self.bad: set[str] = set()  # identities whose chunk server failed a check: never again
        self._accusations: set[tuple[str, str, tuple]] = set()  # (accuser, accused, manifest)
        self._convictions: set[tuple[str, tuple, int]] = set()  # (identity, manifest, chunk)
        self._gossip_heard: set[tuple[str, str, tuple]] = set()  # (accuser, accused, manifest)
        self._gossip_checked: set[tuple[str, tuple, int]] = set()  # (identity, manifest, chunk)
        self._probing: dict[str, Peer] = {}  # peer id -> the peer whose server is probed
        self._cases: dict[int, Case] = {}  # check id -> a relay check under way
        self._gossip_cases: dict[int, Case] = {}  # check id -> a gossip check under way
        self._next_check = 0

    @property
    def pending(self) -> int:
        """Probes and checks under way."""
        return len(self._probing) + len(self._cases) + len(self._gossip_cases)

    # --- probes -----------------------------------------------------------------------

    def probe(self, peer: Peer, version: int) -> None:
        """Ask `peer`'s advertised chunk server before it is dealt any chunk."""
        if peer.server_url is not None and peer.identity not in self.bad:
            self._probing[peer.peer_id] = peer
            self.outbox.emit(ProbeRelay(peer.peer_id, peer.server_url, version))

    def probed(self, peer_id: str, ok: bool, rate_bps: float | None) -> None:
        """The probe of `peer_id`'s server came back: `ok` (it answered in time), its uplink
        as the hub timed it (None: too little came)."""
        peer = self._probing.pop(peer_id, None)
        if peer is None:
            return
        if ok and rate_bps and not peer.upload_bps:  # the first version's shares; measured
            peer.upload_bps = rate_bps  # ones replace it
        if peer.relay == "unprobed":  # not judged meanwhile
            peer.relay = "ok" if ok else "failed"
            log.info("chunk server of %s at %s: %s", peer.peer_id, peer.server_url,
                     "reachable" if ok else "no answer, so it only pulls")

    # --- reports ----------------------------------------------------------------------

    def heard(self, peer: Peer, msg: m.RelayReport) -> None:
        """`peer` accuses `msg.peer_id`: counted, then checked by the judge of the overlay."""
        accused = self.peers.get(msg.peer_id)
        if accused is None or accused is peer or msg.reason not in m.RELAY_FAULTS:
            return  # nonsense, or about a peer already gone (and so already routed around)
        self.counters.relay_reports[(msg.peer_id, msg.reason)] += 1
        log.info("%s reports relay %s on v%d: %s", peer.peer_id, msg.peer_id, msg.version,
                 msg.reason)
        key = (msg.version, msg.base_version)
        snap = self.tracker.snapshot(*key)
        if self.relay != "gossip":
            self._heard_relay(peer, accused, msg, self.tracker.broadcasts.get(key), snap)
        elif snap is not None:
            self.accused_gossip(peer, accused, msg.reason, snap.manifest, msg.index)

    def _heard_relay(self, accuser: Peer, accused: Peer, report: m.RelayReport,
                     broadcast: Broadcast | None, snap: Snapshot | None) -> None:
        """Only a chunk the accuser was told to fetch from the accused is worth a look."""
        if (snap is not None and broadcast is not None and accuser.peer_id in broadcast.members
                and broadcast.source(accuser.peer_id, report.index) == accused.peer_id):
            told = broadcast.plan(accuser.peer_id)  # what its downloader judged by
            rate_bps = next((s.rate_bps for s in told.sources if s.peer_id == accused.peer_id), 0.0)
            rate_bps = per_request_bps(rate_bps, told.window or DEFAULT_WINDOW)
            self.accused(accuser, accused, report.reason, snap.manifest, report.index, rate_bps)

    def accused(self, accuser: Peer, accused: Peer, reason: str, manifest: m.Manifest,
                index: int, rate_bps: float = 0.0) -> None:
        """`accuser` says relay `accused` served chunk `index` of `manifest` badly (`reason`);
        `rate_bps`: what each request the accuser sent it may take (judges "slow")."""
        key = (manifest.version, manifest.base_version)
        if accused.relay != "ok" or (accuser.identity, accused.peer_id, key) in self._accusations:
            return  # it relays nothing already, or this accuser was heard on this manifest
        if len(self._probing) + len(self._cases) >= MAX_PENDING:
            log.warning("%d relay checks pending: not checking %s's report", MAX_PENDING,
                        accuser.peer_id)
            return
        self._accusations.add((accuser.identity, accused.peer_id, key))
        asked, chunk = Share(manifest, [index], rate_bps), index
        if reason == "slow":  # any chunk of its share tells its pace: one of the newest, as a
            asked = newest_share(accused.peer_id, self.tracker.broadcasts,  # receiver asks now,
                                 self.tracker.snapshot) or asked  # at random, so that it
            chunk = self._rng.choice(asked.chunks)  # cannot keep a few quick to pass
        check_id = self._check_id()
        self._cases[check_id] = Case(accuser, accused, reason, manifest, index, asked, chunk)
        self.outbox.emit(CheckRelay(check_id, accused.peer_id, accused.server_url,
                                    asked.manifest, chunk))

    def relay_checked(self, check_id: int, verdict: str, elapsed_s: float, now: float) -> None:
        """The shell fetched check `check_id`'s chunk: one of VERDICTS but "slow", its last
        request `elapsed_s` long."""
        case = self._cases.pop(check_id, None)
        if case is None:
            return
        accuser, accused, reason = case.accuser, case.accused, case.reason
        if reason == "slow":
            verdict = self._paced(accused, case.asked, case.chunk, verdict, elapsed_s, now)
        elif verdict == PENDING:  # alive, but it never got the chunk it should serve
            verdict = "stall"
        checked = (case.asked.manifest.version, case.asked.manifest.base_version)
        log.warning("checked %s's report of %s (%s, chunk %d of v%d) on chunk %d of v%d: %s",
                    accuser.peer_id, accused.peer_id, reason, case.index, case.manifest.version,
                    case.chunk, checked[0], verdict)
        self.outbox.emit(Record({
            "event": "relay_check", "accuser": accuser.peer_id, "accused": accused.peer_id,
            "reason": reason, "version": case.manifest.version, "chunk": case.index,
            "checked": [*checked, case.chunk], "verdict": verdict}, dated=True))
        if verdict == "intact" and reason == "corrupt":  # whole: the accusation was a lie
            self._distrust(accuser, "false_report")
        conviction = (accused.identity, checked, case.chunk)
        if verdict == "corrupt" and conviction not in self._convictions:
            self._convictions.add(conviction)
            self._distrust(accused, "bad_chunk")
        failed = verdict == "corrupt" or (verdict in ("stall", "unreachable") and reason != "slow")
        if failed and accused.relay != "failed":
            accused.relay = "failed"
            self.bad.add(accused.identity)
            self.tracker.route_around(accused.peer_id, now)

    def _paced(self, accused: Peer, share: Share, index: int, verdict: str,
               elapsed_s: float, now: float) -> str:
        """What a pace check found, having fetched chunk `index` of `share` (`verdict`, its last
        request `elapsed_s` long): "slow", and so judged, past the receivers' own rule (a
        receiver that waited as long would report it), or cut off by their deadline; else the
        fetch's verdict. "pending" (it does not hold that chunk yet) and "unreachable" (a
        version it dropped, or gone) say nothing of its pace."""
        nbytes = share.manifest.chunks[index].wire_bytes
        rate_bps = max(share.rate_bps, 8 * self._min_rate_bytes_s)  # as a receiver's: never
        if verdict == "stall" or (verdict == "intact" and too_slow(  # looser than its stall
                nbytes, elapsed_s, rate_bps, RECEIVER_STALL_S / 2)):  # deadline
            self._slow(accused, measured_bps(nbytes, elapsed_s), now)
            return "slow"
        return verdict

    def _slow(self, accused: Peer, measured: float | None, now: float) -> None:
        """The hub itself saw `accused` deliver far below its dealt rate: it relays nothing more
        on this connection (a new one is probed afresh: slow is not malice), and its estimate
        is what the hub measured."""
        if measured is not None:
            accused.upload_bps = min(accused.upload_bps or measured, measured)
        if accused.relay == "ok":
            accused.relay = "slow"
            self.tracker.route_around(accused.peer_id, now)

    # --- gossip -----------------------------------------------------------------------

    def accused_gossip(self, accuser: Peer, accused: Peer, reason: str, manifest: m.Manifest,
                       index: int) -> None:
        """`accuser` says `accused` served chunk `index` of `manifest` over a link badly: one
        check per (accuser, accused, manifest) and one per chunk of an accused."""
        key = (manifest.version, manifest.base_version)
        seen, chunk = (accuser.identity, accused.peer_id, key), (accused.identity, key, index)
        if (not self._tickets or accused.server_url is None or accused.relay == "failed"
                or not 0 <= index < len(manifest.chunks) or seen in self._gossip_heard
                or chunk in self._gossip_checked):
            return  # no tickets to dial with, nobody can dial it, judged, or heard already
        if len(self._gossip_cases) >= MAX_PENDING:
            log.warning("%d gossip checks pending: not checking %s's report", MAX_PENDING,
                        accuser.peer_id)
            return
        if len(self._gossip_heard) >= MAX_REMEMBERED or len(self._gossip_checked) >= MAX_REMEMBERED:
            self._gossip_heard.clear()  # a long run's worth: forget the oldest all at once
            self._gossip_checked.clear()
        self._gossip_heard.add(seen)
        self._gossip_checked.add(chunk)
        check_id = self._check_id()
        self._gossip_cases[check_id] = Case(accuser, accused, reason, manifest, index,
                                            Share(manifest, [index], 0.0), index)
        self.outbox.emit(CheckGossip(check_id, accused.peer_id, accused.server_url,
                                     manifest, index))

    def gossip_checked(self, check_id: int, verdict: str, now: float) -> None:
        """The shell asked for check `check_id`'s piece over a link: one of
        `hub.overlay.gossip_check.VERDICTS`. A corrupt piece is `bad_chunk`; no answer, or a
        refusal of a chunk it claims, takes it out of relaying (slowness proves no lie);
        anything else proves nothing, and a whole piece does not cost the accuser."""
        case = self._gossip_cases.pop(check_id, None)
        if case is None:
            return
        accuser, accused = case.accuser, case.accused
        log.warning("checked %s's report of %s over a gossip link (%s, chunk %d of v%d): %s",
                    accuser.peer_id, accused.peer_id, case.reason, case.index,
                    case.manifest.version, verdict)
        self.outbox.emit(Record({
            "event": "relay_check", "accuser": accuser.peer_id, "relay": "gossip",
            "accused": accused.peer_id, "reason": case.reason,
            "version": case.manifest.version, "chunk": case.index, "verdict": verdict},
            dated=True))
        if verdict == "corrupt":  # once per chunk: it is checked once
            self._distrust(accused, "bad_chunk")
        if verdict in ("corrupt", "stall") and accused.relay != "failed":
            accused.relay = "failed"
            self.tracker.route_around(accused.peer_id, now)

    def _check_id(self) -> int:
        self._next_check += 1
        return self._next_check
