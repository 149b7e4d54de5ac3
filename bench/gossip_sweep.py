"""Tracker against gossip at 8..256 emulated peers: hub control messages and bytes per version,
hub upload in copies, and time / (M/B). One process, a discrete-event emulation that runs the
REAL pure cores: for the tracker `echo2p2p.relay.Broadcast` (the hub's plan) and one
`echo2p2p.failover.Failover` per peer (its routing, as `overlay.download.Download` drives it);
for gossip `echo2p2p.relay.gossip_plan` (the hub's dealing) and one `echo2p2p.gossip.Swarm` per
peer.

The model, and where it is generous or strict:
- every uplink (the hub's and each peer's) is a loss-free token bucket shared by the transfers
  it sends at once, at most UPLOAD_SLOTS (2) of them, as the chunk servers do
  (`overlay.serving`); the rest wait FIFO (hub, tracker) or by `Swarm.serve_rank` (gossip
  peers); downlinks are not limits;
- one-way latency per pair of hosts drawn uniformly in 10-100 ms; a chunk arrives one latency
  after its last byte left; a piece is usable (forwarded, announced) only once fully arrived
  and verified (VERIFY_S per chunk);
- a NAT'd peer accepts no connection: in the tracker it is a leaf (owns nothing, only pulls);
  in gossip it dials its neighbours and uploads over those links;
- the tracker's requests never time out here (the real one reports a stall after ~30 s, which
  only makes it slower where owners are swamped); gossip peers send `had` at most every 50 ms;
- control messages are the real messages, encoded by `echo2p2p.messages` (or, for peer links,
  msgpack frames of the fields `docs/protocol/` names): hub -> peer announcement with its
  plan (tracker: RelayPlan; gossip: GossipPlan, or its RelayPlan-shaped stand-in if the
  message is not there yet), peer -> hub TransferReport and VersionHeld, and under faults the
  tracker's plan revisions (one to every member per departed owner) and RelayReports, and
  gossip's re-dealt seeds (one message to each receiver);
- faults, at 30 % of the strategy's own uniform time: "churn", 1/8 of the peers leave at once
  (their transfers stop; the tracker's hub re-deals their chunks to every member, gossip's hub
  re-deals only the seeds it had not sent them yet); "cut_churn", the same with the hub's
  control connection cut (no revisions, no reports; the chunk route still answers);
  "hub_cut_30pct" (gossip), the control connection cut and the chunk route gone once every
  chunk has left the hub once. Times count the peers that stayed.

    python bench/gossip_sweep.py [--quick]   (--quick: N up to 64; about 3 minutes of CPU in all)
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import struct
import sys
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, when run as a file

from echo2p2p import frames  # noqa: E402
from echo2p2p import messages as m  # noqa: E402
from echo2p2p.failover import HUB, Failover  # noqa: E402
from echo2p2p.gossip import Swarm, pack_bits  # noqa: E402
from echo2p2p.relay import Broadcast, GossipDeal, Member, deal_seeds, gossip_plan  # noqa: E402

UPLOAD_SLOTS = 2
VERIFY_S = 0.010  # blake2b of a 4 MiB chunk plus the store's write
HAD_FLUSH_S = 0.050
WINDOW = 2


@dataclass(frozen=True)
class Setup:
    n_peers: int
    n_chunks: int = 54  # a 113 M-parameter bf16 model (226 MB) in 4 MiB chunks
    chunk_bytes: int = 4 << 20
    peer_bps: float = 100e6  # B
    hub_bps: float = 100e6  # B_hub
    slow_fraction: float = 0.0  # this share of the peers uploads at B/4
    nat_fraction: float = 0.0  # this share accepts no inbound connection
    cut_at_s: float | None = None  # the hub's control connection is cut then
    route_goes: bool = False  # and its chunk route too, once every chunk has left it once
    leave_at_s: float | None = None  # then `leave_fraction` of the peers leave (SIGKILL)
    leave_fraction: float = 0.125
    seed: int = 0

    @property
    def m_over_b_s(self) -> float:
        return self.n_chunks * self.chunk_bytes * 8 / self.peer_bps


@dataclass
class Result:
    strategy: str
    n_peers: int
    complete: bool = False
    time_s: float = 0.0
    hub_msgs: int = 0  # control messages the hub sent and received
    hub_bytes: int = 0
    hub_plan_bytes: int = 0  # of those, the routing plans alone
    hub_chunk_requests: int = 0  # chunk GETs / wants the hub answered (data plane)
    hub_copies: float = 0.0  # hub upload / one version
    p2p_msgs: int = 0  # peer <-> peer control (want, have, had, cancel): not the hub's
    p2p_bytes: int = 0
    wasted_pieces: int = 0  # endgame duplicates that arrived after the chunk was in
    extra: dict = field(default_factory=dict)


# --- the clock and the links -------------------------------------------------------------


class Sim:
    def __init__(self) -> None:
        self.now = 0.0
        self._q: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._q, (t, next(self._seq), fn, args))

    def run(self, until: float) -> None:
        while self._q and self._q[0][0] <= until:
            self.now, _, fn, args = heapq.heappop(self._q)
            fn(*args)


class Uplink:
    """A token bucket shared by at most `slots` transfers at once; the rest wait FIFO."""

    def __init__(self, sim: Sim, rate_bps: float, slots: int = UPLOAD_SLOTS):
        self.sim, self.rate, self.slots = sim, rate_bps / 8, slots
        self.active: dict[int, list] = {}  # job id -> [remaining bytes, done callback]
        self.queue: deque = deque()
        self.sent, self.busy_s = 0, 0.0
        self._last, self._epoch, self._ids = 0.0, 0, itertools.count()

    def send(self, nbytes: int, done: Callable[[], None], rank: Callable[[], float] | None = None
             ) -> int:
        """Queue a transfer; `rank`: when a slot frees, the queued one of lowest rank goes first
        (FIFO among equals, and for transfers without one)."""
        job = next(self._ids)
        self._advance()
        self.queue.append((job, nbytes, done, rank))
        self._fill()
        return job

    def cancel(self, job: int) -> None:
        self._advance()
        self.queue = deque(q for q in self.queue if q[0] != job)
        self.active.pop(job, None)
        self._fill()

    def fail_all(self) -> list[Callable[[], None]]:
        """Drop every transfer (the route went away); their callbacks, never called."""
        dropped = [d for _, d in self.active.values()] + [q[2] for q in self.queue]
        self.active.clear()
        self.queue.clear()
        return dropped

    def _advance(self) -> None:
        if self.active:
            self.busy_s += self.sim.now - self._last
            share = self.rate * (self.sim.now - self._last) / len(self.active)
            for job in self.active.values():
                job[0] -= share
        self._last = self.sim.now

    def _fill(self) -> None:
        while self.queue and len(self.active) < self.slots:
            k = min(range(len(self.queue)), key=lambda k: (self.queue[k][3] or float)())
            job, nbytes, done, _ = self.queue[k]
            del self.queue[k]
            self.active[job] = [nbytes, done]
            self.sent += nbytes
        self._epoch += 1
        if self.active:
            left = min(j[0] for j in self.active.values())
            self.sim.at(self.sim.now + max(left, 0) * len(self.active) / self.rate, self._done,
                        self._epoch)

    def _done(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        finished = [k for k, j in self.active.items() if j[0] <= 1e-3]
        callbacks = [self.active.pop(k)[1] for k in finished]
        self._fill()
        for cb in callbacks:
            cb()


class Latency:
    """One-way latency per pair of hosts, 10-100 ms, drawn once."""

    def __init__(self, seed: int):
        self.rng, self._d = random.Random(seed), {}

    def __call__(self, a: str, b: str) -> float:
        key = (a, b) if a < b else (b, a)
        if key not in self._d:
            self._d[key] = self.rng.uniform(0.010, 0.100)
        return self._d[key]


# --- the real messages, measured -----------------------------------------------------------


def manifest(n_chunks: int, chunk_bytes: int) -> m.Manifest:
    """A manifest shaped like the 113 M model's: ~150 tensors, one entry and digest per chunk."""
    tensors = [m.TensorEntry(f"model.layers.{k // 12}.block.param_{k % 12}.weight", "bfloat16",
                             [768, 768], k * 1179648, 1179648) for k in range(150)]
    chunks = [m.ChunkEntry(chunk_bytes, chunk_bytes - 1000 - i, bytes(32)) for i in range(n_chunks)]
    return m.Manifest(1, None, "zstd", "blake2b-256", chunk_bytes, n_chunks * chunk_bytes,
                      tensors, chunks, bytes(32))


def gossip_announcement(man: m.Manifest, seed: list[int], sources: list[m.RelaySource]
                        ) -> tuple[bytes, int]:
    """(the encoded announcement, its plan's bytes) with a GossipPlan, as the shell defines it."""
    packed = struct.pack(f"<{len(seed)}I", *seed)
    gossip_cls = getattr(m, "GossipPlan", None)
    plan = m.RelayPlan(1, None, 1, sources, packed)  # a stand-in of the same fields
    if gossip_cls is not None:
        gossip = gossip_cls(version=1, base_version=None, seed=packed, neighbours=sources)
        if "gossip" in {f.name for f in fields(m.RelayPlan)}:  # the shell's layout
            plan = m.RelayPlan(1, None, 1, [], b"", gossip=gossip)
    return m.encode(m.VersionAnnouncement(man, plan, bytes(64))), len(m.encode(plan))


def report_bytes(sources: Counter, chunk_bytes: int) -> int:
    """A TransferReport naming each peer source, and the VersionHeld after it."""
    rates = [m.SourceRate(s, n * chunk_bytes, 12.345) for s, n in sources.items() if s != HUB]
    report = m.TransferReport(1, None, 12.345, sources[HUB] * chunk_bytes,
                              sum(r.nbytes for r in rates), rates)
    return len(m.encode(report)) + len(m.encode(m.VersionHeld(1)))


def frame_bytes(tag: str, **record) -> int:
    return len(frames.encode_frame(tag, {"version": 1, "base": None, **record}))


def members_of(setup: Setup) -> tuple[list[Member], dict[str, float]]:
    rng = random.Random(setup.seed)
    ids = [f"p{i}" for i in range(setup.n_peers)]
    n_slow, n_nat = round(setup.slow_fraction * len(ids)), round(setup.nat_fraction * len(ids))
    slow = set(rng.sample(ids, n_slow))
    nat = set(rng.sample(ids, n_nat))
    rates = {p: setup.peer_bps / 4 if p in slow else setup.peer_bps for p in ids}
    return [Member(p, None if p in nat else f"http://10.0.{i // 250}.{i % 250 + 2}:7000",
                   rates[p]) for i, p in enumerate(ids)], rates


# --- the two strategies ------------------------------------------------------------------


class World:
    """The hosts of one run: the hub's uplink, the peers, the latencies, the counters."""

    def __init__(self, setup: Setup, strategy: str):
        self.setup, self.sim, self.lat = setup, Sim(), Latency(setup.seed + 1)
        self.hub_up = Uplink(self.sim, setup.hub_bps)
        self.members, self.rates = members_of(setup)
        self.natted = {mb.peer_id for mb in self.members if mb.url is None}
        self.man = manifest(setup.n_chunks, setup.chunk_bytes)
        self.res = Result(strategy, setup.n_peers)
        self.peers: dict = {}
        self.hub_jobs: dict[int, tuple] = {}  # job -> (peer, index): the hub's sends under way
        self.hub_served: set[int] = set()
        self.hub_delivered: set[tuple[str, int]] = set()  # (peer, chunk) the hub sent
        self.deals: dict[str, GossipDeal] = {}  # gossip's seeds
        self.route_off = self.control_cut = False
        self.broadcast: Broadcast | None = None  # the tracker's plan

    def hub_want(self, peer, index: int) -> None:
        """A chunk request reaches the hub one latency after `peer` sent it."""
        self.sim.at(self.sim.now + self.lat(peer.id, HUB), self._hub_serve, peer, index)

    def _hub_serve(self, peer, index: int) -> None:
        if peer.gone:
            return
        self.res.hub_chunk_requests += 1
        back = self.lat(peer.id, HUB)
        if self.route_off:
            self.sim.at(self.sim.now + back, peer.failed, HUB, index)
            return

        def done() -> None:
            self.hub_jobs.pop(job, None)
            self.hub_served.add(index)
            self.hub_delivered.add((peer.id, index))
            self.sim.at(self.sim.now + back, peer.piece, HUB, index)
            self.maybe_cut_route()
        job = self.hub_up.send(self.setup.chunk_bytes, done)
        self.hub_jobs[job] = (peer, index)

    def cut(self) -> None:
        self.control_cut = True
        self.maybe_cut_route()

    def maybe_cut_route(self) -> None:
        if self.control_cut and self.setup.route_goes and not self.route_off \
                and len(self.hub_served) == self.setup.n_chunks:
            self.route_off = True
            self.hub_up.fail_all()
            for peer, index in self.hub_jobs.values():
                self.sim.at(self.sim.now + self.lat(peer.id, HUB), peer.failed, HUB, index)
            self.hub_jobs.clear()

    def leave(self) -> None:
        """`leave_fraction` of the peers leave at once; the hub drops their chunk requests and
        (the tracker, with its control connection up) re-deals what they owned to everyone."""
        rng = random.Random(self.setup.seed + 3)
        gone = rng.sample(sorted(self.peers), round(self.setup.leave_fraction * len(self.peers)))
        for peer_id in gone:
            peer = self.peers[peer_id]
            peer.leave()
            for job, (p, _) in list(self.hub_jobs.items()):
                if p is peer:
                    self.hub_up.cancel(job)
                    del self.hub_jobs[job]
        if self.deals and not self.control_cut:
            self.redeal_seeds(gone)
        for peer_id in gone if self.broadcast is not None and not self.control_cut else ():
            plan = self.broadcast.drop(peer_id)
            for member in [] if plan is None else self.peers.values():
                if not member.gone:
                    self.control(len(m.encode(plan)), sent=True)
                    self.sim.at(self.sim.now + self.lat(member.id, HUB), member.replan, plan)

    def redeal_seeds(self, gone: list[str]) -> None:
        """Gossip: the seeds the hub had not yet sent to the peers that left go to others, one
        message to each receiver (a GossipPlan naming only the added seeds)."""
        orphans = sorted(i for p in gone for i in self.deals[p].seed
                         if (p, i) not in self.hub_delivered)
        here = [mb for mb in self.members if not self.peers[mb.peer_id].gone]
        for peer_id, seed in deal_seeds(here, orphans).items():
            if seed:
                self.control(gossip_announcement(self.man, seed, [])[1], sent=True)
                peer = self.peers[peer_id]
                self.sim.at(self.sim.now + self.lat(peer_id, HUB), peer.more_seed, seed)

    def control(self, nbytes: int, sent: bool = False) -> None:
        """One control message between the hub and a peer, if the connection is up."""
        if sent or not self.control_cut:
            self.res.hub_msgs += 1
            self.res.hub_bytes += nbytes

    def reported(self, peer) -> None:
        """`peer` has the whole version: its TransferReport and VersionHeld reach the hub."""
        peer.done_at = self.sim.now
        self.res.hub_msgs += 2
        self.res.hub_bytes += report_bytes(peer.got_from, self.setup.chunk_bytes)

    def announce(self, peer, encoded: bytes, plan_bytes: int, *args) -> None:
        self.res.hub_msgs += 1
        self.res.hub_bytes += len(encoded)
        self.res.hub_plan_bytes += plan_bytes
        self.sim.at(self.lat(peer.id, HUB), peer.announced, *args)

    def finish(self) -> Result:
        if self.setup.cut_at_s is not None:
            self.sim.at(self.setup.cut_at_s, self.cut)
        if self.setup.leave_at_s is not None:
            self.sim.at(self.setup.leave_at_s, self.leave)
        self.sim.run(until=20 * self.setup.m_over_b_s)
        done = [p.done_at for p in self.peers.values() if not p.gone]
        self.res.complete = all(t is not None for t in done)
        self.res.time_s = max((t for t in done if t is not None), default=0.0)
        self.res.hub_copies = self.hub_up.sent / (self.setup.chunk_bytes * self.setup.n_chunks)
        return self.res


class TrackerPeer:
    """A peer as `overlay.download.Download` drives `Failover`; its chunk server long-polls."""

    def __init__(self, world: World, member: Member):
        self.w, self.id = world, member.peer_id
        self.up = Uplink(world.sim, world.rates[self.id])
        self.held: set[int] = set()
        self.missing: set[int] = set()
        self.in_flight: dict[int, str] = {}
        self.load: Counter = Counter()
        self.waiting: dict[int, list] = {}  # chunk -> requesters long-polling for it
        self.got_from: Counter = Counter()
        self.done_at: float | None = None
        self.failover: Failover | None = None
        self.sending: dict[int, tuple[TrackerPeer, int]] = {}  # upload job -> (to, chunk)
        self.gone = self.ticking = False

    def announced(self, plan: m.RelayPlan) -> None:
        self.failover = Failover(self.w.setup.n_chunks, self.id)
        self.failover.plan(plan, {s.peer_id for s in plan.sources} | {HUB})
        self.missing = set(range(self.w.setup.n_chunks))
        self.pump()

    def replan(self, plan: m.RelayPlan) -> None:
        if not self.gone:
            self.failover.plan(plan, {s.peer_id for s in plan.sources} | {HUB})
            self.pump()

    def pump(self) -> None:
        waiting = False
        for i in sorted(self.missing - self.in_flight.keys()):
            source = self.failover.route(i, self.w.sim.now)
            waiting |= source is None
            if source is not None and self.load[source] < WINDOW:
                self.load[source] += 1
                self.in_flight[i] = source
                if source == HUB:
                    self.w.hub_want(self, i)
                else:
                    self.w.sim.at(self.w.sim.now + self.w.lat(self.id, source),
                                  self.w.peers[source].request, self, i)
        if waiting and not self.ticking:  # Download.run wakes every HUB_RETRY_S
            self.ticking = True
            self.w.sim.at(self.w.sim.now + 1.0, self._tick)

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
        if self.gone:  # connection refused, one latency later
            self.w.sim.at(self.w.sim.now + self.w.lat(self.id, requester.id), requester.failed,
                          self.id, index)
        elif index in self.held:
            self._send(requester, index)
        else:
            self.waiting.setdefault(index, []).append(requester)

    def _send(self, requester: TrackerPeer, index: int) -> None:
        back = self.w.lat(self.id, requester.id)

        def done() -> None:
            del self.sending[job]
            self.w.sim.at(self.w.sim.now + back, requester.piece, self.id, index)
        job = self.up.send(self.w.setup.chunk_bytes, done)
        self.sending[job] = (requester, index)

    def piece(self, source: str, index: int) -> None:
        if not self.gone:
            self.w.sim.at(self.w.sim.now + VERIFY_S, self._verified, source, index)

    def _verified(self, source: str, index: int) -> None:
        if self.gone or self.in_flight.get(index) != source:
            return  # a request that had failed already: Download dropped it
        self.held.add(index)
        self.missing.discard(index)
        del self.in_flight[index]
        self.load[source] -= 1
        self.got_from[source] += 1
        for requester in self.waiting.pop(index, []):
            self._send(requester, index)
        if not self.missing and self.done_at is None:
            self.w.reported(self)
        self.pump()

    def failed(self, source: str, index: int) -> None:
        """A request failed (the source left, or the hub's route is gone): Download's path."""
        if self.gone or self.in_flight.get(index) != source:
            return
        del self.in_flight[index]
        self.load[source] -= 1
        if self.failover.failed(source, self.w.sim.now):  # the RelayReport
            self.w.control(len(m.encode(m.RelayReport(1, source, "unreachable", index))))
        self.pump()


def run_tracker(setup: Setup) -> Result:
    w = World(setup, "tracker")
    w.peers = {mb.peer_id: TrackerPeer(w, mb) for mb in w.members}
    w.broadcast = Broadcast(1, None, setup.n_chunks, "pipelined")
    plan = w.broadcast.start(w.members)
    encoded = m.encode(m.VersionAnnouncement(w.man, plan, bytes(64)))
    for peer in w.peers.values():
        w.announce(peer, encoded, len(m.encode(plan)), plan)
    return w.finish()


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
        self.w.sim.at(self.w.sim.now + self.w.lat(self.id, to), fn, *args)

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
        self.w.sim.at(self.w.sim.now + VERIFY_S, self._verified, source, index)

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
    deals = w.deals = gossip_plan(w.members, setup.n_chunks, rng=random.Random(setup.seed + 2))
    for peer in w.peers.values():
        deal = deals[peer.id]
        encoded, plan_bytes = gossip_announcement(w.man, deal.seed, deal.neighbours)
        w.announce(peer, encoded, plan_bytes, deal.seed, deal.neighbours)
    res = w.finish()
    res.extra["links"] = len(links)
    return res


# --- the sweep -----------------------------------------------------------------------------


def bound_s(setup: Setup, rates: dict[str, float]) -> float:
    """The max-flow lower bound of a broadcast from one hub (Kumar and Ross, 2006): the hub sends
    every byte once, and the N * M bytes received come from the hub's and the peers' uplinks."""
    m_bits = setup.n_chunks * setup.chunk_bytes * 8
    return max(m_bits / setup.hub_bps, setup.n_peers * m_bits / (setup.hub_bps + sum(rates.values())))


def row(case: str, setup: Setup, res: Result) -> dict:
    _, rates = members_of(setup)
    return {"case": case, "strategy": res.strategy, "n": setup.n_peers, "chunks": setup.n_chunks,
            "complete": res.complete, "t_over_mb": round(res.time_s / setup.m_over_b_s, 3),
            "t_over_bound": round(res.time_s / bound_s(setup, rates), 3),
            "hub_msgs": res.hub_msgs, "hub_kb": round(res.hub_bytes / 1e3, 1),
            "plan_kb": round(res.hub_plan_bytes / 1e3, 1), "hub_copies": round(res.hub_copies, 3),
            "hub_chunk_requests": res.hub_chunk_requests,
            "p2p_msgs_per_peer": round(res.p2p_msgs / setup.n_peers, 1),
            "p2p_kb_per_peer": round(res.p2p_bytes / setup.n_peers / 1e3, 1)}


def sweep(ns: list[int], n_chunks: int, chunk_bytes: int) -> list[dict]:
    """Per N: both strategies on uniform, slow-third and half-NAT'd peers; then, at 30 % of
    each strategy's own uniform time, 1/8 of the peers leaving ("churn"), the same with the
    hub's control connection cut (its chunk route still answers), and for gossip the case the
    issue names: the control connection cut and the chunk route gone once the seed copy is out."""
    rows = []
    for n in ns:
        base = Setup(n, n_chunks, chunk_bytes)
        cases = {"uniform": base, "slow_third": Setup(n, n_chunks, chunk_bytes, slow_fraction=1 / 3),
                 "nat_half": Setup(n, n_chunks, chunk_bytes, nat_fraction=0.5)}
        for run in (run_tracker, run_gossip):
            results = {case: run(setup) for case, setup in cases.items()}
            rows += [row(case, cases[case], res) for case, res in results.items()]
            at = 0.3 * results["uniform"].time_s
            faults = {"churn": Setup(n, n_chunks, chunk_bytes, leave_at_s=at),
                      "cut_churn": Setup(n, n_chunks, chunk_bytes, cut_at_s=at, leave_at_s=at)}
            if run is run_gossip:
                faults["hub_cut_30pct"] = Setup(n, n_chunks, chunk_bytes, cut_at_s=at,
                                                route_goes=True)
            rows += [row(case, setup, run(setup)) for case, setup in faults.items()]
        print(f"  N={n} done", file=sys.stderr, flush=True)
    return rows


COLUMNS = ("n", "chunks", "case", "strategy", "complete", "t_over_mb", "t_over_bound", "hub_msgs",
           "hub_kb", "plan_kb", "hub_copies", "hub_chunk_requests", "p2p_msgs_per_peer")


def table(rows: list[dict]) -> str:
    lines = [" ".join(f"{c:>12}" for c in COLUMNS)]
    lines += [" ".join(f"{str(r[c]):>12}" for c in COLUMNS) for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy, colour in (("tracker", "tab:red"), ("gossip", "tab:blue")):
        for case, style in (("uniform", "-"), ("slow_third", "--"), ("nat_half", ":")):
            pts = [r for r in rows if r["strategy"] == strategy and r["case"] == case]
            ns = [r["n"] for r in pts]
            if case == "uniform":
                ax1.plot(ns, [r["hub_kb"] for r in pts], style, color=colour, marker="o",
                         label=f"{strategy}: all hub control")
                ax1.plot(ns, [r["plan_kb"] for r in pts], "--", color=colour, marker="x",
                         label=f"{strategy}: plans only")
            ax2.plot(ns, [r["t_over_mb"] for r in pts], style, color=colour, marker="o",
                     label=f"{strategy} {case}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peers N")
        ax.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_ylabel("hub control kB per version")
    ax2.set_ylabel("time to all complete / (M/B)")
    fig.suptitle(f"emulated broadcast, {rows[0]['chunks']} chunks (bench/gossip_sweep.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 8..64 only")
    ap.add_argument("--chunks", type=int, default=54, help="chunks per version")
    ap.add_argument("--chunk-mib", type=float, default=4.0, help="MiB per chunk")
    ap.add_argument("--plot", default=str(Path(__file__).with_name("gossip_sweep.png")))
    args = ap.parse_args(argv)
    ns = [8, 16, 32, 64] if args.quick else [8, 16, 32, 64, 128, 256]
    rows = sweep(ns, args.chunks, int(args.chunk_mib * (1 << 20)))
    fine = [row(case, s, run(s)) for n in (16, 32) for case, s in
            (("uniform_1mib", Setup(n, args.chunks * 4, int(args.chunk_mib * (1 << 18)))),)
            for run in (run_tracker, run_gossip)]
    print(table(rows + fine))
    if args.plot:
        plot(rows, Path(args.plot))
    pick = {(r["case"], r["strategy"], r["n"]): r for r in rows + fine}

    def series(case: str, strategy: str, key: str) -> dict:
        return {n: pick[(case, strategy, n)][key] for n in ns if (case, strategy, n) in pick}
    out = {"bench": "gossip_sweep", "chunks": args.chunks, "chunk_mib": args.chunk_mib,
           "peer_mbps": Setup(8).peer_bps / 1e6, "hub_mbps": Setup(8).hub_bps / 1e6}
    for strategy in ("tracker", "gossip"):
        out[f"{strategy}_hub_msgs"] = series("uniform", strategy, "hub_msgs")
        out[f"{strategy}_hub_kb"] = series("uniform", strategy, "hub_kb")
        out[f"{strategy}_plan_kb"] = series("uniform", strategy, "plan_kb")
        out[f"{strategy}_hub_copies"] = series("uniform", strategy, "hub_copies")
        for case in ("uniform", "slow_third", "nat_half", "churn", "cut_churn"):
            out[f"{strategy}_{case}_t_over_mb"] = series(case, strategy, "t_over_mb")
        for case in ("churn", "cut_churn"):
            out[f"{strategy}_{case}_hub_msgs"] = series(case, strategy, "hub_msgs")
            out[f"{strategy}_{case}_hub_copies"] = series(case, strategy, "hub_copies")
            out[f"{strategy}_{case}_complete"] = series(case, strategy, "complete")
    out["gossip_slow_third_t_over_bound"] = series("slow_third", "gossip", "t_over_bound")
    out["tracker_slow_third_t_over_bound"] = series("slow_third", "tracker", "t_over_bound")
    out["gossip_nat_half_hub_copies"] = series("nat_half", "gossip", "hub_copies")
    out["gossip_hub_cut_complete"] = series("hub_cut_30pct", "gossip", "complete")
    out["gossip_hub_cut_t_over_mb"] = series("hub_cut_30pct", "gossip", "t_over_mb")
    out["uniform_1mib_t_over_mb"] = {f"{r['strategy']}_{r['n']}": r["t_over_mb"] for r in fine}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
