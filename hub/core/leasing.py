"""What the hub adds to its lease book: quotas (`echo2p2p.lease_quota`: who holds which open
leases, and what an expired lease costs its holder), deadlines that count from when a lease can
start. (Lease ids nobody can guess are drawn by the shell: `hub.serving.server.new_lease_id`.)

`Quotas` counts, for one grant, the open leases the pure `may_grant` weighs (by the asking
peer's identity, by its address, by unproven peers, by the peer itself against what it can
finish in one lease timeout at the pace the hub measured: `paced_cap`), says how long a lease
granted now may wait behind its peer's others before its timeout runs (`queue_wait_s`, so no
lease expires for sitting queued behind a slow generation), and charges a lease that ran past its
deadline to its holder: quota (its cap shrinks) and trust (a `lease_expired` event, through the
`TrustGuard`). It never grants a lease itself (the core's dispatch pass does: `hub.core.core`).

A lease is dated by the groups ahead of it (`echo2p2p.staleness.lease_min_version`), and only
open leases that can be generated now count there: one no peer holds (an orphan of a resumed
hub: its peer may never deliver it) or one dated for a version not yet published may never
come, and counting it dates a new lease for a version that needs the very groups the learner
waits for (with S = 2, kappa = 3 a resumed hub deadlocked that way: `ahead`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from echo2p2p import messages as m
from echo2p2p.lease_quota import (PROBATION_LEASES, Held, LeaseQuota, latest_s, may_grant,
                                  paced_cap, proven, queue_wait_s)
from echo2p2p.leases import Lease, LeaseBook
from echo2p2p.staleness import lease_budget

from ..config import HubConfig
from .counters import Counters
from .peer import Peer
from .quarantine import TrustGuard


class Holdings:
    """Open leases by holder's connection, identity and address, how many unproven peers hold,
    and how many the learner cannot count on yet (`Quotas.ahead`)."""

    def __init__(self) -> None:
        self.by_peer: Counter[str] = Counter()
        self.by_identity: Counter[str] = Counter()
        self.by_address: Counter[str] = Counter()
        self.unproven = 0
        self.uncounted = 0  # orphans, and leases dated for a version not yet published
        self.unproven_counted = 0  # of the rest, those unproven peers hold

    def add(self, holder: Peer | None, book: LeaseQuota, ready: bool = True) -> None:
        """One more open lease, of `holder`'s (None: an orphan of a resumed hub, nobody's);
        `ready`: it can be generated with a version already published."""
        if holder is None or not ready:
            self.uncounted += 1
        if holder is None:
            return
        self.by_peer[holder.peer_id] += 1
        self.by_identity[holder.identity] += 1
        self.by_address[holder.address_key] += 1
        unproven = not book.is_proven(holder.identity)
        self.unproven += unproven
        self.unproven_counted += unproven and ready


class Quotas:
    """Lease quotas over the hub's peers and lease book."""

    def __init__(self, cfg: HubConfig, peers: dict[str, Peer], leases: LeaseBook,
                 guard: TrustGuard, counters: Counters, book: LeaseQuota,
                 rates: Callable[[str], float] = lambda peer_id: 0.0,
                 published: Callable[[], int | None] = lambda: None,
                 informative: Callable[[], float] = lambda: 1.0):
        """`book`: the standings (admission adds to them);
        `rates`: a peer's generation rate as the hub measured it, completions/s (0: not yet);
        `published`: the newest version published (None: none yet, every lease counts);
        `informative`: the share of groups that reach a batch (`RolloutBuffer.informative_frac`:
        below 1 with dynamic sampling, and the budget widens to match)."""
        self.book, self.rates, self.published = book, rates, published
        self.informative = informative
        self.timeout_s, self.group_size = cfg.staleness.lease_timeout_s, cfg.grpo.group_size
        # Unproven peers each hold their own probation leases on top of the budget
        # (`may_grant`); with S = 0 none: each batch is trained on the version that made it, so
        # a lease beyond it could only be generated after the step it was taken from, and its
        # group would pass as fresh with a version tag one ahead. There they share the budget,
        # under their caps.
        self.base_budget = lease_budget(cfg.grpo.prompts_per_step, cfg.staleness.max_lag)
        self.probation = PROBATION_LEASES if cfg.staleness.max_lag else 0
        self.peers, self.leases, self.guard, self.counters = peers, leases, guard, counters

    @property
    def budget(self) -> int:
        """Open, queued and judged leases allowed at once: `lease_budget`'s groups, in leases
        (with dynamic sampling 1 / `informative` leases give one queued group; at most 4x)."""
        return math.ceil(self.base_budget / self.informative())

    def holdings(self) -> Holdings:
        """The open leases counted by holder, once: the dispatch pass takes one and
        `add`s each lease it grants, instead of a walk over every open lease per grant."""
        holdings, newest, peers = Holdings(), self.published(), self.peers
        for lease in self.leases.open_leases():
            # No holder: a resumed hub's orphan, anyone's to complete and no one's to count on.
            holdings.add(peers.get(lease.peer_id), self.book,
                         newest is None or lease.min_version <= newest)  # `ready`, inline
        # An unproven peer's probation counts its submissions still being judged too: else one
        # whose samples wait behind others' at the scorer takes lease after lease, each queued,
        # thousands before its first is scored (issue 42). A proven peer's are in the budget.
        for lease in self.leases.judged_leases():
            if (holder := peers.get(lease.peer_id)) is not None and \
                    not self.book.is_proven(holder.identity):
                holdings.add(holder, self.book)
        return holdings

    def full(self, outstanding: int) -> bool:
        """Whether no peer may have a lease now, known without counting holdings: the budget is
        used up (`outstanding` open, queued or judged) and every connected peer is proven, so
        none has a probation lease to take either (`may_grant`). At saturation almost every
        dispatch (a credit added, a group judged) ends here: counting the holdings per call
        cost the hub more than reading the rollouts (`bench/ingest.py`, 64 peers)."""
        proven_keys = self.book.proven_keys
        return outstanding >= self.budget and all(
            conn.identity in proven_keys for conn in self.peers.values())

    def ready(self, lease: Lease) -> bool:
        """Whether `lease` can be generated now: a version it may use is published."""
        newest = self.published()
        return newest is None or lease.min_version <= newest

    def allows(self, conn: Peer, outstanding: int, holdings: Holdings | None = None) -> bool:
        """Whether one more lease may go to `conn` now (`outstanding`: open leases, queued
        groups and groups being judged; `holdings`: this dispatch's count, else made now)."""
        book, h = self.book, holdings or self.holdings()
        held = Held(h.by_identity[conn.identity], h.by_address[conn.address_key], h.unproven,
                    outstanding)
        paced = paced_cap(self.group_s(conn.peer_id), self.timeout_s)
        return (paced is None or h.by_peer[conn.peer_id] < paced) and may_grant(
            book.standing(conn.identity), book.standing(conn.address_key), held, self.budget,
            self.probation, book.policy)

    def group_s(self, peer_id: str) -> float | None:
        """Seconds `peer_id` takes per group, as measured (None: not measured yet)."""
        rate = self.rates(peer_id)
        return self.group_size / rate if rate > 0 else None

    def wait_s(self, conn: Peer, holdings: Holdings) -> tuple[float, float]:
        """How long a lease granted to `conn` now may wait behind its open ones before its
        timeout runs, and the latest its peer's deliveries may renew it to, from now
        (`echo2p2p.lease_quota.queue_wait_s`, `latest_s`)."""
        ahead = holdings.by_peer[conn.peer_id]
        return (queue_wait_s(ahead, self.group_s(conn.peer_id), self.timeout_s),
                latest_s(ahead, self.timeout_s))

    def ahead(self, outstanding: int, holdings: Holdings | None = None) -> int:
        """Of `outstanding`, the groups the learner counts on. Not counted, so that a lease
        granted now is not dated a step later for them (it would wait for a version that needs
        the very batch it was kept from): leases of unproven peers (on their probation: they
        are extra), orphans of a resumed hub (nobody holds them: they may never come) and
        leases dated for a version not yet published (they come after a batch that cannot
        wait for them). In groups: with dynamic sampling, the `informative` share of those
        leases (`outstanding` counts a queued group as the leases it took: `in_leases`)."""
        h = holdings or self.holdings()
        leases = outstanding - h.uncounted - min(h.unproven_counted, self.probation)
        return int(leases * self.informative())  # exact without filtering: x 1.0

    def left(self, conn: Peer) -> None:
        """`conn` left: a standing kept for this connection alone is forgotten (its peer id is
        never used again); its token's and its address's are kept."""
        if conn.identity == conn.peer_id:
            self.book.forget(conn.identity)

    def expired(self, late: list[Lease]) -> None:
        """These leases ran past their deadlines: each holder held one from others for
        nothing, which costs it quota, and trust unless it has delivered more groups than it
        let expire (a hoarder pays every time; an honest peer running late now and then does
        not walk into quarantine over a long run) or has not yet said it holds a version (an
        honest peer still downloading the model or starting its engine; its quota, 1 at the
        least, bounds what it holds meanwhile)."""
        for lease in late:
            if (conn := self.peers.get(lease.peer_id)) is None:
                continue  # an orphan of a resumed hub
            self.counters.leases_expired += 1
            self.book.expired(conn.identity, conn.address_key)
            if conn.held_version is not None and not proven(self.book.standing(conn.identity)):
                self.guard.distrust(conn, "lease_expired")


def grant_of(lease: Lease, group_size: int, now: float) -> m.LeaseGrant:
    """The `lease` frame that grants `lease` (a `TokenizedProblem`'s) at `now`."""
    p = lease.item
    return m.LeaseGrant(lease.lease_id, p.problem.id, p.problem.prompt, p.prompt_ids,
                        p.problem.answer, group_size,
                        # The latest it may be answered: sooner only if the peer stops
                        # delivering (its admitted groups renew it, `echo2p2p.lease_quota`).
                        lease.latest - now, lease.min_version)
