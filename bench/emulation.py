"""The emulated network of bench/gossip_sweep.py: a discrete-event clock (`Sim`), uplinks as
token buckets (`Uplink`), one-way latencies (`Latency`), the real messages measured, and the
`World` of one run (the hub's uplink and control counters, churn and cuts). The peers that
drive the real cores in it are `bench.emulated_peers`; what is modelled, and where it is
generous or strict:
- every uplink (the hub's and each peer's) is a loss-free token bucket shared by the transfers
  it sends at once, at most UPLOAD_SLOTS (2) of them, as the chunk servers do
  (`overlay.serving`); the rest wait FIFO (hub, tracker) or by `Swarm.serve_rank` (gossip
  peers); downlinks are not limits;
- with `Setup.uplink_queue_bytes` (tc tbf's queue: 256 KiB in bench/broadcast.py), a control
  message a peer sends while its uplink is busy waits behind that much data: gossip's want,
  have, had and cancel frames (in order on each link), the tracker's chunk requests;
- one-way latency per pair of hosts drawn uniformly in 10-100 ms (`Setup.latency_s`); a chunk
  arrives one latency after its last byte left; a piece is usable (forwarded, announced) only
  once fully arrived and verified (VERIFY_S per 4 MiB);
- the hub's estimate of its own rate (`Setup.hub_bps_known`, None: unknown) goes to its
  plans as the real hub's `hub_bps_estimate` does (owners' and seeders' caps, the chain's ring);
- a NAT'd peer accepts no connection: in the tracker it is a leaf (owns nothing, only pulls);
  in gossip it dials its neighbours and uploads over those links;
- the tracker's and the chain's requests never time out here unless `Setup.stall_s` is set:
  then Download's own rules apply (a long poll answers 503 after stall_s / 2; a chunk not in
  stall_s after the first ask is a "stall", one far under the plan's rate a "slow"; the source
  is reported and avoided, its chunks from the hub; the hub's check of the report is not
  modelled); gossip peers send `had` at most every 50 ms;
- control messages are the real messages, encoded by `echo2p2p.messages` (or, for peer links,
  msgpack frames of the fields `docs/protocol/` names): hub -> peer announcement with its
  plan (tracker: RelayPlan; gossip: GossipPlan, or its RelayPlan-shaped stand-in if the
  message is not there yet), peer -> hub TransferReport and VersionHeld, and under faults the
  tracker's plan revisions (one to every member per departed owner) and RelayReports, and
  gossip's re-dealt seeds (one message to each receiver);
- faults, at 30 % of the strategy's own uniform time: "churn", 1/8 of the peers leave at once
  (their transfers stop; the tracker's hub re-deals their chunks to every member, gossip's hub
  re-deals their seeds); "cut_churn", the same with the hub's control connection cut (no
  revisions, no reports; the chunk route still answers);
  "hub_cut_30pct" (gossip), the control connection cut and the chunk route gone once every
  chunk has left the hub once. Times count the peers that stayed.
"""

from __future__ import annotations

import heapq
import itertools
import random
import struct
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from echo2p2p import frames
from echo2p2p import messages as m
from echo2p2p.failover import HUB
from echo2p2p.relay import Broadcast, GossipDeal, Member, deal_seeds

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
    latency_s: tuple[float, float] = (0.010, 0.100)  # one-way, drawn per pair of hosts
    stall_s: float | None = None  # the tracker's and chain's Download stall and slow rules
    uplink_queue_bytes: int = 0  # a control message waits behind this much data in a busy uplink
    hub_bps_known: float | None = None  # the hub's estimate of its own rate (Broadcast.hub_bps)

    @property
    def m_over_b_s(self) -> float:
        return self.n_chunks * self.chunk_bytes * 8 / self.peer_bps

    @property
    def verify_s(self) -> float:
        return VERIFY_S * self.chunk_bytes / (4 << 20)


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
    """One-way latency per pair of hosts, drawn once in `span_s` (default 10-100 ms)."""

    def __init__(self, seed: int, span_s: tuple[float, float] = (0.010, 0.100)):
        self.rng, self._d, self.span_s = random.Random(seed), {}, span_s

    def __call__(self, a: str, b: str) -> float:
        key = (a, b) if a < b else (b, a)
        if key not in self._d:
            self._d[key] = self.rng.uniform(*self.span_s)
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


# --- the world of one run ------------------------------------------------------------------


class World:
    """The hosts of one run: the hub's uplink, the peers, the latencies, the counters."""

    def __init__(self, setup: Setup, strategy: str):
        self.setup, self.sim = setup, Sim()
        self.lat = Latency(setup.seed + 1, setup.latency_s)
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

    def queued_s(self, peer) -> float:
        """How long a control message `peer` sends waits in its uplink's queue (tbf: FIFO
        behind the data it is sending)."""
        if not self.setup.uplink_queue_bytes or not peer.up.active:
            return 0.0
        return self.setup.uplink_queue_bytes * 8 / self.rates[peer.id]

    def hub_want(self, peer, index: int) -> None:
        """A chunk request reaches the hub one latency after `peer` sent it."""
        self.sim.at(self.sim.now + self.lat(peer.id, HUB) + self.queued_s(peer), self._hub_serve,
                    peer, index)

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
            if self.broadcast.drop(peer_id) is None:
                continue
            for member in self.peers.values():  # the chain's plans differ by member
                if not member.gone:
                    plan = self.broadcast.plan(member.id)
                    self.control(len(m.encode(plan)), sent=True)
                    self.sim.at(self.sim.now + self.lat(member.id, HUB), member.replan, plan)

    def redeal_seeds(self, gone: list[str]) -> None:
        """Gossip: the seeds of the peers that left go to others, one message to each receiver
        (a GossipPlan naming only the added seeds), as `hub.core.tracker.VersionTracker.reseed`
        deals them: all of them, since the hub cannot tell which were passed on; a receiver
        asks the hub only for those none of its links holds."""
        orphans = sorted(i for p in gone for i in self.deals[p].seed)
        here = [mb for mb in self.members if not self.peers[mb.peer_id].gone]
        heirs = [mb for mb in here if mb.seeds]  # no NAT'd heir; with none, everyone fetches
        shares = deal_seeds(heirs, orphans) if heirs else {mb.peer_id: orphans for mb in here}
        for peer_id, seed in shares.items():
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
