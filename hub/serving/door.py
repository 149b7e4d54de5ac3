"""The hub's door: whether a peer that said hello may join now, decided before any work is done
for it (no welcome, no catch-up, no re-plan).

In order: the address's join bucket (`echo2p2p.join_limits`; an IPv6 address counts as its
/64), the join token (`hub.serving.tokens`), the buckets of its peer key and join token, and the
connections its address already holds (`max_peers_per_address`). A refusal is a close code and
a short reason, counted in `hub.serving.counters.Counters`; only a token refusal is logged at INFO (the
churn the limits stop would flood the log).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from echo2p2p import messages as m
from echo2p2p.join_limits import JoinLimits, Rate

from ..config_sections import LimitsConfig
from .counters import Counters
from .peers import PeerConn, address_group
from .tokens import TokenBook, join_refusal

log = logging.getLogger("echo2p2p.hub.serving.server")  # reported with the hub's peer-facing side


class Door:
    """Who may join a hub now; one per hub."""

    def __init__(self, limits: LimitsConfig, tokens: TokenBook | None, counters: Counters):
        self.tokens, self.counters = tokens, counters
        self.max_per_address = limits.max_peers_per_address
        self.limits = JoinLimits(Rate(limits.joins_per_min, limits.join_burst),
                                 Rate(limits.joins_per_min_per_key, limits.join_burst_per_key),
                                 Rate(limits.joins_per_min, limits.join_burst))

    def refusal(self, hello: m.Hello, remote: str | None, peers: Iterable[PeerConn],
                now: float) -> tuple[int, str] | None:
        """(close code, reason) if the peer that said `hello` from `remote` may not join now;
        None if it may (its join is then counted against its buckets)."""
        if (why := self.limits.refusal(now, address=address_group(remote))) is not None:
            self.counters.joins_too_often += 1
            return m.CLOSE_TOO_MANY, why
        if (why := join_refusal(self.tokens, hello.token)) is not None:
            self.counters.refused += 1
            log.info("refused %s: %s", remote, why)
            return m.CLOSE_UNAUTHORIZED, why
        token_id = hello.token.partition(".")[0] if self.tokens is not None else None
        if (why := self.limits.refusal(now, peer_key=hello.peer_key,
                                       join_token=token_id)) is not None:
            self.counters.joins_too_often += 1
            return m.CLOSE_TOO_MANY, why
        group = address_group(remote)  # an IPv6 host's /64 counts as one address here too
        if sum(address_group(c.remote) == group for c in peers) >= self.max_per_address:
            self.counters.refused += 1  # a lab behind one NAT raises the cap
            return m.CLOSE_TOO_MANY, "too many connections from this address"
        return None
