"""Every kind of message a peer sends has a rate: token buckets by message kind.

The read budget (`echo2p2p.read_budget`) bounds the bytes and values a connection makes the hub
decode; it does not bound what a frame makes the hub *do*. A `version_held` is 20 bytes and
walks the propagation records; a `relay_report` starts the hub's own check and a log line. So
each kind a peer may send after its hello but rollouts (`heartbeat`, `lease_request`,
`version_held`, `transfer_report`, `relay_report`) has a `KindRate`, a token bucket: `burst`
frames at once, then `per_s` a second, sized far above what an honest peer sends (see
`HUB_RATES`). A frame past its kind's rate is dropped, unread by anything else, and counted;
its drops are a debt that leaks at the same rate, and a connection whose debt passes `burst`
(it kept sending at well over the rate, not one burst too many) is closed with a reason, and
costs its identity trust (`echo2p2p.trust`, event `flood`). Rollouts have no rate here: each answers a lease the hub
granted (`echo2p2p.hub_protocol` closes a connection over MAX_UNOWED that answer none), a peer
back from an outage sends its whole outbox at once, and dropping one would lose work; the read
budget paces them instead.

The hub keeps one `FrameBudget` per connection and, when join tokens are required, one per
identity (all connections of one token), `IDENTITY_SCALE` times larger: a lab's peers share a
token, an attacker's hundred connections share its budget too.

This is BitTorrent's and Tor's answer rather than a login: nobody is trusted to be slow, each
connection's work is bounded by what an honest one needs. Pure: `now` comes in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

TAKE, DROP, CLOSE = "take", "drop", "close"


@dataclass(frozen=True)
class KindRate:
    """One kind's bucket: `burst` frames at once, then `per_s` a second."""

    per_s: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.per_s > 0 and self.burst >= 1):
            raise ValueError(f"need per_s > 0 and burst >= 1, got {self.per_s}, {self.burst}")


# What an honest peer sends, and the rate the hub holds it to. The reference peer sends a
# heartbeat every 10 s; one lease_request per lease finished (a fast engine: a few dozen a
# second); a version_held per swap and a transfer_report per manifest
# (a delta and a full one per version, catch-ups: a tiny model publishes a few a second); a
# relay_report per source that failed it (each avoided after its first fault).
HUB_RATES: dict[str, KindRate] = {
    "heartbeat": KindRate(10.0, 32),
    "lease_request": KindRate(200.0, 512),
    "version_held": KindRate(16.0, 64),
    "transfer_report": KindRate(32.0, 128),
    "relay_report": KindRate(8.0, 64),
}
IDENTITY_SCALE = 16  # an identity's budget, in connections' worth


@dataclass(frozen=True)
class BudgetStatistics:
    taken: dict[str, int]
    dropped: dict[str, int]


class FrameBudget:
    """The buckets of one connection, or of one identity's connections together."""

    def __init__(self, now: float, rates: Mapping[str, KindRate] = HUB_RATES, scale: float = 1.0):
        self.rates = {kind: KindRate(r.per_s * scale, r.burst * scale) for kind, r in rates.items()}
        self._tokens = {kind: r.burst for kind, r in self.rates.items()}
        self._debt = dict.fromkeys(self.rates, 0.0)  # drops not yet forgiven
        self._at = dict.fromkeys(self.rates, now)
        self._taken: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()

    def spend(self, kind: str, now: float) -> str:
        """One frame of `kind` arrived at `now`: TAKE it, DROP it (over its rate), or CLOSE the
        connection (over its rate for well over a burst). A kind without a rate is taken."""
        rate = self.rates.get(kind)
        if rate is None:
            return TAKE
        elapsed = max(0.0, now - self._at[kind])  # a clock that steps back refills nothing
        self._at[kind] = max(now, self._at[kind])
        self._tokens[kind] = min(rate.burst, self._tokens[kind] + elapsed * rate.per_s)
        self._debt[kind] = max(0.0, self._debt[kind] - elapsed * rate.per_s)
        if self._tokens[kind] >= 1:
            self._tokens[kind] -= 1
            self._taken[kind] += 1
            return TAKE
        self._debt[kind] += 1
        self._dropped[kind] += 1
        return CLOSE if self._debt[kind] > rate.burst else DROP

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(dict(self._taken), dict(self._dropped))


def worst(verdicts: list[str]) -> str:
    """The verdict of several budgets on one frame: CLOSE over DROP over TAKE."""
    return CLOSE if CLOSE in verdicts else DROP if DROP in verdicts else TAKE
