"""Join limits: token buckets that make reconnect churn cost the joiner, not the hub.

A bucket refills at a steady rate up to its burst, so an honest peer back from a dropped
connection (or a lab's peers back from a hub restart, all at once) gets straight in, while one
that reconnects as fast as it can is held to the rate. Joining is checked twice:

- `knock`, as a connection asks for the websocket upgrade, knowing only its address: every
  attempt spends a token of its address's bucket, and it is refused (HTTP 429, before any
  websocket work) while its address, its network or the hub has none left;
- `refusal`, at its hello, once its join token was checked: the buckets of its peer key and
  join token, and again its network and the hub's; a hello that will be welcomed spends a token
  of each. A refused hello spends nothing but its address's token.

Networks (an IPv4 /24, an IPv6 /48: what one site or attacker holds together) share one budget
for the whole hub, `total` joins a minute: each network's bucket refills at `total` over the
networks that joined in the last ACTIVE_S, and the hub's own bucket holds the sum to `total`
(plus its burst), its last quarter kept for networks that did not join in the last ACTIVE_S.
So one network, or thirty-two, churning as fast as they can take the hub's join rate between
them and no more, while a quiet network finds its bucket full and the reserve there: its next
peer gets in at once. A hello spends network and hub tokens only once its join token checked: with
`--tokens`, strangers' refused hellos never use up the budget token holders join from.

Pure: `now` comes in; the buckets kept are bounded (the least recently used go first, and one
that went has refilled, or nearly, so forgetting it forgives little).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

MAX_KEYS = 4096  # buckets kept per kind (address, network, peer key, join token)
ACTIVE_S = 60.0  # a network that joined this recently shares the hub's join rate
REASONS = {"address": "joining too often from this address; retry later",
           "network": "joining too often from this network; retry later",
           "hub": "the hub takes joins at its limit now; retry later",
           "peer key": "joining too often with this peer key; retry later",
           "join token": "joining too often with this join token; retry later"}


@dataclass(frozen=True)
class Rate:
    """A token bucket's shape: `burst` joins at once, then `per_min` a minute (0: no limit)."""

    per_min: float
    burst: int


class Buckets:
    """Token buckets by key, all of one `Rate` (a refill rate may be given per call instead);
    at most `max_keys` kept."""

    def __init__(self, rate: Rate, max_keys: int = MAX_KEYS):
        self.rate = rate
        self.max_keys = max_keys
        self._level: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # (tokens, at)

    def level(self, key: Hashable, now: float, per_min: float | None = None) -> float:
        """The tokens in `key`'s bucket at `now` (a key never seen has a full bucket), refilled
        at `per_min` (default the rate's) since it was last used."""
        per_min = self.rate.per_min if per_min is None else per_min
        tokens, at = self._level.get(key, (self.rate.burst, now))
        return min(float(self.rate.burst), tokens + max(0.0, now - at) * per_min / 60)

    def take(self, key: Hashable, now: float, per_min: float | None = None, n: float = 1) -> None:
        """Spend `n` of `key`'s tokens (check `level` first; a penalty may go below zero)."""
        self._level[key] = (self.level(key, now, per_min) - n, now)
        self._level.move_to_end(key)
        while len(self._level) > self.max_keys:
            self._level.popitem(last=False)

    def __len__(self) -> int:
        return len(self._level)


class NetworkShare:
    """The hub's join budget, `total`, shared fairly among the networks joining now."""

    def __init__(self, total: Rate, network_burst: int, max_keys: int = MAX_KEYS):
        self.total = total
        self.reserve = max(1.0, total.burst / 4)  # the hub's last tokens, for quiet networks
        self.networks = Buckets(Rate(total.per_min, network_burst), max_keys)
        self.hub = Buckets(total, 1)
        self._joined: OrderedDict[Hashable, float] = OrderedDict()  # network -> last join

    def share_per_min(self, network: Hashable, now: float) -> float:
        """What `network`'s bucket refills at now: the hub's rate over the networks that joined
        in the last ACTIVE_S, `network` counted."""
        while self._joined and next(iter(self._joined.values())) < now - ACTIVE_S:
            self._joined.popitem(last=False)
        return self.total.per_min / (len(self._joined) + (network not in self._joined))

    def refusal(self, network: Hashable, now: float) -> str | None:
        """Why `network` may not join now (its share or the hub's budget is spent), or None."""
        if self.total.per_min <= 0 or network is None:
            return None
        if self.networks.level(network, now, self.share_per_min(network, now)) < 1:
            return REASONS["network"]
        floor = 1 if network not in self._joined else self.reserve  # a quiet network's reserve
        return REASONS["hub"] if self.hub.level("", now) < floor else None

    def take(self, network: Hashable, now: float, n: float = 1, hub: bool = True) -> None:
        """Spend `n` of `network`'s tokens, and (`hub`) one of the hub's."""
        if self.total.per_min <= 0 or network is None:
            return
        self.networks.take(network, now, self.share_per_min(network, now), n)
        if hub:
            self.hub.take("", now)
        self._joined.pop(network, None)
        self._joined[network] = now
        while len(self._joined) > self.networks.max_keys:
            self._joined.popitem(last=False)


class JoinLimits:
    """The hub's join buckets: per address, per network (shared fairly), per peer key and per
    join token."""

    def __init__(self, per_address: Rate, per_key: Rate, per_token: Rate,
                 total: Rate = Rate(0, 1), *, network_burst: int = 64, max_keys: int = MAX_KEYS):
        self.kinds = {"address": Buckets(per_address, max_keys),
                      "peer key": Buckets(per_key, max_keys),
                      "join token": Buckets(per_token, max_keys)}
        self.share = NetworkShare(total, network_burst, max_keys)

    def knock(self, now: float, address: Hashable, network: Hashable = None) -> str | None:
        """A connection from `address` in `network` asks to join: spend a token of its
        address's bucket and None; or, if that bucket, the network's or the hub's is empty,
        spend nothing and say why (a short reason, safe to send back)."""
        bucket = self.kinds["address"]
        if address and bucket.rate.per_min > 0 and bucket.level(address, now) < 1:
            return REASONS["address"]
        return self.share.refusal(network, now) or self.refusal(now, address=address)

    def refusal(self, now: float, address: Hashable = None, peer_key: Hashable = None,
                join_token: Hashable = None, *, network: Hashable = None) -> str | None:
        """Spend a token of each bucket named (a key that is None or empty, or of a kind without
        a limit, is passed over; `network` spends its share and the hub's) and None; or, if any
        of them is empty, spend none and say why (a short reason, safe to send back)."""
        named = [(kind, key) for kind, key in
                 (("address", address), ("peer key", peer_key), ("join token", join_token))
                 if key and self.kinds[kind].rate.per_min > 0]
        for kind, key in named:
            if self.kinds[kind].level(key, now) < 1:
                return REASONS[kind]
        if (why := self.share.refusal(network, now)) is not None:
            return why
        for kind, key in named:
            self.kinds[kind].take(key, now)
        self.share.take(network, now)
        return None

    def penalize(self, now: float, address: Hashable, network: Hashable, joins: float) -> None:
        """A connection from `address` was closed for flooding: it and its network pay `joins`
        joins' worth of tokens, so that the flood's next connection waits that much longer."""
        if address and self.kinds["address"].rate.per_min > 0:
            self.kinds["address"].take(address, now, n=joins)
        self.share.take(network, now, joins, hub=False)  # the hub's budget was not used
