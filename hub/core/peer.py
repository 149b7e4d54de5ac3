"""One joined peer as the hub's core sees it: no socket, only what decisions read.

What the protocol knows of the peer (session, credits, versions held and announced) lives in
its `echo2p2p.hub_protocol.HubProtocol`; `Peer` adds the hub's own judgement: its address, the
chunk server it advertised and whether the hub reached it, its measured upload. Its `post`
emits a `Send` into the core's outbox: the shell (`hub.serving.peers`) owns the socket.
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass

from echo2p2p import messages as m
from echo2p2p.hub_protocol import HubProtocol
from echo2p2p.overlay.tickets import server_base
from echo2p2p.relay import Member
from echo2p2p.seed_watch import is_leaf, relay_url
from echo2p2p.session import Session

from .actions import Outbox, Send


@dataclass(eq=False)
class Peer:
    """The hub's view of one connected peer."""

    peer_id: str
    hello: m.Hello
    protocol: HubProtocol
    outbox: Outbox  # the core's: where `post` puts its sends
    remote: str | None = None  # its IP address
    upload_bps: float = 0.0  # estimated from what other peers received from it; 0 until known
    relay: str = "unprobed"  # its chunk server: unprobed, ok (the hub reached it), failed, slow
    closing: bool = False  # the core asked the shell to close it: grant it nothing more

    # What the protocol keeps, read where the hub's view of a peer is shown.
    @property
    def session(self) -> Session:
        return self.protocol.session

    @property
    def credits(self) -> int:
        return self.protocol.credits

    @property
    def held_version(self) -> int | None:
        return self.protocol.held_version

    @property
    def held_max(self) -> int:
        return self.protocol.held_max

    @property
    def stream_version(self) -> int | None:
        return self.protocol.stream_version

    @property
    def announced(self) -> int:
        return self.protocol.announced

    @functools.cached_property
    def identity(self) -> str:
        """Whom trust is kept for: the join token's id (a peer cannot shed its record by
        reconnecting), else this connection. Once per connection, as `address_key`."""
        token_id = self.hello.token.partition(".")[0]
        return f"token:{token_id}" if token_id else self.peer_id

    @functools.cached_property
    def address_key(self) -> str:
        """Whom the lease quota counts an address's leases for (`echo2p2p.lease_quota`); once
        per connection (its hello and address are fixed): each lease dispatch reads both for
        every open lease and every peer, and parsing the address each time took more of the
        hub's time than reading the rollouts (`bench/ingest.py`, 64 peers)."""
        return f"addr:{address_group(self.remote)}" if self.remote else self.identity

    @property
    def server_url(self) -> str | None:
        """scheme://host:port of the chunk server it advertised, if that URL has such a form."""
        return server_base(self.hello.listen_addr) if self.hello.listen_addr else None

    @property
    def leaf(self) -> bool:
        """Dealt no share of any version on this connection (`echo2p2p.seed_watch.is_leaf`): no
        chunk server, or one that failed the hub's probe. Its welcome says so."""
        return is_leaf(self.server_url, self.relay)

    def member(self, relays: bool = True, max_share: int | None = None) -> Member:
        """This peer in a broadcast: a relay once the hub itself reached its chunk server (and
        `relays`: a quarantined peer only pulls), never a leaf (`echo2p2p.seed_watch.relay_url`),
        dealt at most `max_share` chunks of a manifest (`echo2p2p.seed_watch`)."""
        return Member(self.peer_id, relay_url(self.server_url, self.relay, relays),
                      self.upload_bps, max_share)

    def post(self, msg: m.Message, not_before: float = 0.0) -> None:
        """Ask the shell to send `msg` to this peer (not before `not_before`, the hub's clock)."""
        if not self.closing:
            self.outbox.emit(Send(self.peer_id, msg, not_before))


def network_of(remote: str | None) -> str | None:
    """The network `remote` is in, for the hub's fair share of joins: an IPv4 address's /24,
    an IPv6 address's /48 (what one site holds; an attacker with many such networks is the
    case the shares are for)."""
    try:
        ip = ipaddress.ip_address(remote or "")
    except ValueError:
        return remote
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ipaddress.ip_network((ip, 24 if ip.version == 4 else 48), strict=False))


def address_group(remote: str | None) -> str | None:
    """What the join limits and lease quotas count `remote` as: itself, or for IPv6 its /64
    (one host's share)."""
    try:
        ip = ipaddress.ip_address(remote or "")
    except ValueError:
        return remote
    if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d is a.b.c.d
        ip = ip.ipv4_mapped
    return str(ip) if ip.version == 4 else str(ipaddress.ip_network((ip, 64), strict=False))
