"""Broadcast planning: from whom each peer fetches each chunk of a version. The hub is the tracker.

Theory of operation ("scatter, then all-gather", pipelined). Every chunk of a version gets one
*owner* among the peers that serve: the owner fetches that chunk from the hub, and every other
peer fetches it from the owner. Owners' shares are proportional to their measured upload
bandwidth and interleaved along the stream, so the hub's uplink carries the version once, each
owner uploads its share to the N - 1 others, and a chunk moves on as soon as it is verified
while the next one is still arriving. With N peers of upload B each, that takes about
M/B + 2 chunk times while N is well under the chunk count (past it, each owner uploads its
one or two chunks N - 1 times over: 5.7 x M/B for 256 peers and 54 chunks in
`bench/gossip_sweep.py`); a star (the hub sends everything to everyone) takes N * M/B.
A peer that cannot accept connections is a leaf: it owns nothing and only pulls. Nor does a
peer the hub has not seen fetch what it was dealt own more than a probation share
(`Member.max_share`, from `echo2p2p.seed_watch`): every other peer waits on an owner.

When an owner leaves, or peers report it as corrupt or stalled, its chunks are re-dealt to the
remaining owners (a new plan revision); a chunk nobody can serve comes from the hub.
"striped-chain" is the ECHO-2 paper's broadcast: the serving members form a ring, each
chunk's owner (the first hop of its stripe) fetches it from the hub, and every other member
fetches every chunk from its predecessor in the ring, so each relays to one child; each plan is
the member's own (`Broadcast.plan(peer_id)`). A member that leaves is spliced out (its child
fetches from its predecessor, and is the new first hop of its stripes); a leaf, a late joiner or a
peer whose uplink is under half the hub's or the members' median (`ring_of`) pulls from the
owners, as in "pipelined". The ring moves at its slowest uplink.
The "gossip" strategy is not a plan: `gossip_plan` only deals seeds and neighbour samples, and
the peers route themselves (`echo2p2p.gossip`). This module is pure: no sockets, no clock;
`propagation` turns the hub's observations into the per-version figures of the run log.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field

from . import messages as m
from .pace import share_rate_bps

# pipelined: the tracker; gossip: echo2p2p.gossip; striped-chain: the ECHO-2 paper's chains
STRATEGIES = ("pipelined", "star", "gossip", "striped-chain")
GOSSIP_DEGREE = 8  # neighbours the hub samples for each peer in gossip mode
MAX_NEIGHBOURS = 32  # never more in one GossipPlan (a peer refuses a longer list)
CHAIN_WINDOW = 2  # striped-chain: requests in flight to the parent, per stripe it relays
MAX_WINDOW = 32  # never more in one RelayPlan (a peer caps it there)
MAX_TAIL = 0.1  # no relay whose one chunk, passed on, takes more of the hub's sending time
RING_MIN_UPLINK = 0.5  # striped-chain: slower uplinks (against the hub's) are leaves, not links


@dataclass(frozen=True)
class Member:
    """A peer taking part in one version's broadcast."""

    peer_id: str
    url: str | None  # its chunk server; None for a leaf
    upload_bps: float = 0.0  # measured upload bandwidth; 0 = not measured yet
    # The most chunks of one manifest it may be dealt, whatever its uplink (`echo2p2p.seed_watch`:
    # None for a peer that has shown it fetches what it is dealt, a probation share for one that
    # has not, 0 while benched for silence); a probation share holds while a member has none.
    max_share: int | None = None

    @property
    def seeds(self) -> bool:
        """Whether it may be dealt chunks at all: it accepts connections and is not benched."""
        return bool(self.url) and self.max_share != 0


def deal(n_chunks: int, weights: list[float]) -> list[int]:
    """Owner index per chunk: shares in proportion to `weights`, spread evenly along the stream.

    Smooth weighted round robin (as nginx balances upstreams): each chunk goes to the owner
    whose running credit is highest, so no owner gets a long run of consecutive chunks. An
    owner gets at most 1 chunk more than its exact share (and, rarely, a little more than 1
    less). Weights are scaled to integers first, so that equal weights tie exactly.
    """
    if not weights or any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"weights must be positive and finite, got {weights}")
    top = max(weights)
    weights = [max(1, round(w / top * 1_000_000)) for w in weights]
    total = sum(weights)
    credit = [0] * len(weights)
    owners = []
    for _ in range(n_chunks):
        for j, w in enumerate(weights):
            credit[j] += w
        best = max(range(len(weights)), key=credit.__getitem__)
        credit[best] -= total
        owners.append(best)
    return owners


@dataclass
class Broadcast:
    """The plan for one manifest (a version, full or delta against one base) and its revisions."""

    version: int
    base_version: int | None
    n_chunks: int
    strategy: str = "pipelined"
    members: dict[str, Member] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)  # left, or reported: never an owner again
    revision: int = 0
    hub_bps: float | None = None  # the hub's send rate, if measured (caps owners' shares)
    _owners: list[str | None] = field(default_factory=list)  # peer id per chunk; None = the hub
    _ring: list[str] = field(default_factory=list)  # striped-chain: the first members that serve

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")

    def start(self, members: list[Member]) -> m.RelayPlan:
        """Deal every chunk among the serving members; the first plan."""
        self.members = {mb.peer_id: mb for mb in members}
        self._owners = [None] * self.n_chunks
        self._ring = ring_of(members, self.hub_bps)
        self._redeal(range(self.n_chunks))
        self.revision += 1
        return self.plan()

    def join(self, member: Member) -> m.RelayPlan:
        """A peer that arrived after the start pulls by the current plan; it owns nothing."""
        self.members[member.peer_id] = member
        self.revision += 1
        return self.plan(member.peer_id)

    def drop(self, peer_id: str) -> m.RelayPlan | None:
        """Stop routing through `peer_id` (left, corrupt or stalled); the new (shared) plan if
        it owned chunks or was in the ring, else None: then every member's `plan` changed.

        In the striped chain its stripes go to its child, the next hop after it: every other
        member has asked its parent for them already (chunks not yet requested follow a new
        plan, those out stay), so a new first hop elsewhere in the ring would wait on its
        parent for a chunk that now starts after it, and the ring on it: a cycle that only a
        stall deadline broke (in `bench/gossip_sweep.py`, 16 and 32 peers with 1/8 leaving
        never completed). The child's own want of them was out to `peer_id`, which fails."""
        ring = self.ring()
        self.excluded.add(peer_id)
        orphaned = [i for i, owner in enumerate(self._owners) if owner == peer_id]
        if not orphaned and peer_id not in ring:
            return None
        if peer_id in ring and len(ring) > 1:
            child = ring[(ring.index(peer_id) + 1) % len(ring)]
            for i in orphaned:
                self._owners[i] = child
        else:
            self._redeal(orphaned)
        self.revision += 1
        return self.plan()

    def plan(self, peer_id: str | None = None) -> m.RelayPlan:
        """The current plan: the one every member shares, or in "striped-chain" the one
        `peer_id` follows (its own stripes from the hub, the rest from its predecessor in the
        ring; a member outside the ring shares the owners' plan)."""
        ring, window = self.ring(), 0
        if peer_id in ring and len(ring) > 1:
            parent = ring[ring.index(peer_id) - 1]
            sources = [self._source(p, 1) for p in (peer_id, parent)]  # a parent feeds one
            owners = [0 if o == peer_id else 1 for o in self._owners]
            window = min(CHAIN_WINDOW * (len(ring) - 1), MAX_WINDOW)
        else:
            ids = sorted({o for o in self._owners if o is not None})
            index = {pid: k for k, pid in enumerate(ids)}
            sources = [self._source(i, len(self.members) - 1) for i in ids]  # all but it pull
            owners = [m.HUB_OWNER if o is None else index[o] for o in self._owners]
        return m.RelayPlan(self.version, self.base_version, self.revision, sources,
                           struct.pack(f"<{len(owners)}I", *owners), window=window)

    def _source(self, peer_id: str, pullers: int) -> m.RelaySource:
        """`peer_id` as a source in a plan, with the rate each of its `pullers` may expect."""
        member = self.members[peer_id]
        return m.RelaySource(peer_id, member.url, share_rate_bps(member.upload_bps, pullers))

    def ring(self) -> list[str]:
        """"striped-chain": the members in the ring, in order (empty for other strategies)."""
        if self.strategy != "striped-chain":
            return []
        return [p for p in self._ring if p not in self.excluded]

    def owner(self, index: int) -> str | None:
        """The peer that relays chunk `index` now (None: the hub, or no such chunk)."""
        return self._owners[index] if 0 <= index < len(self._owners) else None

    def dealt(self) -> dict[str, int]:
        """Chunks each member owns now (relays to the others, or heads in the ring)."""
        counts = {pid: 0 for pid in self.members}
        for owner in self._owners:
            if owner is not None:
                counts[owner] += 1
        return counts

    def shares(self) -> dict[str, list[int]]:
        """The chunks each member owns now: those it alone fetches from the hub, for the
        others (in the ring, its stripes)."""
        out: dict[str, list[int]] = {pid: [] for pid in self.members}
        for i, owner in enumerate(self._owners):
            if owner is not None:
                out[owner].append(i)
        return out

    def source(self, peer_id: str, index: int) -> str | None:
        """Whom `peer_id` is told to fetch chunk `index` from now (None: the hub)."""
        owner, ring = self.owner(index), self.ring()
        if owner == peer_id:
            return None
        if owner is None or peer_id not in ring or len(ring) < 2:
            return owner
        return ring[ring.index(peer_id) - 1]

    def hub_share(self) -> float:
        """Fraction of chunks nobody relays: the hub serves them to every member."""
        return sum(o is None for o in self._owners) / max(self.n_chunks, 1)

    def _redeal(self, chunks: range | list[int]) -> None:
        servers = [mb for mb in self.members.values()
                   if mb.seeds and mb.peer_id not in self.excluded]
        if self.strategy == "striped-chain":  # a first hop outside the ring would feed nobody
            servers = [self.members[p] for p in self.ring()]
        if self.strategy == "star" or not servers:
            for i in chunks:
                self._owners[i] = None
            return
        copies = 1 if self.strategy == "striped-chain" else len(self.members) - 1
        for peer_id, owned in deal_seeds(servers, list(chunks), copies, self.hub_bps).items():
            for i in owned:
                self._owners[i] = peer_id


def ring_of(members: list[Member], hub_bps: float | None) -> list[str]:
    """The striped chain's ring: the members that serve, less those whose uplink is under
    RING_MIN_UPLINK x the larger of `hub_bps` and the serving members' median upload (every
    chunk crosses every uplink in the ring, so one at a quarter of the rate would take the
    whole ring to a quarter; as a leaf it only costs each first hop a share more). The median
    too, since the hub's estimate of its own rate may be low or missing: measured over a
    version it is the pace the peers pulled at, not the uplink (without it, in
    `bench/gossip_sweep.py`, 16 peers with a third at B/4 took 3.4 x the max-flow bound against
    1.8). All serving members when fewer than two would be left. A member on a probation share
    (`Member.max_share`) is no link while two members without one are there: a link that never
    fetches holds its whole part of the ring, not one share, until a stall deadline."""
    servers = [mb for mb in members if mb.seeds]
    proven = [mb for mb in servers if mb.max_share is None]
    servers = proven if len(proven) >= 2 else servers
    measured = sorted(mb.upload_bps for mb in servers if 0 < mb.upload_bps < math.inf)
    median = measured[len(measured) // 2] if measured else 0.0
    ref = max(hub_bps if hub_bps and 0 < hub_bps < math.inf else 0.0, median)
    fast = [mb for mb in servers if not ref or not mb.upload_bps
            or mb.upload_bps >= RING_MIN_UPLINK * ref]
    return [mb.peer_id for mb in (fast if len(fast) >= 2 else servers)]


@dataclass(frozen=True)
class GossipDeal:
    """One member's part of a gossip version: what it seeds, whom it dials."""

    seed: list[int]  # chunk indices it fetches from the hub (every chunk has one seeder)
    neighbours: list[m.RelaySource]  # a random sample of the other members' chunk servers
    own: list[int] = field(default_factory=list)  # chunks nobody seeds: it fetches them from the
    # hub for itself (unless a link has one), as every member does; no share anyone waits on

    @property
    def from_hub(self) -> list[int]:
        """Every chunk it asks the hub for first: the announcement's `seed`."""
        return self.seed + self.own


def gossip_plan(members: list[Member], n_chunks: int, degree: int = GOSSIP_DEGREE,
                rng: random.Random | None = None, *, hub_bps: float | None = None
                ) -> dict[str, GossipDeal]:
    """The hub's whole part in a gossip version: every chunk dealt to exactly one seeder, in
    proportion to measured upload like the tracker's owners, and each member a sample of
    `degree` (at most MAX_NEIGHBOURS) other members that accept links; a member that accepts
    none gets twice as many, since nobody dials it (in `bench/gossip_sweep.py` that took
    half-NAT'd swarms from 1.55 to 1.40 x M/B at 32 peers). A seeder uploads each seed at least
    once: its share is capped at what its uplink sends while the hub sends the version at
    `hub_bps`. O(N) work and messages, none per chunk.

    Only members that accept links and are not benched seed (`Member.seeds`), a probationer
    no more than its `max_share`: every other member waits on a seeder for its seeds (or for
    `relay_stall_s`, its fallback to the hub), so a share goes only where the hub could check
    that it is fetched (`echo2p2p.seed_watch`); a NAT'd member's upload still counts, over the
    links it dials. With no seeder at all, every member fetches every chunk from the hub for
    itself (`GossipDeal.own`), as in a star, rather than wait."""
    seeders = [mb for mb in members if mb.seeds]
    seeds = deal_seeds(seeders, list(range(n_chunks)), 1, hub_bps)
    own = [] if seeders else list(range(n_chunks))
    return {mb.peer_id: GossipDeal(seeds.get(mb.peer_id, []), neighbour_sample(
                members, mb.peer_id, degree if mb.url else 2 * degree, rng), list(own))
            for mb in members}


def deal_seeds(members: list[Member], chunks: list[int], copies: int = 1,
               hub_bps: float | None = None) -> dict[str, list[int]]:
    """`chunks` dealt among `members` (each chunk to one), in proportion to measured upload:
    the tracker's owners, gossip's first deal, or the seeds of a member that left before the
    hub had sent them (then the shell sends each receiver its share). A rate that is not a
    positive finite number counts as unmeasured (defence in depth: the hub only keeps
    plausible rates), and an unmeasured one as the average.

    A member uploads each chunk it is dealt `copies` times (the tracker's owner: to every
    other member; a gossip seeder: once), and never gets more than its uplink sends while
    the hub sends all of `chunks` at `hub_bps` (None: no cap); none at all if one chunk,
    passed on `copies` times, takes it over MAX_TAIL of that time (its last chunk leaves only
    once it has come): a slow peer's share must not hold the fast ones back. What those caps
    leave goes to the others (water-filling); only when every member is capped do shares pass
    their caps, and a member's `max_share` (a probation share) never while another member has
    none: when every member has one (a new run), nobody better can take the rest, and they are
    dealt by uplink as if they had none."""
    seeds: dict[str, list[int]] = {mb.peer_id: [] for mb in members}
    if not members or not chunks:
        return seeds
    rates = [mb.upload_bps if 0 < mb.upload_bps < math.inf else 0.0 for mb in members]
    known = [r for r in rates if r > 0]
    default = sum(known) / len(known) if known else 1.0
    capped = hub_bps is not None and 0 < hub_bps < math.inf
    caps = [r * len(chunks) / (max(copies, 1) * hub_bps) if r and capped else math.inf
            for r in rates]
    caps = [0.0 if c * MAX_TAIL < 1 else c for c in caps]
    firm = [mb.max_share is not None for mb in members]
    if all(firm):  # nobody proven: only a benched member's 0 still holds
        firm = [mb.max_share == 0 for mb in members]
    caps = [min(c, max(mb.max_share, 0)) if f else c for c, mb, f in zip(caps, members, firm)]
    counts = capped_shares(len(chunks), [r if r > 0 else default for r in rates], caps, firm)
    dealt = [j for j, c in enumerate(counts) if c > 0]
    for i, k in zip(chunks, deal(len(chunks), [counts[j] for j in dealt])):
        seeds[members[dealt[k]].peer_id].append(i)
    return seeds


def capped_shares(n: int, weights: list[float], caps: list[float],
                  firm: list[bool] | None = None) -> list[int]:
    """`n` items as whole counts in proportion to `weights`, none over its cap (water-filling:
    a capped member keeps its cap and the rest is shared among the others); when the caps add
    up to less than `n`, what is left is shared by weight over the first of: those whose cap is
    not 0 and not `firm`; those not `firm` (a slow uplink still delivers, an unproven peer may
    not: a `firm` cap is a probation share); those whose cap is not 0; everyone. The counts
    sum to n."""
    firm = firm or [False] * len(weights)
    counts = [0.0] * len(weights)
    free = set(range(len(weights)))
    left = float(n)
    while free and left > 0:
        total = sum(weights[j] for j in free)
        over = {j for j in free if left * weights[j] / total > caps[j]}
        if not over:
            for j in free:
                counts[j] += left * weights[j] / total
            left = 0.0
            break
        for j in over:
            counts[j] = math.floor(caps[j])
            left -= counts[j]
        free -= over
    tiers = ([w if k > 0 and not f else 0.0 for w, k, f in zip(weights, caps, firm)],
             [0.0 if f else w for w, f in zip(weights, firm)],
             [w if k > 0 else 0.0 for w, k in zip(weights, caps)], weights)
    spill = next(t for t in tiers if any(t))
    counts = [c + left * w / sum(spill) for c, w in zip(counts, spill)]
    whole = [math.floor(c + 1e-9) for c in counts]  # then the largest remainders get one more,
    order = sorted(range(len(counts)),  # first those it takes past no cap, then past no firm one
                   key=lambda j: (whole[j] + 1 > caps[j] and firm[j], whole[j] + 1 > caps[j],
                                  whole[j] - counts[j]))
    for j in order[:n - sum(whole)]:
        whole[j] += 1
    return whole


def neighbour_sample(members: list[Member], me: str, degree: int = GOSSIP_DEGREE,
                     rng: random.Random | None = None) -> list[m.RelaySource]:
    """Up to `degree` (capped at MAX_NEIGHBOURS) members other than `me` with a chunk server,
    drawn at random: a fresh sample for a peer whose neighbours left."""
    public = [m.RelaySource(mb.peer_id, mb.url) for mb in members if mb.url and mb.peer_id != me]
    return (rng or random).sample(public, min(max(degree, 0), MAX_NEIGHBOURS, len(public)))


def owners_of(plan: m.RelayPlan) -> list[int]:
    """The per-chunk owner indices of a plan; ValueError if they do not fit its sources."""
    if len(plan.owners) % 4:
        raise ValueError("owners is not a packed uint32 array")
    owners = list(struct.unpack(f"<{len(plan.owners) // 4}I", plan.owners))
    if any(o != m.HUB_OWNER and o >= len(plan.sources) for o in owners):
        raise ValueError("an owner index points past the sources")
    return owners


def propagation(done_after_s: list[float], n_peers: int) -> dict[str, float | None]:
    """Seconds until 50, 90 and 100 % of `n_peers` held the version (None: not reached)."""
    times = sorted(done_after_s)
    out: dict[str, float | None] = {}
    for pct in (50, 90, 100):
        need = max(1, math.ceil(n_peers * pct / 100))
        out[f"t{pct}_s"] = round(times[need - 1], 3) if len(times) >= need else None
    return out
