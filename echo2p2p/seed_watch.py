"""The hub's watch over the peers it deals chunks to: a share only for a peer that has shown it
fetches what it is dealt, on the hub's own evidence, and a silent peer's share dealt again within
about a chunk time, not after every other peer's `relay_stall_s`. Pure: no clock (`now` comes
in), no sockets; the hub's chunk route tells it who asked for what.

Theory of operation. A dealt chunk (a gossip seed, a tracker owner's chunk, a striped chain's
first hop) reaches the other peers only through the peer it was dealt to, which fetches it from
the hub's chunk route; the others ask the hub themselves only after `relay_stall_s` with nothing
new (gossip) or once their want of the owner stalls (the tracker). So a peer that takes a share
and never fetches it (an idle connection; a chunk server that answers nothing) holds back every
version it is dealt in by that much: an idle peer cut a small run's training by 87 % (issue 42).
The hub sees its own chunk route, whose ticket names the asker. A dealt peer must ask for a
chunk of that manifest within `grace_s` of the deal, and again within `grace_s` of each answer,
until its share is fetched or it reports the manifest whole. A chunk of its share not fetched,
none of its requests open at the hub and nothing heard of it for `grace_s`: it is silent.
`due` hands back what it had not fetched, for the shell to deal again, and benches it. A
request waiting for one of the hub's upload slots is open: a busy hub is not the peer's fault.
Any chunk of the manifest counts, not only its share's (a tracker peer whose source failed
fetches that source's chunks from the hub first, and its own after them), but each once: asking
again for a chunk it was sent neither shields nor renews it, so asking cannot keep a share
it never fetches alive for longer than the manifest has chunks. Only a manifest's first deal is
watched (an heir of re-dealt chunks may hold them already, from the peer that went); a
superseded manifest's shares are dropped (peers drop those downloads), the quiet of each
carried to the peer's share of the next version, so versions faster than the grace hide no one.

Standing, per identity (BitTorrent's optimistic unchoke seen from the tracker: a newcomer is
tried on a small share, a whole one is earned by doing). A leaf (`is_leaf`: no chunk server, or
one that failed the hub's probe) is dealt nothing, whatever its standing, and its welcome says
so; `relay_url` is the one rule every deal reads it by:

| standing | its share of a manifest (`cap`) | becomes |
|---|---|---|
| probation (new, or back from a bench) | at most `probation_chunks`; more only if every member is on probation | proven, after `prove_manifests` shares in a row fetched whole |
| proven | by its uplink (`echo2p2p.relay.deal_seeds`) | benched, when silent |
| benched | none | on probation after `bench_s`, doubled by each silence in a row (at most `max_bench_s`) |

`grace_s` is `chunk_times` chunk times at the hub's send rate, never under `floor_s`: an honest
peer on a busy CPU must have time to read the announcement and ask. A peer that got a chunk of
its share over a link instead (someone else had it first) asks nothing for it; if that leaves
it quiet for `grace_s` before it reports the manifest whole, it is benched wrongly, which costs
the swarm its seeding for a while, never a stall. The known hole: a peer that asks for its
chunks and then keeps them to itself is a relay fault (the hub's checks of accusations), not a
silence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Key = tuple[int, "int | None"]  # a manifest: (version, base version; None in full)


def is_leaf(server_url: str | None, probe: str) -> bool:
    """Whether the hub deals a peer no share of any version on this connection: it has no
    chunk server (its hello gave no `listen_addr`), or its server failed the hub's probe or a
    check ("failed", never undone on a connection). What its welcome tells it (`Welcome.leaf`)
    and what `relay_url` keeps out of every deal: the one rule both read."""
    return server_url is None or probe == "failed"


def relay_url(server_url: str | None, probe: str, relays: bool = True) -> str | None:
    """The URL a peer's `Member` carries (None: dealt no share now): None for a leaf, and for
    a server the hub has not reached yet ("unprobed") or judged slow, or a peer that may only
    pull (`relays` False: quarantined)."""
    if is_leaf(server_url, probe) or not relays or probe != "ok":
        return None
    return server_url


@dataclass(frozen=True)
class WatchPolicy:
    """How much the hub trusts a seeder it has not watched, and how quickly it gives up on one."""

    probation_chunks: int = 1  # the most of a manifest a peer not yet proven is dealt
    prove_manifests: int = 2  # shares in a row fetched whole that make it proven
    floor_s: float = 1.0  # the shortest grace: reading an announcement on a busy CPU
    chunk_times: float = 2.0  # the grace in chunk times at the hub's send rate, above the floor
    bench_s: float = 60.0  # no share for this long after a first silence, doubled per silence
    max_bench_s: float = 1800.0  # never benched longer at once
    max_identities: int = 100_000  # standings kept at most (the oldest unbenched go first)

    def grace_s(self, chunk_bytes: int, hub_bps: float | None) -> float:
        """How long a dealt peer may be quiet: `chunk_times` x the time the hub takes to send a
        chunk of `chunk_bytes` at `hub_bps` (None or not plausible: the floor), at least
        `floor_s`."""
        if hub_bps is None or not 0 < hub_bps < math.inf:
            return self.floor_s
        return max(self.floor_s, self.chunk_times * 8 * chunk_bytes / hub_bps)


@dataclass
class Standing:
    """What the hub has seen of one identity's seeding."""

    streak: int = 0  # shares in a row fetched whole
    silences: int = 0  # silences since it was last proven (each doubles the bench)
    benched_until: float = -math.inf
    since: float = 0.0  # when this record last changed (the oldest go first when full)


@dataclass
class Share:
    """One peer's dealt chunks of one manifest, as far as it has fetched them."""

    identity: str
    pending: set[int]  # dealt, not yet fetched from the hub
    grace_s: float
    heard_at: float  # the deal, or its last request or answer that counted
    open: set[int] = field(default_factory=set)  # chunks it asks the hub for now
    counted: set[int] = field(default_factory=set)  # chunks whose request counted once already


@dataclass(frozen=True)
class Silence:
    """A dealt peer the hub heard nothing of for its grace: what to deal again."""

    key: Key
    peer_id: str
    identity: str
    chunks: tuple[int, ...]  # dealt and never fetched
    quiet_s: float  # how long nothing was heard of it
    bench_s: float  # it is dealt nothing for this long now


class SeedWatch:
    """Every dealt peer's share and every identity's standing; see the module docstring."""

    def __init__(self, policy: WatchPolicy | None = None):
        self.policy = policy or WatchPolicy()
        self._standing: dict[str, Standing] = {}
        self._shares: dict[Key, dict[str, Share]] = {}
        self._carried: dict[str, float] = {}  # peer -> when last heard, of a superseded share

    # --- what it may be dealt ----------------------------------------------------------

    def cap(self, identity: str, now: float) -> int | None:
        """The most chunks of one manifest `identity` may be dealt now (`Member.max_share`):
        None once proven, 0 while benched, else the probation share."""
        st = self._standing.get(identity)
        if st is not None and now < st.benched_until:
            return 0
        if st is not None and st.streak >= self.policy.prove_manifests:
            return None
        return self.policy.probation_chunks

    def standing(self, identity: str, now: float) -> str:
        """"proven", "probation" or "benched", as `cap` deals."""
        cap = self.cap(identity, now)
        return "proven" if cap is None else "benched" if cap == 0 else "probation"

    # --- what happened -----------------------------------------------------------------

    def dealt(self, key: Key, peer_id: str, identity: str, chunks: list[int], grace_s: float,
              now: float) -> None:
        """`peer_id` (of `identity`) was dealt `chunks` of manifest `key` at `now`, as the
        manifest's first deal: it must ask for a chunk within `grace_s`. (Chunks dealt again
        later are not watched: the heir may hold them already, from the peer that went.)"""
        if chunks and peer_id not in self._shares.get(key, {}):
            heard_at = self._carried.pop(peer_id, now)
            self._shares.setdefault(key, {})[peer_id] = Share(identity, set(chunks), grace_s,
                                                              heard_at)

    def asked(self, peer_id: str, key: Key, index: int, now: float) -> None:
        """The hub's chunk route received `peer_id`'s request for chunk `index` of `key` (a
        chunk it was sent already does not count)."""
        share = self._shares.get(key, {}).get(peer_id)
        if share is not None and index not in share.counted:
            share.counted.add(index)
            share.open.add(index)
            share.heard_at = now

    def answered(self, peer_id: str, key: Key, index: int, fetched: bool, now: float) -> None:
        """That request ended: with the chunk sent (`fetched`), or not (then it may count
        again)."""
        share = self._shares.get(key, {}).get(peer_id)
        if share is None or index not in share.open:
            return
        share.open.discard(index)
        share.heard_at = now
        if not fetched:
            share.counted.discard(index)
            return
        share.pending.discard(index)
        if not share.pending:
            self._done(key, peer_id, now)

    def whole(self, peer_id: str, key: Key, now: float) -> None:
        """`peer_id` reported manifest `key` whole (so it has its share, however it came)."""
        if peer_id in self._shares.get(key, {}):
            self._done(key, peer_id, now)

    def _done(self, key: Key, peer_id: str, now: float) -> None:
        share = self._shares[key].pop(peer_id)
        st = self._standing.setdefault(share.identity, Standing())
        st.streak += 1
        if st.streak >= self.policy.prove_manifests:
            st.silences = 0
        st.since = now

    def superseded(self, version: int, now: float) -> None:
        """`version` is published: peers drop their downloads of older ones, so those shares
        are not waited for. A peer's quiet carries over to its share of `version`, dealt next
        (else a peer would never be silent for long enough while versions come faster than
        its grace), and only to that one."""
        self._carried = {}
        for key in [k for k in self._shares if k[0] < version]:
            for peer_id, share in self._shares.pop(key).items():
                heard_at = now if share.open else share.heard_at
                self._carried[peer_id] = max(self._carried.get(peer_id, heard_at), heard_at)

    def left(self, peer_id: str, now: float) -> None:
        """`peer_id` left: its shares are not watched (the shell deals them again). A standing
        kept under its connection's own id (no join token) is of no use any more, unless it is
        benched now (`max_identities` bounds those)."""
        for shares in self._shares.values():
            shares.pop(peer_id, None)
        st = self._standing.get(peer_id)
        if st is not None and not now < st.benched_until:
            del self._standing[peer_id]

    # --- what to do --------------------------------------------------------------------

    def due(self, now: float) -> list[Silence]:
        """Every dealt peer silent at `now`: each is benched and no longer watched on that
        manifest; its chunks not fetched are for the shell to deal again."""
        out = []
        for key, shares in self._shares.items():
            for peer_id, share in list(shares.items()):
                if share.open or now - share.heard_at < share.grace_s:
                    continue
                del shares[peer_id]
                out.append(Silence(key, peer_id, share.identity, tuple(sorted(share.pending)),
                                   now - share.heard_at, self._bench(share.identity, now)))
        self._shares = {k: v for k, v in self._shares.items() if v}
        return out

    def wake_at(self) -> float | None:
        """When `due` may next find a silent peer without another event (None: no share is
        waited for)."""
        return min((s.heard_at + s.grace_s for shares in self._shares.values()
                    for s in shares.values() if not s.open), default=None)

    def _bench(self, identity: str, now: float) -> float:
        st = self._standing.setdefault(identity, Standing())
        st.silences += 1
        st.streak = 0
        bench_s = min(self.policy.bench_s * 2 ** (st.silences - 1), self.policy.max_bench_s)
        st.benched_until, st.since = now + bench_s, now
        self._prune(now)
        return bench_s

    def _prune(self, now: float) -> None:
        """At most `max_identities` standings: the oldest not benched go first, then benches
        that ended, then the oldest benches (none is kept forever)."""
        excess = len(self._standing) - self.policy.max_identities
        if excess <= 0:
            return
        order = sorted(self._standing, key=lambda i: (
            self._standing[i].benched_until > now, self._standing[i].since))
        for identity in order[:excess]:
            del self._standing[identity]
