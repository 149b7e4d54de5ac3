"""Join limits: token buckets that make reconnect churn cost the joiner, not the hub.

Every hello spends one token from the bucket of its address, and, once its join token is
checked, from those of its peer key and its join token; a bucket refills at a steady rate up to
its burst, so an honest peer back from a dropped connection (or a lab's peers back from a hub
restart, all at once) gets straight in, while one that reconnects as fast as it can is held to
the rate. A hello with any bucket empty is refused before the hub does any work for it (no
welcome, no catch-up, no re-plan); a refused hello spends nothing but the address's token.
Pure: `now` comes in; the buckets kept are bounded (the least recently used go first, and one
that went has refilled, or nearly, so forgetting it forgives little).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

MAX_KEYS = 4096  # buckets kept per kind (address, peer key, join token)
REASONS = {"address": "joining too often from this address; retry later",
           "peer key": "joining too often with this peer key; retry later",
           "join token": "joining too often with this join token; retry later"}


@dataclass(frozen=True)
class Rate:
    """A token bucket's shape: `burst` joins at once, then `per_min` a minute (0: no limit)."""

    per_min: float
    burst: int


class Buckets:
    """Token buckets by key, all of one `Rate`; at most `max_keys` kept."""

    def __init__(self, rate: Rate, max_keys: int = MAX_KEYS):
        self.rate = rate
        self.max_keys = max_keys
        self._level: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # (tokens, at)

    def level(self, key: Hashable, now: float) -> float:
        """The tokens in `key`'s bucket at `now` (a key never seen has a full bucket)."""
        tokens, at = self._level.get(key, (self.rate.burst, now))
        return min(float(self.rate.burst), tokens + max(0.0, now - at) * self.rate.per_min / 60)

    def take(self, key: Hashable, now: float) -> None:
        """Spend one of `key`'s tokens (check `level` first)."""
        self._level[key] = (self.level(key, now) - 1, now)
        self._level.move_to_end(key)
        while len(self._level) > self.max_keys:
            self._level.popitem(last=False)

    def __len__(self) -> int:
        return len(self._level)


class JoinLimits:
    """The hub's join buckets: per address, per peer key and per join token."""

    def __init__(self, per_address: Rate, per_key: Rate, per_token: Rate,
                 max_keys: int = MAX_KEYS):
        self.kinds = {"address": Buckets(per_address, max_keys),
                      "peer key": Buckets(per_key, max_keys),
                      "join token": Buckets(per_token, max_keys)}

    def refusal(self, now: float, address: Hashable = None, peer_key: Hashable = None,
                join_token: Hashable = None) -> str | None:
        """Spend a token of each bucket named (a key that is None or empty, or of a kind without
        a limit, is passed over) and None; or, if any of them is empty, spend none and say why
        (a short reason, safe to send back)."""
        named = [(kind, key) for kind, key in
                 (("address", address), ("peer key", peer_key), ("join token", join_token))
                 if key and self.kinds[kind].rate.per_min > 0]
        for kind, key in named:
            if self.kinds[kind].level(key, now) < 1:
                return REASONS[kind]
        for kind, key in named:
            self.kinds[kind].take(key, now)
        return None
