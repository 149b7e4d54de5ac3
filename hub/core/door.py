"""The hub's door: whether a peer may join now, decided before any work is done for it (no
welcome, no catch-up, no re-plan); and, once in, the frame budget its identity's connections
share (`echo2p2p.frame_budget`) and what a flood of one kind of frame costs it.

`knock`, as the connection asks for the websocket upgrade (the shell answers HTTP 429 with the
reason, before any websocket work: `hub.serving.door`): its address's join bucket
(`echo2p2p.join_limits`; an IPv6 address counts as its /64), its network's fair share of the
hub's join budget and the hub's budget itself, and the connections its address already holds
(`max_peers_per_address`). `refusal`, at its hello: the join token (the shell reads
`hub.serving.tokens` and says why it is refused), the crowd again, then the buckets of its peer
key and join token, and its network's share and the hub's budget, which a hello about to be
welcomed spends. A refusal is a reason (and at hello a close code), counted
in `hub.core.counters.Counters`; only a token refusal is logged at INFO (the churn the limits
stop would flood the log).

A frame dropped past its kind's rate is counted; a connection closed for flooding (`Flooding`)
is counted, logged and costs its identity trust (event `flood`). With join tokens, an identity's
connections share one budget `IDENTITY_SCALE` connections large; without, each connection is its
own identity and its protocol's budget is all there is.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from echo2p2p import messages as m
from echo2p2p.frame_budget import IDENTITY_SCALE, FrameBudget
from echo2p2p.hub_protocol import FrameDropped
from echo2p2p.join_limits import MAX_KEYS, JoinLimits, Rate

from ..config_sections import LimitsConfig
from .counters import Counters
from .peer import Peer, address_group, network_of
from .quarantine import TrustGuard

log = logging.getLogger("echo2p2p.hub.serving.server")  # reported with the hub's peer-facing side

FLOOD_JOINS = 16  # joins' worth of its address's and network's tokens a flood's close costs


class Door:
    """Who may join a hub now; one per hub."""

    def __init__(self, limits: LimitsConfig, tokens: bool, counters: Counters,
                 guard: TrustGuard | None = None):
        """`tokens`: peers join with tokens (their ids are identities); `guard`: what a flood
        costs its sender's trust (None: a rig that keeps no trust)."""
        self.tokens, self.counters, self.guard = tokens, counters, guard
        self.budgets: OrderedDict[str, FrameBudget] = OrderedDict()  # by identity, LRU
        self.max_per_address = limits.max_peers_per_address
        self.limits = JoinLimits(Rate(limits.joins_per_min, limits.join_burst),
                                 Rate(limits.joins_per_min_per_key, limits.join_burst_per_key),
                                 Rate(limits.joins_per_min, limits.join_burst),
                                 Rate(limits.joins_per_min_total, limits.join_burst_total),
                                 network_burst=limits.join_burst)

    def knock(self, remote: str | None, peers: Iterable[Peer], now: float) -> str | None:
        """Why a connection from `remote` may not even upgrade to a websocket now (the hub
        answers HTTP 429 with it), or None; every knock spends a token of its address's."""
        if (why := self._crowded(remote, peers)) is not None:
            self.counters.refused += 1  # a lab behind one NAT raises the cap
        elif (why := self.limits.knock(now, address_group(remote), network_of(remote))) is not None:
            self.counters.joins_too_often += 1
        return why

    def refusal(self, hello: m.Hello, remote: str | None, peers: Iterable[Peer], now: float,
                token_refusal: str | None = None) -> tuple[int, str] | None:
        """(close code, reason) if the peer that said `hello` from `remote` may not join now
        (`token_refusal`: why its token is not valid, None: it is); None if it may (its join is
        then counted against its buckets)."""
        if (why := token_refusal) is not None:
            self.counters.refused += 1
            log.info("refused %s: %s", remote, why)
            return m.CLOSE_UNAUTHORIZED, why
        if (why := self._crowded(remote, peers)) is not None:
            self.counters.refused += 1  # a lab behind one NAT raises the cap
            return m.CLOSE_TOO_MANY, why
        token_id = hello.token.partition(".")[0] if self.tokens else None
        if (why := self.limits.refusal(now, peer_key=hello.peer_key, join_token=token_id,
                                       network=network_of(remote))) is not None:
            self.counters.joins_too_often += 1
            return m.CLOSE_TOO_MANY, why
        return None

    def _crowded(self, remote: str | None, peers: Iterable[Peer]) -> str | None:
        # An IPv6 host's /64 counts as one address here too; each peer's key is parsed once
        # (`Peer.address_key`), as a knock may come for every connection attempt.
        key = f"addr:{address_group(remote)}"
        if remote and sum(c.address_key == key for c in peers) >= self.max_per_address:
            return "too many connections from this address"
        return None

    def admitted(self, conn: Peer, now: float) -> None:
        """`conn` joined: under join tokens, hold it to its identity's budget as well."""
        if conn.identity == conn.peer_id:
            return  # its own identity: the connection's budget is the identity's
        budget = self.budgets.pop(conn.identity, None) or FrameBudget(now, scale=IDENTITY_SCALE)
        self.budgets[conn.identity] = budget
        while len(self.budgets) > MAX_KEYS:
            self.budgets.popitem(last=False)
        conn.protocol.share_budget(budget)

    def dropped(self, conn: Peer, event: FrameDropped) -> None:
        self.counters.frames_dropped[event.kind] += 1

    def flooded(self, conn: Peer, kind: str, now: float) -> None:
        """`conn` is being closed for a flood of one kind of frame: count it against it."""
        self.counters.closed_for_flooding += 1
        log.info("%s (%s) sent %s frames far past their rate", conn.peer_id, conn.hello.name,
                 kind)
        self.limits.penalize(now, address_group(conn.remote), network_of(conn.remote),
                             FLOOD_JOINS)
        if self.guard is not None:
            self.guard.distrust(conn, "flood")
