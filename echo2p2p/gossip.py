"""The gossip overlay's download core: which chunk to ask of which neighbour, one manifest at a time.
Pure: no sockets, no clock (`now` is an argument), no chunk bytes, only indices.

Theory of operation. The hub deals every chunk of a manifest to exactly one seeder
(`echo2p2p.relay.gossip_plan`) and hands each peer a small random sample of neighbours; from
then on chunk availability spreads among the peers: each link tells the other end what it holds
(`heard_have`, then `heard_had` increments), and each peer picks for itself. `Swarm.requests`
asks, in this order:

1. its own seed chunks of the hub (at most `hub_window` in flight), unless a link has one;
2. any missing chunk a link holds, rarest first among what the links hold (ties broken by a
   per-peer random order, seeded by the peer's id, so peers spread different chunks first), at
   most `window` in flight per link, the least loaded link first;
3. a chunk that no usable link holds, once nothing new was heard for 1-2 x `hub_fallback_s`
   (drawn per peer, so one peer asks and its links get it from it; a seeder left, or this peer
   has no links): from the hub, which is one seed among the others;
4. a second want, of another link that holds the chunk, for a want out longer than
   `reroute_factor` x the quickest piece so far (it sits in a long queue), and for every chunk
   in endgame (the last `endgame_chunks` all in flight); `got` names the losers, and the
   shell sends them `cancel`.

`serve_rank` is the order a serving side takes its queued pieces in: a peer that accepts no
connection first, then the chunk its links hold least; and `_pick_link` asks such a peer first
among the links that hold a chunk, since a NAT'd peer's upload has only its links as outlets.
`echo2p2p.overlay.links` serves by the same rank. In `bench/gossip_sweep.py` it took 32
half-NAT'd peers from 1.56 (FIFO) to 1.36 x M/B, and 8 of them from 1.38 (rarity before NAT)
to 1.18, their uniform time.

A seeder that leaves before the hub sent it its seeds, or asks the hub for none of them within
about a second (`echo2p2p.seed_watch`): the hub deals them again (`relay.deal_seeds`, one
message to each receiver) and `add_seed` takes them; with the hub's control connection cut,
the fallback (3.) finds them instead.

A link whose piece failed (corrupt, stalled) is avoided for the rest of this manifest: its
wants are released and it is never asked again. The hub is never avoided: a failed want of the
hub holds hub wants for `hub_retry_s`. The serving side is bounded too: `wanted` refuses a
want of a chunk not held, out of range, or past `serve_window` outstanding from that link.
Everything a link says is checked (`heard_have`: exact bitfield length, zero padding;
`heard_had`: indices < n_chunks): ValueError, and the shell closes that link.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .failover import HUB, HUB_RETRY_S, HubBackoff

HUB_FALLBACK_S = 5.0  # nothing new heard for this long: orphan chunks come from the hub
MAX_LINKS = 64  # links one swarm keeps (dialled plus accepted); more are refused
ENDGAME_CHUNKS = 4  # duplicate wants only while this few chunks are missing
REROUTE_FACTOR = 6.0  # a want out this many times the quickest piece's time gets a second source
SLOW_LINK_FACTOR = 4.0  # a link this many times slower than the median one is asked last


def bitfield_size(n_chunks: int) -> int:
    """Bytes of a `have` bitfield for `n_chunks` chunks (bit i = chunk i, LSB first)."""
    return (n_chunks + 7) // 8


def pack_bits(indices: Iterable[int], n_chunks: int) -> bytes:
    """The bitfield holding `indices` (each < n_chunks)."""
    bits = bytearray(bitfield_size(n_chunks))
    for i in indices:
        bits[i >> 3] |= 1 << (i & 7)
    return bytes(bits)


def unpack_bits(bits: bytes, n_chunks: int) -> set[int]:
    """The indices set in a bitfield; ValueError unless it has the exact length and no bit set
    past n_chunks."""
    if len(bits) != bitfield_size(n_chunks):
        raise ValueError(f"bitfield of {len(bits)} bytes for {n_chunks} chunks")
    held = {k * 8 + b for k, byte in enumerate(bits) if byte for b in range(8) if byte >> b & 1}
    if held and max(held) >= n_chunks:
        raise ValueError("bitfield sets a chunk past the manifest")
    return held


@dataclass(frozen=True)
class SwarmStats:
    held: int  # chunks verified
    links: int  # links up now
    asked_hub: int  # wants sent to the hub (seed, orphan and retry)
    asked_peers: int  # wants sent to links
    duplicates: int  # second wants (a late want, or endgame)
    avoided: tuple[str, ...]  # links whose piece failed, first failed first


class Swarm:
    """One peer's download of one manifest over its gossip links; see the module docstring."""

    def __init__(self, n_chunks: int, me: str, seed: Iterable[int], *, window: int = 2,
                 hub_window: int = 2, hub_fallback_s: float = HUB_FALLBACK_S,
                 hub_retry_s: float = HUB_RETRY_S, serve_window: int = 2,
                 endgame_chunks: int = ENDGAME_CHUNKS, reroute_factor: float = REROUTE_FACTOR,
                 max_links: int = MAX_LINKS, rng: random.Random | None = None):
        """`seed`: the chunk indices the hub dealt to this peer. `rng`: tie-breaking (default:
        seeded by `me`, so a run is reproducible and peers still differ)."""
        self.n_chunks, self.me = n_chunks, me
        self.seed = frozenset(seed)
        if any(not 0 <= i < n_chunks for i in self.seed):
            raise ValueError("a seed chunk is out of range")
        self.window, self.hub_window, self.serve_window = window, hub_window, serve_window
        self.hub_fallback_s, self.hub_retry_s = hub_fallback_s, hub_retry_s
        self.endgame_chunks, self.max_links = endgame_chunks, max_links
        self.reroute_factor = reroute_factor
        self.rng = rng if rng is not None else random.Random(f"swarm:{me}")
        order = list(range(n_chunks))
        self.rng.shuffle(order)
        self._rank = {i: r for r, i in enumerate(order)}  # tie-break among equally rare chunks
        # Spread over [1, 2) x hub_fallback_s, so that of the peers missing the same orphan one
        # asks the hub first and the others get it from their links.
        self._fallback_s = hub_fallback_s * (1 + self.rng.random())
        self._missing = set(range(n_chunks))
        self._links: dict[str, set[int]] = {}  # link -> chunks it holds
        self._count = [0] * n_chunks  # links holding each chunk
        self._asked: dict[int, set[str]] = {}  # chunk -> sources with a want out for it
        self._asked_at: dict[tuple[int, str], float] = {}  # (chunk, source) -> when asked
        self._fastest_s: float | None = None  # the quickest piece from a link so far
        self._took: dict[str, float] = {}  # link -> its pieces' time from want to piece (EWMA)
        self._slow: set[str] = set()  # links whose pieces take SLOW_LINK_FACTOR x the median's
        self._load: Counter[str] = Counter()  # source -> wants out
        self._serving: dict[str, set[int]] = {}  # link -> chunks it wants of us now
        self._natted: set[str] = set()  # links to peers that accept no connection
        self._avoided: dict[str, None] = {}  # ordered set
        self._quiet_since: float | None = None  # when something new was last heard
        self._news = True
        self.hub = HubBackoff(hub_retry_s)  # when to ask a failing hub again
        self._asked_hub = self._asked_peers = self._duplicates = 0

    def add_seed(self, indices: Iterable[int]) -> None:
        """The hub dealt us more seed chunks (their seeder left before the hub had sent them):
        ask the hub for them like our own, without waiting for the fallback."""
        indices = frozenset(indices)
        if any(not (isinstance(i, int) and 0 <= i < self.n_chunks) for i in indices):
            raise ValueError("a seed chunk is out of range")
        self.seed |= indices

    # --- links -------------------------------------------------------------------------

    def link_up(self, peer: str, *, reachable: bool = True) -> bool:
        """A link to `peer` opened; False if refused (avoided, ourselves, or too many links).
        `reachable`: False for a peer that accepts no connection (it dialled us and has no
        chunk server): its upload has no other way out, so it is asked first."""
        if peer in self._links:
            return True
        if peer in (self.me, HUB) or peer in self._avoided or len(self._links) >= self.max_links:
            return False
        self._links[peer] = set()
        if not reachable:
            self._natted.add(peer)
        self._serving[peer] = set()
        return True

    def link_down(self, peer: str) -> None:
        """The link to `peer` closed: forget what it holds, release its wants both ways."""
        for i in self._links.pop(peer, ()):
            self._count[i] -= 1
        self._natted.discard(peer)
        self._serving.pop(peer, None)
        self._took.pop(peer, None)
        self._slow.discard(peer)
        for i in [i for i, srcs in self._asked.items() if peer in srcs]:
            self._release(i, peer)

    def heard_have(self, peer: str, bits: bytes) -> None:
        """`peer`'s whole holding (a `have`): replaces what it said before."""
        held = unpack_bits(bits, self.n_chunks)
        known = self._link(peer)
        gone = known - held
        for i in gone:
            self._count[i] -= 1
        known -= gone
        self.heard_had(peer, held - known)

    def heard_had(self, peer: str, indices: Iterable[int]) -> None:
        """`peer` now also holds `indices` (a `had`)."""
        indices = list(indices)
        if any(not (isinstance(i, int) and 0 <= i < self.n_chunks) for i in indices):
            raise ValueError("a had index is out of range")
        held = self._link(peer)
        for i in indices:
            if i not in held:
                held.add(i)
                self._count[i] += 1
                self._news = self._news or i in self._missing

    def _link(self, peer: str) -> set[int]:
        if peer not in self._links:
            raise ValueError(f"no link to {peer!r}")
        return self._links[peer]

    # --- our wants ---------------------------------------------------------------------

    def got(self, index: int, source: str | None = None, now: float | None = None) -> list[str]:
        """Chunk `index` is verified and stored (the shell tells the links with `had`), from
        `source` at `now` (pass both: they time the pieces, which paces second wants; without
        `now` no want is ever late). Returns the other sources still asked for it (without
        `source`: every source asked): send each a `cancel`."""
        self._check_index(index)
        if index not in self._missing:
            return []
        asked_at = self._asked_at.get((index, source))
        if asked_at is not None and now is not None and source != HUB:
            took = now - asked_at
            self._fastest_s = took if self._fastest_s is None else min(self._fastest_s, took)
            self._took[source] = 0.5 * (self._took.get(source, took) + took)
            times = sorted(self._took.values())
            if len(times) >= 3:
                slow_s = SLOW_LINK_FACTOR * times[len(times) // 2]
                self._slow = {p for p, t in self._took.items() if t > slow_s}
        self._missing.discard(index)  # not news: only what links say they hold delays orphans
        if source == HUB:
            self.hub.served()
        losers = [s for s in self._asked.get(index, ()) if s != source]
        for s in [*losers, source]:
            self._release(index, s)
        return losers

    def failed(self, index: int, source: str, now: float) -> bool:
        """The want of `index` from `source` failed at `now`. A link is avoided from now on
        (True the first time: report it); the hub is only asked again `hub_retry_s` later (more,
        as it keeps failing: `HubBackoff`)."""
        self._check_index(index)
        self._release(index, source)
        if source == HUB:
            self.hub.failed(now)
            return False
        if source in self._avoided:
            return False
        self._avoided[source] = None
        self.link_down(source)
        return True

    def requests(self, now: float) -> list[tuple[int, str]]:
        """The wants to send now, as (chunk, source); source is a link's peer id or HUB."""
        if self._news or self._quiet_since is None:
            self._quiet_since, self._news = now, False
        out: list[tuple[int, str]] = []
        idle = [p for p in self._links if self._load[p] < self.window]
        hub_free = self._hub_free(now)
        if not idle and not hub_free:
            return out
        free = self._missing - self._asked.keys()
        offered = set().union(*(self._links[p] for p in idle)) & free
        if hub_free:  # seeds, and once nothing new came for hub_fallback_s, orphans
            due = free if now - self._quiet_since >= self._fallback_s else free & self.seed
            offered |= {i for i in due if self._count[i] == 0}
        for i in sorted(offered, key=lambda i: (self._count[i], self._rank[i])):
            source = self._pick_link(i, idle) if self._count[i] else None
            if source is None and self._count[i] == 0:
                source = HUB if self._hub_free(now) else None
            if source is not None:
                self._ask(i, source, out, now)
        if idle:
            self._second_wants(now, idle, endgame=not free and len(self._missing) <= self.endgame_chunks,
                               out=out)
        return out

    def _second_wants(self, now: float, idle: list[str], endgame: bool,
                      out: list[tuple[int, str]]) -> None:
        """A second source for chunks whose one want is late (or, in endgame, for all)."""
        late = now - self.reroute_factor * self._fastest_s if self._fastest_s else None
        if not endgame and late is None:
            return
        single = [i for i, srcs in self._asked.items() if len(srcs) == 1
                  and (endgame or self._asked_at[(i, next(iter(srcs)))] < late)]
        for i in sorted(single, key=self._rank.__getitem__):
            source = self._pick_link(i, idle)
            if source is not None:
                self._duplicates += 1
                self._ask(i, source, out, now)

    def wake_at(self, now: float) -> float | None:
        """When `requests` may have something new without any other event (a want turning
        late, the hub fallback, the hub's retry time); None when only an event can change it."""
        times = []
        if self._fastest_s:
            late_s = self.reroute_factor * self._fastest_s
            times += [self._asked_at[(i, s)] + late_s
                      for i, srcs in self._asked.items() if len(srcs) == 1 for s in srcs]
        if self._load[HUB] < self.hub_window:  # else a hub answer comes first

            def waits(i: int) -> bool:
                return i in self._missing and i not in self._asked and self._count[i] == 0
            if any(waits(i) for i in self.seed):
                times.append(self.hub.retry_at)
            if self._quiet_since is not None and any(waits(i) for i in self._missing
                                                     if i not in self.seed):
                times.append(max(self._quiet_since + self._fallback_s, self.hub.retry_at))
        return min((t for t in times if t > now), default=None)

    def wants(self, index: int) -> frozenset[str]:
        """The sources a want of chunk `index` is out to now (a piece from anyone else is
        unsolicited)."""
        return frozenset(self._asked.get(index, ()))

    def _pick_link(self, index: int, idle: list[str]) -> str | None:
        """Of the `idle` links that hold `index`, are still under `window` and were not asked
        for it yet: a NAT'd one first, then the least loaded. A slow link (its pieces take
        SLOW_LINK_FACTOR x the median link's) is asked only when no other link holds it: a
        peer on a thin uplink must not hold the others back."""
        asked = self._asked.get(index, ())
        slow = self._slow
        shunned = slow if slow and any(index in held for p, held in self._links.items()
                                       if p not in slow) else set()
        best, best_key = None, None
        for peer in idle:
            if (index in self._links[peer] and peer not in asked and peer not in shunned
                    and self._load[peer] < self.window):
                key = (peer not in self._natted, self._load[peer], self.rng.random())
                if best_key is None or key < best_key:
                    best, best_key = peer, key
        return best

    def _hub_free(self, now: float) -> bool:
        return now >= self.hub.retry_at and self._load[HUB] < self.hub_window

    def _ask(self, index: int, source: str, out: list[tuple[int, str]], now: float) -> None:
        self._asked.setdefault(index, set()).add(source)
        self._asked_at[(index, source)] = now
        self._load[source] += 1
        if source == HUB:
            self._asked_hub += 1
        else:
            self._asked_peers += 1
        out.append((index, source))

    def _release(self, index: int, source: str) -> None:
        srcs = self._asked.get(index)
        if srcs is None or source not in srcs:
            return
        srcs.discard(source)
        del self._asked_at[(index, source)]
        if not srcs:
            del self._asked[index]
        self._load[source] -= 1

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.n_chunks:
            raise ValueError(f"chunk {index} is out of range")

    # --- their wants -------------------------------------------------------------------

    def wanted(self, peer: str, index: int) -> str | None:
        """`peer` wants chunk `index` of us: None to serve it, else why not (the shell closes the
        link: an honest peer never asks for what we did not say we hold, nor past the window)."""
        serving = self._serving.get(peer)
        if serving is None:
            return "no link"
        if not (isinstance(index, int) and 0 <= index < self.n_chunks):
            return "chunk out of range"
        if index in self._missing:
            return "chunk not held"
        if index not in serving and len(serving) >= self.serve_window:
            return "too many wants"
        serving.add(index)
        return None

    def serve_rank(self, peer: str, index: int) -> tuple[bool, int]:
        """Order for the pieces queued at our uplink, lowest first: a peer that accepts no
        connection before one that does (links are its only way to get chunks and to pass them
        on), then how many of our links hold chunk `index` already (the rarest spreads first,
        as the wants do)."""
        return peer not in self._natted, self._count[index]

    def served(self, peer: str, index: int) -> None:
        """The piece of `index` went out to `peer`, or `peer` cancelled its want."""
        self._serving.get(peer, set()).discard(index)

    # --- state -------------------------------------------------------------------------

    def bitfield(self) -> bytes:
        return pack_bits(set(range(self.n_chunks)) - self._missing, self.n_chunks)

    @property
    def missing(self) -> frozenset[int]:
        return frozenset(self._missing)

    @property
    def complete(self) -> bool:
        return not self._missing

    @property
    def links(self) -> frozenset[str]:
        return frozenset(self._links)

    def statistics(self) -> SwarmStats:
        return SwarmStats(self.n_chunks - len(self._missing), len(self._links), self._asked_hub,
                          self._asked_peers, self._duplicates, tuple(self._avoided))
