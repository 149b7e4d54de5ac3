"""Which connected peers work, and what they cost: cost-aware activation and the cost meter.

No sockets and no clock: callers pass `now`. The hub tells the pool who joined and left and how
fast each peer generates (`rate`); `replan(required, now)` then picks the active set with
`echo2p2p.activation.Activator` (cheapest set meeting required * (1 + margin), with hysteresis)
and returns who changed. Peers outside the active set are on standby: connected, leased nothing.

Who is always active, whatever the plan:
- a peer not measured yet (on trial): its throughput is unknown until it has generated;
- a relay-only peer (engine "relay"): it never generates, it only serves chunks;
- everyone, when `required` is None (no step time measured yet, S = 0, where any extra
  throughput shortens the step, or a broadcast too slow for the rule) or the policy is "all".

Rates (`echo2p2p.rates`, one definition for the whole hub): each account's generation rate
while busy (`gen_rollouts_per_s`, the activation's mu_i, from `rate`) and its admitted/s, and the
pool's admitted/s overall (peers that left included), all over the last RATE_WINDOW_S seconds.

The cost meter bills a peer its declared price for the time it is active (standby is free: the
model is a market that pays for the hours a worker is put to work), from join to leave, and keeps
the total of peers that left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from echo2p2p.activation import Activator, PricedWorker, Selection, lp_lower_bound
from echo2p2p.rates import BusyRate, WindowSum

POLICIES = ("cost", "all")


@dataclass
class Account:
    """One peer as the pool sees it."""

    name: str
    price_per_hour: float
    generates: bool  # False for a relay-only peer
    gen_rollouts_per_s: float = 0.0  # measured while busy (`echo2p2p.rates`); 0 = on trial
    admitted: int = 0  # completions admitted, for $ per rollout
    usd: float = 0.0  # accrued up to `since`
    active_since: float | None = None  # None while on standby
    joined: float = 0.0
    gen: BusyRate = field(init=False, repr=False)
    admitted_window: WindowSum = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The hub's session bounds what the wire says (echo2p2p.bounds); this is the last line:
        # a NaN or negative price here would poison the cost meter and every later plan.
        _finite_non_negative("price_per_hour", self.price_per_hour)
        _finite_non_negative("gen_rollouts_per_s", self.gen_rollouts_per_s)
        self.gen, self.admitted_window = BusyRate(self.joined), WindowSum(self.joined)

    def accrue(self, now: float) -> None:
        if self.active_since is not None:
            self.usd += self.price_per_hour * max(now - self.active_since, 0.0) / 3600
            self.active_since = now


class Pool:
    """The peers, their activation and their cost."""

    def __init__(self, policy: str = "cost", margin: float = 0.1) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.activator = Activator(margin)
        self.accounts: dict[str, Account] = {}
        self.usd_left = 0.0  # accrued by peers that left
        self.admitted_left = 0
        self.required: float | None = None  # rollouts/s of the last plan
        self.plan: Selection | None = None
        self.admitted_window: WindowSum | None = None  # overall; from the first join

    def join(self, peer_id: str, name: str, price_per_hour: float, *, generates: bool,
             now: float) -> None:
        """A new peer: active at once (on trial, or a relay)."""
        self.accounts[peer_id] = Account(name, price_per_hour, generates, active_since=now,
                                         joined=now)
        if self.admitted_window is None:
            self.admitted_window = WindowSum(now)

    def leave(self, peer_id: str, now: float) -> None:
        account = self.accounts.pop(peer_id, None)
        if account is not None:
            account.accrue(now)
            self.usd_left += account.usd
            self.admitted_left += account.admitted

    def is_active(self, peer_id: str) -> bool:
        account = self.accounts.get(peer_id)
        return account is not None and account.active_since is not None

    def rate(self, peer_id: str, samples: int, busy_s: float, now: float) -> None:
        """One submission of `peer_id`'s: `samples` completions made in `busy_s` seconds."""
        _finite_non_negative("busy_s", busy_s)
        account = self.accounts.get(peer_id)
        if account is not None:
            account.gen_rollouts_per_s = account.gen.add(now, samples, busy_s)

    def gen_rollouts_per_s(self, peer_id: str) -> float:
        """`peer_id`'s generation rate while busy (0.0: not measured yet, or not here)."""
        account = self.accounts.get(peer_id)
        return account.gen_rollouts_per_s if account is not None else 0.0

    def admitted(self, peer_id: str, completions: int, now: float) -> None:
        """`completions` of `peer_id`'s were admitted at `now` (a peer gone: only the total)."""
        if self.admitted_window is not None:
            self.admitted_window.add(now, completions)
        if (account := self.accounts.get(peer_id)) is not None:
            account.admitted += completions
            account.admitted_window.add(now, completions)

    def admitted_per_s(self, now: float) -> float:
        """Completions admitted per second over the window, every peer's, gone ones too."""
        return 0.0 if self.admitted_window is None else self.admitted_window.per_s(now)

    def active_gen_rollouts_per_s(self) -> float:
        """What the active peers can make together while busy (the capacity model's sum mu_i)."""
        return sum(a.gen_rollouts_per_s for pid, a in self.accounts.items()
                   if self.is_active(pid))

    def replan(self, required: float | None, now: float) -> tuple[list[str], list[str]]:
        """Choose the active set for `required` rollouts/s (None: everyone); returns the peer
        ids (activated, put on standby) by this call."""
        self.required = required
        measured = self._measured()
        if required is None or self.policy == "all" or not measured:
            chosen = set(self.accounts)
        else:
            self.plan = self.activator.replan(measured, required)
            chosen = set(self.plan.active) | {
                pid for pid, a in self.accounts.items()
                if not a.generates or not a.gen_rollouts_per_s}
        activated, standby = [], []
        for pid, account in self.accounts.items():
            account.accrue(now)
            if pid in chosen and account.active_since is None:
                account.active_since = now
                activated.append(pid)
            elif pid not in chosen and account.active_since is not None:
                account.active_since = None
                standby.append(pid)
        return activated, standby

    def lp_bound(self) -> float | None:
        """$/h of the LP relaxation for the last requirement over the measured peers."""
        if self.required is None:
            return None
        return lp_lower_bound(self._measured(), self.required * (1 + self.activator.margin))

    def _measured(self) -> list[PricedWorker]:
        return [PricedWorker(pid, a.price_per_hour, a.gen_rollouts_per_s)
                for pid, a in self.accounts.items() if a.generates and a.gen_rollouts_per_s > 0]

    def usd_total(self, now: float) -> float:
        for account in self.accounts.values():
            account.accrue(now)
        return self.usd_left + sum(a.usd for a in self.accounts.values())

    def totals(self, now: float) -> dict:
        """$ and admitted completions over the run so far, as plain data (for a checkpoint)."""
        return {"usd": self.usd_total(now),
                "admitted": self.admitted_left + sum(a.admitted for a in self.accounts.values())}

    def restore_totals(self, totals: dict) -> None:
        """A resumed hub's pool: what `totals()` gave counts as spent by peers that left."""
        self.usd_left, self.admitted_left = totals["usd"], totals["admitted"]

    def usd_per_hour(self) -> float:
        """What the active set costs now."""
        return sum(a.price_per_hour for a in self.accounts.values() if a.active_since is not None)

    def activation_record(self, step: int, required: float | None, activated: list[str],
                          standby: list[str]) -> dict:
        """The run log's "activation" record of a replan at `step` that changed the active set."""
        return {"event": "activation", "step": step, "required_rollouts_per_s": required,
                "activated": activated, "standby": standby,
                "active": sorted(p for p in self.accounts if self.is_active(p)),
                "usd_per_hour": round(self.usd_per_hour(), 4),
                "lp_bound_usd_per_hour": self.lp_bound(),
                "planned_rollouts_per_s": round(self.plan.rollouts_per_s, 3) if self.plan else None}

    def meter(self, now: float) -> dict[str, float | None]:
        """The cost meter's totals, for the run log."""
        usd = self.usd_total(now)
        admitted = self.admitted_left + sum(a.admitted for a in self.accounts.values())
        return {"cost/usd_total": round(usd, 6), "cost/usd_per_hour": round(self.usd_per_hour(), 4),
                "cost/usd_per_1k_rollouts": round(1000 * usd / admitted, 6) if admitted else None,
                "pool/active": sum(a.active_since is not None for a in self.accounts.values()),
                "pool/standby": sum(a.active_since is None for a in self.accounts.values())}

    def per_peer(self, now: float) -> dict[str, dict]:
        """Each connected peer's price, state, rates (generation while busy, and admitted over
        the window), admitted completions and $ so far."""
        self.usd_total(now)
        return {pid: {"name": a.name, "price_per_hour": a.price_per_hour,
                      "active": a.active_since is not None,
                      "gen_rollouts_per_s": round(a.gen_rollouts_per_s, 3),
                      "admitted_per_s": round(a.admitted_window.per_s(now), 3),
                      "admitted": a.admitted,
                      "usd": round(a.usd, 6)} for pid, a in self.accounts.items()}


def _finite_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
