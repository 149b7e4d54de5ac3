"""The emulated peers of bench/gossip_sweep.py, each running a REAL pure core in the
`bench.emulation` world through the calls its shell makes: `TrackerPeer` one
`echo2p2p.failover.Failover` (`requests`, `finished`, `plan`, as `overlay.download.Download`),
`GossipPeer` one `echo2p2p.gossip.Swarm` (`requests`, `got`, `failed`, `wake_at`, as
`overlay.gossip_download.GossipDownload`). Only the transport is emulated. `run_tracker`,
`run_chain` and `run_gossip` broadcast one version to a `Setup`'s peers, the hub's side the
real `echo2p2p.relay` plans. The striped chain's peer is the tracker's: the real peer fetches it
with the same `Download` (`peer.fetcher`), by its own plan (its stripes from the hub, the rest
from its parent in the ring, `RelayPlan.window` requests in flight to each).
"""

from __future__ import annotations

import random
import struct
from collections import Counter
from collections.abc import Callable

from echo2p2p import messages as m
from echo2p2p.failover import HUB, Failover
from echo2p2p.gossip import Swarm
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S
from echo2p2p.pace import per_request_bps, too_slow
from echo2p2p.relay import MAX_WINDOW, Broadcast, Member, gossip_plan

from bench.emulation import (HAD_FLUSH_S, WINDOW, Result, Setup, Uplink, World,
                             frame_bytes, gossip_announcement)


class TrackerPeer:
    """A peer as `overlay.download.Download` drives `Failover`; its chunk server long-polls.
    With `Setup.stall_s`, Download's own rules too: a long poll answers 503 after stall_s / 2
    and is asked again, a chunk not in stall_s after the first ask is a "stall", and one that
    came far slower than the plan's rate for its source (`pace.too_slow`) is kept but "slow";
    either is reported (RelayReport) and the source avoided (its chunks from the hub)."""

    def __init__(self, world: World, member: Member):
        self.w, self.id = world, member.peer_id
        self.up = Uplink(world.sim, world.rates[self.id])
        self.held: set[int] = set()
        self.waiting: dict[int, list] = {}  # chunk -> requesters long-polling for it
        self.got_from: Counter = Counter()
        self.done_at: float | None = None
        self.failover: Failover | None = None
        self.window, self.rates = WINDOW, {}  # as Download.set_plan: the plan's window and rates
        self.asked_at: dict[int, float] = {}  # chunk -> when first asked of its source
        self.sent_at: dict[int, float] = {}  # chunk -> when this poll of it went out
        self.sending: dict[int, tuple[TrackerPeer, int]] = {}  # upload job -> (to, chunk)
        self.gone = self.ticking = False

    def announced(self, plan: m.RelayPlan) -> None:
        self.failover = Failover(self.w.setup.n_chunks, self.id)
        self.replan(plan)

    def replan(self, plan: m.RelayPlan) -> None:
        if not self.gone:
            self.failover.plan(plan, {s.peer_id for s in plan.sources} | {HUB})
            self.rates.update({s.peer_id: s.rate_bps for s in plan.sources})
            self.window = min(plan.window, MAX_WINDOW) if plan.window > 0 else self.window
            self.pump()

    def pump(self) -> None:
        now = self.w.sim.now
        for i, source in self.failover.requests(now, self.window):
            self.asked_at[i] = self.sent_at[i] = now
            self._ask(i, source)
        if self.failover.waiting(now) and not self.ticking:  # as Download.run wakes every 1 s
            self.ticking = True
            self.w.sim.at(self.w.sim.now + 1.0, self._tick)

    def _ask(self, i: int, source: str) -> None:
        if source == HUB:
            self.w.hub_want(self, i)
        else:
            self.w.sim.at(self.w.sim.now + self.w.lat(self.id, source) + self.w.queued_s(self),
                          self.w.peers[source].request, self, i)

    def _tick(self) -> None:
        self.ticking = False
        if not self.gone:
            self.pump()

    def leave(self) -> None:
        self.gone = True
        lost = list(self.sending.values()) + [(r, i) for i, rs in self.waiting.items() for r in rs]
        for requester, index in lost:
            self.w.sim.at(self.w.sim.now + self.w.lat(self.id, requester.id), requester.failed,
                          self.id, index)
        self.up.fail_all()
        self.sending.clear()
        self.waiting.clear()

    def request(self, requester: TrackerPeer, index: int) -> None:
        back = self.w.lat(self.id, requester.id)
        if self.gone:  # connection refused, one latency later
            self.w.sim.at(self.w.sim.now + back, requester.failed, self.id, index)
        elif index in self.held:
            self._send(requester, index)
        else:
            self.waiting.setdefault(index, []).append(requester)
            if self.w.setup.stall_s is not None:  # the long poll ends with a 503
                self.w.sim.at(self.w.sim.now + self.w.setup.stall_s / 2, self._poll_over,
                              requester, index)

    def _poll_over(self, requester: TrackerPeer, index: int) -> None:
        if not self.gone and requester in self.waiting.get(index, ()):
            self.waiting[index].remove(requester)
            self.w.sim.at(self.w.sim.now + self.w.lat(self.id, requester.id), requester.pending,
                          self.id, index)

    def pending(self, source: str, index: int) -> None:
        """A 503: ask again, or past stall_s since the first ask, a "stall"."""
        if self.gone or self.failover.asked(index) != source:
            return
        if self.w.sim.now - self.asked_at[index] > self.w.setup.stall_s:
            self._fault(source, index, "stall")
        else:
            self.sent_at[index] = self.w.sim.now
            self._ask(index, source)

    def _send(self, requester: TrackerPeer, index: int) -> None:
        back = self.w.lat(self.id, requester.id)

        def done() -> None:
            del self.sending[job]
            self.w.sim.at(self.w.sim.now + back, requester.piece, self.id, index)
        job = self.up.send(self.w.setup.chunk_bytes, done)
        self.sending[job] = (requester, index)

    def piece(self, source: str, index: int) -> None:
        if not self.gone:
            self.w.sim.at(self.w.sim.now + self.w.setup.verify_s, self._verified, source, index)

    def _verified(self, source: str, index: int) -> None:
        if self.gone or self.failover.asked(index) != source:
            return  # a request that had failed already: Download dropped it
        self.held.add(index)
        self._fault(source, index, "slow" if self._too_slow(source, index) else None)
        self.got_from[source] += 1
        for requester in self.waiting.pop(index, []):
            self._send(requester, index)
        if self.failover.complete and self.done_at is None:
            self.w.reported(self)

    def _too_slow(self, source: str, index: int) -> bool:
        """Download._fetch's rule, its long poll allowed for."""
        stall_s = self.w.setup.stall_s
        if stall_s is None or source == HUB:
            return False
        rate_bps = max(per_request_bps(self.rates.get(source, 0.0), self.window),
                       8 * MIN_RATE_BYTES_S)
        return too_slow(self.w.setup.chunk_bytes, self.w.sim.now - self.sent_at[index], rate_bps,
                        stall_s / 2)

    def failed(self, source: str, index: int) -> None:
        """A request failed (the source left, or the hub's route is gone): Download's path."""
        if not self.gone and self.failover.asked(index) == source:
            self._fault(source, index, "unreachable")

    def _fault(self, source: str, index: int, fault: str | None) -> None:
        if self.failover.finished(index, source, fault, self.w.sim.now):  # RelayReport
            self.w.res.extra.setdefault("reports", Counter())[fault] += 1
            self.w.control(len(m.encode(m.RelayReport(1, source, fault, index))))
        self.pump()


def run_tracker(setup: Setup, strategy: str = "pipelined") -> Result:
    """The tracker ("pipelined") or the ECHO-2 paper's striped chain ("striped-chain"): the
    hub's real `Broadcast`, each member announced its own plan (the chain's differ)."""
    w = World(setup, "tracker" if strategy == "pipelined" else "chain")
    w.peers = {mb.peer_id: TrackerPeer(w, mb) for mb in w.members}
    w.broadcast = Broadcast(1, None, setup.n_chunks, strategy, hub_bps=setup.hub_bps_known)
    w.broadcast.start(w.members)
    for peer in w.peers.values():
        plan = w.broadcast.plan(peer.id)
        encoded = m.encode(m.VersionAnnouncement(w.man, plan, bytes(64)))
        w.announce(peer, encoded, len(m.encode(plan)), plan)
    res = w.finish()
    res.extra["ring"] = len(w.broadcast.ring())
    return res


def run_chain(setup: Setup) -> Result:
    return run_tracker(setup, "striped-chain")


class GossipPeer:
    """A peer running `Swarm` over its links, as the gossip shell does."""

    def __init__(self, world: World, member: Member):
        self.w, self.id = world, member.peer_id
        self.up = Uplink(world.sim, world.rates[self.id])
        self.swarm: Swarm | None = None
        self.linked: list[str] = []
        self.early: dict[str, set[int]] = {}  # what links said before our announcement came
        self.jobs: dict[tuple[str, int], int] = {}  # (requester, chunk) -> upload job
        self.had: list[int] = []
        self.fifo: dict[str, float] = {}  # link -> when its last frame arrives
        self.last_flush, self.flush_at, self.wake = -1.0, None, None
        self.got_from: Counter = Counter()
        self.done_at: float | None = None
        self.gone = False

    def leave(self) -> None:
        """SIGKILLed: every link sees its connection close one latency later."""
        self.gone = True
        for peer in self.linked:
            self.w.sim.at(self.w.sim.now + self.w.lat(self.id, peer), self.w.peers[peer].lost, self.id)
        self.up.fail_all()
        self.jobs.clear()

    def more_seed(self, seed: list[int]) -> None:
        if self.swarm is not None and not self.gone:
            self.swarm.add_seed(seed)
            self.pump()

    def lost(self, peer: str) -> None:
        self.linked.remove(peer)
        if self.swarm is not None and not self.gone:
            self.swarm.link_down(peer)
            self.pump()

    def send(self, to: str, tag: str, fn: Callable, *args, **record) -> None:
        """A control frame over the link to `to`: counted, delivered one latency later."""
        self.w.res.p2p_msgs += 1
        self.w.res.p2p_bytes += frame_bytes(tag, **record)
        at = max(self.w.sim.now + self.w.lat(self.id, to) + self.w.queued_s(self),
                 self.fifo.get(to, 0.0))  # a link is one ordered stream
        self.fifo[to] = at
        self.w.sim.at(at, fn, *args)

    def announced(self, seed: list[int], neighbours: list[m.RelaySource]) -> None:
        self.swarm = Swarm(self.w.setup.n_chunks, self.id, seed)
        for peer in self.linked:
            self._open(peer)
        for nb in neighbours:
            self.w.dial(self.id, nb.peer_id)
        self.pump()

    def link_up(self, peer: str) -> None:
        if self.gone or self.w.peers[peer].gone:
            return
        self.linked.append(peer)
        if self.swarm is not None:
            self._open(peer)
            self.pump()

    def _open(self, peer: str) -> None:
        self.swarm.link_up(peer, reachable=peer not in self.w.natted)
        if peer in self.early:
            self.swarm.heard_had(peer, self.early.pop(peer))
        held = sorted(set(range(self.w.setup.n_chunks)) - self.swarm.missing)
        self.send(peer, "have", self.w.peers[peer].heard, self.id, held, bits=self.swarm.bitfield())

    def heard(self, peer: str, indices: list[int]) -> None:
        if self.gone or peer not in self.linked:
            return
        if self.swarm is None or peer not in self.swarm.links:
            self.early.setdefault(peer, set()).update(indices)
            return
        self.swarm.heard_had(peer, indices)
        self.pump()

    def pump(self) -> None:
        if self.gone:
            return
        now = self.w.sim.now
        for i, source in self.swarm.requests(now):
            if source == HUB:
                self.w.hub_want(self, i)
            else:
                self.send(source, "want", self.w.peers[source].wanted, self.id, i, index=i)
        wake = self.swarm.wake_at(now)
        if wake is not None and (self.wake is None or wake < self.wake):
            self.wake = wake
            self.w.sim.at(wake, self._woke, wake)

    def _woke(self, at: float) -> None:
        if self.wake == at:
            self.wake = None
            self.pump()

    def wanted(self, requester: str, index: int) -> None:
        if self.gone or requester not in self.linked:
            return  # the link is down; the requester learns it from the close
        why = self.swarm.wanted(requester, index)
        if why is not None:
            raise AssertionError(f"{self.id} refused {requester}'s want of {index}: {why}")
        back = self.w.lat(self.id, requester)

        def done() -> None:
            del self.jobs[(requester, index)]
            self.swarm.served(requester, index)
            self.w.sim.at(self.w.sim.now + back, self.w.peers[requester].piece, self.id, index)
        self.jobs[(requester, index)] = self.up.send(self.w.setup.chunk_bytes, done,
                                                     lambda: self.swarm.serve_rank(requester, index))

    def cancelled(self, requester: str, index: int) -> None:
        if self.gone:
            return
        job = self.jobs.pop((requester, index), None)
        if job is not None:
            self.up.cancel(job)
        self.swarm.served(requester, index)

    def piece(self, source: str, index: int) -> None:
        if self.gone:
            return
        if source not in self.swarm.wants(index):
            self.w.res.wasted_pieces += 1  # an endgame loser that was already on its way
            return
        self.w.sim.at(self.w.sim.now + self.w.setup.verify_s, self._verified, source, index)

    def _verified(self, source: str, index: int) -> None:
        if self.gone or source not in self.swarm.wants(index):
            self.w.res.wasted_pieces += 1
            return
        self.got_from[source] += 1
        for loser in self.swarm.got(index, source, self.w.sim.now):
            if loser != HUB:
                self.send(loser, "cancel", self.w.peers[loser].cancelled, self.id, index, index=index)
        self.had.append(index)
        self._flush_later()
        if self.swarm.complete and self.done_at is None:
            self.w.reported(self)
        self.pump()

    def _flush_later(self) -> None:
        now = self.w.sim.now
        if now - self.last_flush >= HAD_FLUSH_S or len(self.had) >= 64:
            self._flush()
        elif self.flush_at is None:
            self.flush_at = self.last_flush + HAD_FLUSH_S
            self.w.sim.at(self.flush_at, self._flush)

    def _flush(self) -> None:
        self.flush_at, self.last_flush = None, self.w.sim.now
        if not self.had or self.gone:
            return
        packed = struct.pack(f"<{len(self.had)}I", *self.had)
        for peer in self.swarm.links:
            self.send(peer, "had", self.w.peers[peer].heard, self.id, list(self.had), indices=packed)
        self.had = []

    def failed(self, source: str, index: int) -> None:
        if not self.gone:
            self.swarm.failed(index, source, self.w.sim.now)
            self.pump()


def run_gossip(setup: Setup) -> Result:
    w = World(setup, "gossip")
    w.peers = {mb.peer_id: GossipPeer(w, mb) for mb in w.members}
    links: set[frozenset] = set()

    def dial(a: str, b: str) -> None:  # one link per pair, whoever dials first
        pair = frozenset((a, b))
        if a != b and pair not in links:
            links.add(pair)
            w.sim.at(w.sim.now + 2 * w.lat(a, b), establish, a, b)

    def establish(a: str, b: str) -> None:
        if w.peers[a].gone or w.peers[b].gone:
            return
        w.peers[a].link_up(b)
        w.peers[b].link_up(a)
    w.dial = dial
    deals = w.deals = gossip_plan(w.members, setup.n_chunks, rng=random.Random(setup.seed + 2),
                                  hub_bps=setup.hub_bps_known)
    for peer in w.peers.values():
        deal = deals[peer.id]
        encoded, plan_bytes = gossip_announcement(w.man, deal.from_hub, deal.neighbours)
        w.announce(peer, encoded, plan_bytes, deal.from_hub, deal.neighbours)
    res = w.finish()
    res.extra["links"] = len(links)
    return res
