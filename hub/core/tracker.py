"""The hub as the overlay's tracker: which versions it keeps and how each spreads to the peers.

`VersionTracker.publish` announces each version to every ready peer (as a delta to those whose
whole stream is at its base, else in full) with a relay plan per manifest
(`echo2p2p.relay.Broadcast`); a late joiner, a peer back from a disconnect or a cold standby
peer put to work catches up on the newest: as one delta from a version it holds whole
(`hub.core.catchups`), else in full. A share goes only to a peer the seed watch allows
(`hub.core.seeding`: a probation share until the hub saw it fetch what it was dealt). Plans
are re-dealt when a relaying peer leaves, is quarantined, fails the hub's own check or fetches
nothing of its share within its grace; each peer's report of a finished transfer feeds the per-version
propagation record (`echo2p2p.propagation.Propagation`) and, once a version has spread, the
peers' measured upload and the hub's send rate, from which the next version's T_bcast is
predicted.
It knows the chunks of the hub's share (`snapshot`). It never grants leases, judges rollouts,
reads a clock or touches a socket: time comes in as `now`, announcements go into the core's
outbox (`Peer.post`), records as `Record`s, encodes as `BuildDelta` and the watch's deadline
as `WakeAt` (`hub.core.overlay_actions`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from echo2p2p import messages as m
from echo2p2p.capacity import broadcast_s
from echo2p2p.pool import Pool
from echo2p2p.propagation import Propagation
from echo2p2p.relay import Broadcast, Member, deal_seeds, gossip_plan, neighbour_sample
from echo2p2p.seed_watch import Key, Silence

from ..config_sections import OverlayConfig
from .events import Published, Snapshot
from .actions import Outbox, Record
from .catchups import CatchUps
from .peer import Peer
from .seeding import Seeding

# What the publisher made (`hub.overlay.versions`): the core reads their fields, never builds one.

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side


class VersionTracker:
    """Published versions, their broadcasts and propagation records, over the hub's peers."""

    def __init__(self, overlay: OverlayConfig, peers: dict[str, Peer], pool: Pool,
                 outbox: Outbox, *, quarantined: Callable[[Peer], bool]):
        """`peers`: the hub's connected peers (read, never changed here); `outbox`: the core's;
        `quarantined`: whether a peer may no longer relay."""
        self.overlay = overlay
        self.peers = peers
        self.pool = pool
        self.outbox = outbox
        self._quarantined = quarantined
        self.published: dict[int, Published] = {}  # the newest overlay.keep_versions
        self.broadcasts: dict[tuple[int, int | None], Broadcast] = {}
        self.propagation: dict[int, Propagation] = {}
        self.hub_send_bps: float | None = None  # EWMA over the versions spread, bits/s
        self.catchups = CatchUps(outbox, overlay.catch_up_versions,
                                 max_building=overlay.catch_up_builds)
        # Gossip: (version, base) -> peer id -> its seed chunks, and the plan revision sent last.
        self.seeds: dict[tuple[int, int | None], tuple[dict[str, list[int]], int]] = {}
        # Who may be dealt chunks, and whether they fetch them (`echo2p2p.seed_watch`).
        self.seeding = Seeding(outbox)

    @property
    def newest(self) -> Published | None:
        return self.published[max(self.published)] if self.published else None

    @property
    def newest_version(self) -> int | None:
        return max(self.published) if self.published else None

    def publish(self, version: Published, now: float) -> None:
        """Make `version` the newest and announce it to every peer, with a relay plan."""
        for old in list(self.propagation.values()):
            self.report_propagation(old, final=True)  # superseded: say how far it got
        self.seeding.superseded(version.version, now)
        self.published[version.version] = version
        for old in sorted(self.published)[:-self.overlay.keep_versions]:
            del self.published[old]
        self.broadcasts = {k: b for k, b in self.broadcasts.items() if k[0] in self.published}
        conns = [c for c in self.peers.values() if c.protocol.ready
                 and (self.overlay.standby == "warm" or self.pool.is_active(c.peer_id))]
        delta = version.delta
        on_delta = [c for c in conns
                    if delta is not None and c.stream_version == delta.manifest.base_version]
        in_full = [c for c in conns if c not in on_delta]
        # A peer announced a version before that holds none whole yet is not waited for: an
        # idle connection would leave every record incomplete (and T_bcast unmeasured).
        fetching = {c.peer_id for c in conns if c.stream_version is not None or c.announced < 0}
        self.propagation[version.version] = Propagation(
            version.version, now, fetching, on_delta=len(on_delta),
            predicted_bcast_s=self.predicted_bcast_s(version, conns, len(on_delta)),
            idle=len(conns) - len(fetching))
        for snap, members in ((delta, on_delta), (version.full, in_full)):
            if not members:
                continue
            if self.overlay.relay == "gossip":
                self.announce_gossip(snap, members, now)
                continue
            broadcast = self._broadcast(snap)
            broadcast.start([self.member(c, now) for c in members])
            self._watch(snap, broadcast.shares(), now)
            self.propagation[version.version].dealt.update(broadcast.dealt())
            for conn in members:
                conn.protocol.announce(version.version)
                conn.post(m.VersionAnnouncement(snap.manifest, broadcast.plan(conn.peer_id),
                                                snap.signature))

    def announce_gossip(self, snap: Snapshot, conns: list[Peer], now: float,
                        late: bool = False) -> None:
        """Gossip: one announcement per peer with its seed chunks and a neighbour sample, and
        nothing after it but re-dealt seeds. Quarantined peers seed nothing, nor do leaves and
        benched peers (`relay.gossip_plan`), and every share is watched (`Seeding`); a `late`
        joiner dials a sample of every peer here, and fetches nothing from the hub if another
        peer here holds the (full) version whole, else everything (nobody else may have it)."""
        manifest = snap.manifest
        seeders = [c for c in conns if not late and not self._quarantined(c)]
        if late and (manifest.base_version is not None or not any(
                c.stream_version == manifest.version for c in self.peers.values())):
            seeders = conns
        deals = gossip_plan([self.member(c, now) for c in seeders], len(snap.chunks),
                            hub_bps=self.hub_bps_estimate())
        if not late:
            if (prop := self.propagation.get(manifest.version)) is not None:
                prop.dealt.update({pid: len(d.seed) for pid, d in deals.items()})
            self.seeds[(manifest.version, manifest.base_version)] = (
                {pid: list(d.seed) for pid, d in deals.items()}, 1)
            self.seeds = {k: v for k, v in self.seeds.items() if k[0] in self.published}
            self._watch(snap, {pid: d.seed for pid, d in deals.items()}, now)
        everyone = [self.member(c, now) for c in (self.peers.values() if late else conns)]
        for conn in conns:
            deal = deals.get(conn.peer_id)
            seed = deal.from_hub if deal is not None else []
            gossip = m.GossipPlan(manifest.version, manifest.base_version,
                                  m.pack_ids(seed),
                                  deal.neighbours if deal is not None
                                  else neighbour_sample(everyone, conn.peer_id))
            conn.protocol.announce(manifest.version)
            conn.post(m.VersionAnnouncement(manifest, m.RelayPlan(
                manifest.version, manifest.base_version, 1, [], b"", gossip), snap.signature))

    def predicted_bcast_s(self, version: Published, conns: list[Peer], on_delta: int
                          ) -> float | None:
        """The capacity model's T_bcast of `version` to `conns` (`echo2p2p.capacity.broadcast_s`)
        from the hub's measured send rate and the peers' measured uploads (one not measured yet
        counts as their mean); None while either is unknown."""
        uploads = [c.upload_bps for c in conns if c.upload_bps]
        if not uploads or not self.hub_send_bps:
            return None
        mean = sum(uploads) / len(uploads)
        delta_bytes = version.delta.wire_bytes if version.delta else 0
        nbytes = (on_delta * delta_bytes + (len(conns) - on_delta) * version.full.wire_bytes
                  ) / len(conns)  # what the average peer fetches
        return round(broadcast_s(nbytes, self.hub_send_bps, [c.upload_bps or mean for c in conns],
                                 self.overlay.relay), 3)

    def catch_up(self, conn: Peer, now: float) -> None:
        """A late joiner, a peer back from a disconnect or a cold standby peer put to work pulls
        the newest version: as one delta from a version it holds whole, when the hub keeps that
        one's stream and the delta is smaller (`hub.core.catchups`), else in full."""
        newest = self.newest
        if newest is None or not conn.protocol.needs(newest.version):
            return
        conn.protocol.announce(newest.version)
        base = self.catchups.base_for(newest, conn.stream_version, conn.hello.peer_key)
        if base is None:
            self._announce(conn, newest.full, now)
            return
        ready, delta = self.catchups.delta(newest, base, (conn, newest))
        if ready:
            self._caught_up(conn, newest, delta, now)

    def delta_built(self, key: tuple[int, int], delta: Snapshot | None, now: float) -> None:
        """The shell's `BuildDelta` of `key` (base, target) came back (None: send in full):
        the peers waiting for it are announced it."""
        for conn, target in self.catchups.built(key, delta):
            self._caught_up(conn, target, delta, now)

    def _caught_up(self, conn: Peer, target: Published, delta: Snapshot | None,
                   now: float) -> None:
        """`conn`'s catch-up delta to `target` is ready (None: send it in full). The delta goes
        first, then the version in full, pull-only: a peer that holds the delta's base fetches
        the delta and ignores the second; one that lacks it (a wrong claim) takes the second."""
        if self.newest is not target or self.peers.get(conn.peer_id) is not conn:
            return  # a newer version was announced to it meanwhile, or it left
        if delta is not None:
            self._announce(conn, delta, now)
        self._announce(conn, target.full, now, relays=delta is None)

    def _announce(self, conn: Peer, snap: Snapshot, now: float, relays: bool = True) -> None:
        """`snap` to one peer joining its broadcast (as a relay, if it may and `relays`)."""
        if self.overlay.relay == "gossip":
            self.announce_gossip(snap, [conn], now, late=True)
            return
        member = conn.member(relays=relays and not self._quarantined(conn))
        broadcast = self._broadcast(snap)
        if broadcast.members:
            broadcast.join(member)
        else:
            broadcast.start([member])
            self._watch(snap, broadcast.shares(), now)
        conn.post(m.VersionAnnouncement(snap.manifest, broadcast.plan(conn.peer_id),
                                        snap.signature))

    def _broadcast(self, snap: Snapshot) -> Broadcast:
        key = (snap.manifest.version, snap.manifest.base_version)
        if key not in self.broadcasts:
            self.broadcasts[key] = Broadcast(*key, len(snap.chunks), self.overlay.relay,
                                             hub_bps=self.hub_bps_estimate())
        return self.broadcasts[key]

    def hub_bps_estimate(self) -> float | None:
        """The hub's send rate, bits/s, that caps a slow peer's share (`relay.deal_seeds`): as
        measured over the versions spread, else the configured upload cap, else (the first
        version) the median of the peers' uplinks the hub probed at join; None: unknown."""
        if self.hub_send_bps:
            return self.hub_send_bps
        if self.overlay.upload_limit_mbps:
            return self.overlay.upload_limit_mbps * 1e6
        rates = sorted(c.upload_bps for c in self.peers.values() if c.upload_bps)
        return rates[len(rates) // 2] if rates else None

    def member(self, conn: Peer, now: float) -> Member:
        """`conn` in a broadcast: a relay if it may be one, with the share the watch allows."""
        return conn.member(relays=not self._quarantined(conn),
                           max_share=self.seeding.cap(conn, now))

    def _watch(self, snap: Snapshot, shares: dict[str, list[int]], now: float) -> None:
        """`shares` of `snap` were first dealt: the watch expects each peer to fetch its own."""
        chunk_bytes = max((c.wire_bytes for c in snap.manifest.chunks), default=0)
        key = (snap.manifest.version, snap.manifest.base_version)
        self.seeding.dealt(key, shares, self.peers, chunk_bytes, self.hub_bps_estimate(), now)

    # --- re-dealing ------------------------------------------------------------------

    def route_around(self, peer_id: str, now: float) -> None:
        """Deal `peer_id`'s chunks, in every broadcast, to other relays and tell the members;
        in gossip, its seed chunks to the other seeders (`reseed`)."""
        self.reseed(peer_id, now)
        for key, broadcast in list(self.broadcasts.items()):
            self._drop(key, broadcast, peer_id)

    def _drop(self, key: Key, broadcast: Broadcast, peer_id: str) -> None:
        """`peer_id` relays nothing more in `broadcast`: the members get the new plan. (The
        new owners' added chunks are not watched: one may hold them already, from `peer_id`.)"""
        if broadcast.drop(peer_id) is None:
            return
        log.debug("routed v%d around %s", key[0], peer_id)
        for member in broadcast.members:
            if (conn := self.peers.get(member)) is not None:
                conn.post(broadcast.plan(member))

    def reseed(self, peer_id: str, now: float) -> None:
        """Gossip: `peer_id` (left, quarantined or failed the hub's check) may not have passed
        its seed chunks on; deal them again (`_reseed`)."""
        for key, (deals, _) in list(self.seeds.items()):
            self._reseed(key, peer_id, deals.pop(peer_id, []), now)

    def _reseed(self, key: Key, peer_id: str, orphans: list[int], now: float) -> None:
        """Gossip: deal `orphans`, seeds of `peer_id`, among the other seeders of manifest `key`
        still here, one plan revision each, carrying only the added seeds. A receiver fetches
        one from the hub only if none of its links holds it (`echo2p2p.gossip.Swarm`), so a
        seed already spread costs nothing (and for that reason the heirs' added seeds are not
        watched: asking nothing for them says nothing). With no seeder left, every member takes
        them all, as it takes the chunks nobody seeds (`relay.gossip_plan`)."""
        deals, revision = self.seeds[key]
        version, base = key
        members = [self.member(c, now) for pid in deals
                   if pid != peer_id and (c := self.peers.get(pid)) is not None]
        if not orphans or not members or version not in self.propagation:
            return
        heirs = [mb for mb in members if mb.seeds]
        added = (deal_seeds(heirs, orphans) if heirs
                 else {mb.peer_id: list(orphans) for mb in members})
        self.seeds[key] = (deals, revision + 1)
        log.debug("routed v%d around %s", version, peer_id)
        for pid, seeds in added.items():
            if seeds:
                gossip = m.GossipPlan(version, base, m.pack_ids(seeds), [])
                self.peers[pid].post(m.RelayPlan(version, base, revision + 1, [], b"", gossip))
        if heirs:
            for pid, seeds in added.items():
                deals[pid] += seeds

    def tick(self, now: float) -> None:
        """The core's tick (asked for by `WakeAt`): each peer silent by `now` is recorded and
        its share dealt to others (`_silent`)."""
        for silence in self.seeding.due(now):
            self.seeding.silent(silence)
            self._silent(silence, now)
        self.seeding.rearm()

    def _silent(self, silence: Silence, now: float) -> None:
        """The watch heard nothing of a dealt peer for its grace: its chunks not fetched go
        to others now (gossip: `_reseed`; a tracker's broadcast routes around it)."""
        key, peer_id = silence.key, silence.peer_id
        if key in self.seeds:
            deals = self.seeds[key][0]
            deals[peer_id] = [i for i in deals.get(peer_id, []) if i not in silence.chunks]
            self._reseed(key, peer_id, list(silence.chunks), now)
        elif (broadcast := self.broadcasts.get(key)) is not None:
            self._drop(key, broadcast, peer_id)

    def peer_left(self, peer_id: str, now: float) -> None:
        """`peer_id` left (already out of `peers`): re-deal its chunks, and report the versions
        that have now reached every peer still here."""
        self.route_around(peer_id, now)
        self.seeding.left(peer_id, now)
        for prop in list(self.propagation.values()):
            self.report_propagation(prop)

    # --- chunks and transfers --------------------------------------------------------

    def snapshot(self, version: int | None = None, base: int | None = None) -> Snapshot | None:
        """The published manifest (version, base) this hub still keeps (version None: the
        newest), or the catch-up delta (base -> version) it has cached, if any."""
        if version is None and (version := self.newest_version) is None:
            return None
        pub = self.published.get(version)
        snap = pub and (pub.full if base is None else pub.delta)
        if snap is not None and snap.manifest.base_version == base:
            return snap
        return self.catchups.snapshot(version, base) if base is not None else None

    def chunk_served(self, version: int, nbytes: int, now: float) -> None:
        """The hub's chunk route sent `nbytes` of `version` at `now`."""
        if (prop := self.propagation.get(version)) is not None:
            prop.bytes_from_hub += nbytes
            prop.hub_sent_after_s = now - prop.started

    def transfer_reported(self, conn: Peer, msg: m.TransferReport, now: float) -> None:
        """`conn` has every chunk of a manifest: a base for its next delta, and progress."""
        snap = self.snapshot(msg.version, msg.base_version)
        if snap is None:
            return
        conn.protocol.note_whole(msg.version)
        self.seeding.whole(conn, (msg.version, msg.base_version), now)
        self.catchups.remember(conn.hello.peer_key, msg.version)  # for its next connection
        prop = self.propagation.get(msg.version)
        if prop is None or conn.peer_id not in prop.expected or conn.peer_id in prop.done_after_s:
            return  # not a version being tracked, or not the first report: nothing to count
        prop.done_after_s[conn.peer_id] = now - prop.started
        prop.count(conn.peer_id, msg, snap.wire_bytes)
        self.report_propagation(prop)

    def holding_reported(self, conn: Peer, version: int, now: float) -> None:
        """`conn`'s engine now serves `version`: it can generate with it and every older one
        still being tracked (T_bcast counts the reload). Believed only for versions whose
        transfer it reported (a claim alone would make T_bcast look short)."""
        whole = conn.protocol.stream_version
        for prop in list(self.propagation.values()):
            if (prop.version <= version and whole is not None and prop.version <= whole
                    and conn.peer_id in prop.expected and conn.peer_id not in prop.serving_after_s):
                prop.serving_after_s[conn.peer_id] = now - prop.started
                self.report_propagation(prop)

    def report_propagation(self, prop: Propagation, final: bool = False) -> None:
        """Log how `prop`'s version spread, once every expected peer that is still here has it
        and serves it (or, `final`, once a newer version supersedes it)."""
        waiting = {p for p in prop.expected - prop.done_after_s.keys() if p in self.peers}
        reloading = {p for p in prop.expected - prop.serving_after_s.keys() if p in self.peers}
        if (waiting or reloading) and not final:
            return
        del self.propagation[prop.version]
        if not prop.expected:
            return  # published before any peer joined: nothing spread
        for peer_id, rate in prop.upload_rates().items():
            if (conn := self.peers.get(peer_id)) is not None:
                conn.upload_bps = rate if not conn.upload_bps else 0.5 * (conn.upload_bps + rate)
        if (rate := prop.hub_send_bps()) is not None:
            self.hub_send_bps = rate if not self.hub_send_bps else 0.5 * (self.hub_send_bps + rate)
        # Complete: every expected peer still here has it, and one at least did (when all
        # left before finishing, there is no spread to time).
        pub = self.published.get(prop.version)
        record = prop.record(pub.full.wire_bytes if pub else 0,
                             pub.delta.wire_bytes if pub and pub.delta else None,
                             complete=not waiting and bool(prop.done_after_s))
        record["peer_upload_mbps"] = {c.peer_id: round(c.upload_bps / 1e6, 2)
                                      for c in self.peers.values() if c.upload_bps}
        self.outbox.emit(Record(record))
