"""The hub's view of one connected peer: its socket and session, what it holds, how it relays."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from echo2p2p import messages as m
from echo2p2p.relay import Member
from echo2p2p.session import Session, State
from echo2p2p.overlay.tickets import server_base


@dataclass
class PeerConn:
    """The hub's view of one connected peer."""

    peer_id: str
    hello: m.Hello
    ws: web.WebSocketResponse
    session: Session
    transport: asyncio.BaseTransport | None
    remote: str | None = None  # its IP address
    credits: int = 0
    held_version: int | None = None  # loaded in its engine
    held_max: int = -1  # the newest version it ever reported holding
    stream_version: int | None = None  # newest version it has whole (a base for deltas)
    upload_bps: float = 0.0  # estimated from what other peers received from it; 0 until known
    last_done: float = 0.0  # when its last submission arrived (see Hub._measure)
    announced: int = -1  # newest version announced to it
    relay: str = "unprobed"  # its chunk server: unprobed, ok (the hub reached it), failed
    outbox: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)

    @property
    def identity(self) -> str:
        """Whom trust is kept for: the join token's id (a peer cannot shed its record by
        reconnecting), else this connection."""
        token_id = self.hello.token.partition(".")[0]
        return f"token:{token_id}" if token_id else self.peer_id

    @property
    def server_url(self) -> str | None:
        """scheme://host:port of the chunk server it advertised, if that URL has such a form."""
        return server_base(self.hello.listen_addr) if self.hello.listen_addr else None

    def member(self, relays: bool = True) -> Member:
        """This peer in a broadcast: a relay once the hub itself reached its chunk server (and
        `relays`: a quarantined peer only pulls)."""
        relays = relays and self.relay == "ok"
        return Member(self.peer_id, self.server_url if relays else None, self.upload_bps)

    def post(self, msg: m.Message) -> None:
        """Queue `msg` for this peer's writer task; never waits on the socket."""
        if self.session.state is not State.CLOSED:  # else the connection is going: drop it
            self.outbox.put_nowait(self.session.send(msg))
