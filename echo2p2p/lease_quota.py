"""Leases are a budget a peer earns: how many open leases a peer may hold, and which share of
the hub's lease budget peers that have not delivered may hold at all.

Theory of operation. The hub's lease budget (`staleness.lease_budget`) bounds the groups queued,
in flight or being judged; a peer that takes leases and never answers (a hoarder) holds the
learner below its batch until they expire, then takes them again. So:

- a peer's cap on open leases starts at `start` and grows by one per group of its that was
  admitted; each lease it let expire takes `expiry_cost` off (never below 1: an honest peer
  whose first lease ran late can still work; an unproven peer's expiry also costs it trust,
  `hub.core.leasing`). The hub applies the cap to the peer's identity (its join token's id when
  tokens are required, else its connection) and to its address, each with its own `Standing`;
- a peer is *proven* once it delivered more groups than it let expire. Leases of unproven
  peers are on top of the budget, each unproven peer on its own probation: its cap (`start`,
  and no more at one address than the address's cap), whatever the others hold. So no set of
  hoarders, however many connections, holds a lease of the learner's budget (proven peers
  always have all of it), nor a new peer's first leases: hoarders that joined first from 8 or
  128 networks hold theirs, and the first honest peer gets its own at once and proves itself
  with its first admitted group (a shared probation of one batch let 8 hoarders hold it all,
  taking it again at each expiry, and a new run stayed at step 0). What they hold is prompts
  out of the epoch for a lease timeout at a time (re-issued first, after), not work the
  learner waits for: their leases are not counted among the groups ahead of a new one
  (`hub.core.leasing`). `PROBATION_LEASES` bounds them all, as the lease book's memory.
  With S = 0 there is no room on top of the budget (a lease beyond it could only be generated
  after the step it was taken from): there unproven peers take leases inside the budget,
  under their caps, and hoarders that came first can hold it; use join tokens.

A peer's queue. A peer works through its leases one at a time (`leases_in_flight` of them
queued, so its engine never idles), so a lease's timeout must not run while the lease waits
behind the peer's other leases: a slow engine would then see its queued leases expire, its
finished groups rejected and its quota cut, for no fault of its own. Two rules, over the hub's
own measurement of the peer's seconds per group (its samples over the time it spent on them,
`hub.core.admission`; what a peer says of its speed is never used), and one over its progress:

- `paced_cap`: a peer holds no more open leases than it can finish inside one lease timeout at
  its measured pace (at least 1);
- `queue_wait_s`: a lease's deadline counts from when the peer can be expected to start it, its
  place in the peer's queue times the measured seconds per group, at most a whole timeout per
  lease ahead (the same for a peer not measured yet);
- progress renews: each group of a peer's admitted moves its other open leases' deadlines to a
  timeout from then (`LeaseBook.renew`), so a peer whose pace drops (a long completion, a busy
  machine) keeps the leases it is working through; never past `latest_s` after the grant, a
  whole timeout per lease ahead and its own, so a peer that delivers some groups and sits on
  others loses those. A peer that stops working loses every lease within a timeout of its last
  delivery (or of the lease's first deadline).

Pure: plain counts in, a bool out. The hub keeps the standings and counts the open leases.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

PROBATION_LEASES = 4096  # open leases all unproven peers may hold at once: a memory bound


@dataclass(frozen=True)
class Standing:
    """What one key (an identity or an address) did with its leases."""

    delivered: int = 0  # groups admitted
    expired: int = 0  # leases it let run past their deadline


@dataclass(frozen=True)
class Held:
    """Open leases at the moment of a grant, counted by the hub."""

    by_identity: int  # held by the asking peer's identity (all its connections)
    by_address: int  # held by every connection from the asking peer's address
    unproven: int  # held by unproven peers, everywhere
    outstanding: int  # open leases + queued groups + groups being judged


@dataclass(frozen=True)
class QuotaPolicy:
    start: int = 2
    """Open leases a peer (and an address) that has delivered nothing may hold."""
    max_open: int = 64
    """No identity holds more than this many open leases (a peer's credits stop there too)."""
    expiry_cost: int = 2
    """Cap lost per lease let expire."""


def cap(standing: Standing, policy: QuotaPolicy, ceiling: int | None) -> int:
    """Open leases a key with this record may hold: start + delivered - cost x expired, at
    least 1 and at most `ceiling` (None: no ceiling, as for an address, whose peers earn it
    together)."""
    earned = policy.start + standing.delivered - policy.expiry_cost * standing.expired
    return max(1, earned if ceiling is None else min(ceiling, earned))


def proven(standing: Standing) -> bool:
    """It delivered more groups than it let leases expire."""
    return standing.delivered > standing.expired


def may_grant(identity: Standing, address: Standing, held: Held, budget: int, probation: int,
              policy: QuotaPolicy) -> bool:
    """Whether one more lease may go to a peer with these standings now. `budget`: the hub's
    lease budget; `probation`: open leases all unproven peers together may hold on top of it
    (0: none, they take leases inside the budget)."""
    if (held.by_identity >= cap(identity, policy, policy.max_open)
            or held.by_address >= cap(address, policy, None)):
        return False
    if proven(identity):  # unproven peers' leases are not in the budget
        return held.outstanding - min(held.unproven, probation) < budget
    if not probation:  # no room of their own (S = 0): inside the budget, under the caps above
        return held.outstanding < budget
    # Each unproven peer is held to its own cap and its address's (above): peers that
    # delivered from an address vouch for it, so a lab behind one NAT (or the demo's local
    # peers) brings new peers in as fast as its proven ones deliver; a fresh address gets
    # `start`. What other unproven peers hold takes nothing of its share.
    return held.unproven < probation


@dataclass
class LeaseQuota:
    """The standings of every identity and address the hub has seen (in memory: a resumed hub
    starts everyone afresh)."""

    policy: QuotaPolicy = field(default_factory=QuotaPolicy)
    standings: dict[str, Standing] = field(default_factory=dict)
    # The keys `proven` now, kept as they change: the hub asks it of every connected peer at
    # each lease dispatch, and of the holder of every lease it counts.
    proven_keys: set[str] = field(default_factory=set)

    def standing(self, key: str) -> Standing:
        return self.standings.get(key, Standing())

    def is_proven(self, key: str) -> bool:
        """`proven(self.standing(key))`, without building a standing."""
        return key in self.proven_keys

    def delivered(self, *keys: str) -> None:
        """A group of these keys' was admitted."""
        for key in keys:
            s = self.standing(key)
            self._set(key, replace(s, delivered=s.delivered + 1))

    def expired(self, *keys: str) -> None:
        """A lease of these keys' ran past its deadline."""
        for key in keys:
            s = self.standing(key)
            self._set(key, replace(s, expired=s.expired + 1))

    def forget(self, key: str) -> None:
        """`key`'s standing is of no use any more (a connection's own, once it left)."""
        self.standings.pop(key, None)
        self.proven_keys.discard(key)

    def _set(self, key: str, standing: Standing) -> None:
        self.standings[key] = standing
        if proven(standing):
            self.proven_keys.add(key)
        else:
            self.proven_keys.discard(key)


def paced_cap(group_s: float | None, timeout_s: float) -> int | None:
    """Open leases a peer measured at `group_s` seconds per group may hold: as many as it
    finishes inside `timeout_s`, at least 1; None (no cap of this kind) before it was measured."""
    if not group_s or group_s <= 0:
        return None
    return max(1, int(timeout_s // group_s))


def queue_wait_s(ahead: int, group_s: float | None, timeout_s: float) -> float:
    """Seconds a lease granted now may wait before its timeout starts: `ahead` leases of its
    peer's are before it, each taking `group_s` (None, not measured yet: `timeout_s`, the most
    an honest one may take), at most `timeout_s` each."""
    per_lease_s = min(group_s, timeout_s) if group_s and group_s > 0 else timeout_s
    return max(ahead, 0) * per_lease_s


def latest_s(ahead: int, timeout_s: float) -> float:
    """The latest a lease with `ahead` of its peer's leases before it may be due, from its
    grant, however its peer's deliveries renew it: a whole timeout for each and for itself."""
    return (max(ahead, 0) + 1) * timeout_s
