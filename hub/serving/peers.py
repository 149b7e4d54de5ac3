"""The hub's shell around one connected peer: its socket, its outbox and writer.

What the hub decides of a peer is the core's `hub.core.peer.Peer`; `PeerConn` is its
connection: the websocket and transport, the outbox of encoded frames a writer task drains
under a deadline (`write_outbox`), heartbeats (`keep_alive`). `close_connection` says why and
closes, and cuts a peer that cannot even take that. No decision is made here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from echo2p2p import messages as m
from echo2p2p.hub_protocol import HubProtocol
from echo2p2p.session import Session, State

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side

CLOSE_DEADLINE_S = 5.0  # how long a close may take before the connection is cut
FAULT_CLOSE_S = 1.0  # the same, closing a peer for a fault: the goodbye and close frame go out


@dataclass
class PeerConn:
    """One peer's connection, as the shell keeps it."""

    peer_id: str
    hello: m.Hello
    ws: web.WebSocketResponse
    protocol: HubProtocol
    transport: asyncio.BaseTransport | None
    remote: str | None = None  # its IP address
    outbox: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)

    def post(self, msg: m.Message) -> None:
        """Queue `msg` for this peer's writer task; never waits on the socket."""
        frame = self.protocol.send(msg)
        if frame is not None:  # else the connection is going: drop it
            self.outbox.put_nowait(frame)

    async def close(self, code: int, reason: str) -> None:
        await close_connection(self.ws, self.protocol.session, code, reason, self.transport)


async def write_outbox(conn: PeerConn, timeout_s: float) -> bool:
    """Drain `conn`'s outbox into its socket until the socket goes (False) or a send stalls
    past `timeout_s`: then the peer, which does not read, is cut off (True)."""
    while True:
        frame = await conn.outbox.get()
        try:
            async with asyncio.timeout(timeout_s):
                await conn.ws.send_bytes(frame)
        except TimeoutError:
            # A peer that does not read cannot take a Goodbye or a close frame either.
            log.warning("cutting off %s: not reading, a send stalled for %.0f s",
                        conn.peer_id, timeout_s)
            if conn.transport is not None:
                conn.transport.abort()
            return True
        except ConnectionError:
            return False  # the socket is going; the reader sees it close
        finally:
            conn.outbox.task_done()


async def keep_alive(conn: PeerConn, heartbeat_s: float, timeout_s: float,
                     now: Callable[[], float], refusal: Callable[[], str | None]) -> None:
    """Every `heartbeat_s`: close `conn` if it was silent for over `timeout_s`, or if
    `refusal()` gives a reason it may no longer be here (its token was revoked); else send a
    heartbeat."""
    while True:
        await asyncio.sleep(heartbeat_s)  # a timer, not a sync
        if conn.protocol.silent_for(now()) > timeout_s:
            await conn.close(m.CLOSE_TIMEOUT, f"silent for over {timeout_s:.0f} s")
            return
        if (why := refusal()) is not None:
            await conn.close(m.CLOSE_UNAUTHORIZED, why)
            return
        conn.post(m.Heartbeat())


async def close_connection(ws: web.WebSocketResponse, session: Session, code: int, reason: str,
                           transport: asyncio.BaseTransport | None, *, fault: bool = False) -> None:
    """Say why (Goodbye), then close with the same code and reason. A peer that does not read
    cannot take even that, so after CLOSE_DEADLINE_S the connection is cut. For a `fault` (a
    frame that broke the protocol, a flood) the hub stops reading first and cuts after
    FAULT_CLOSE_S: waiting for the peer's close frame would mean parsing whatever it queued
    before it, which a flooder makes megabytes."""
    if fault and isinstance(transport, asyncio.ReadTransport):
        transport.pause_reading()
    try:
        async with asyncio.timeout(FAULT_CLOSE_S if fault else CLOSE_DEADLINE_S):
            if not ws.closed and session.state is not State.CLOSED:
                try:
                    await ws.send_bytes(session.send(m.Goodbye(code, reason)))
                except ConnectionError:
                    pass  # the socket is already going; the close below still says why
            await ws.close(code=code, message=reason.encode()[:120])
    except TimeoutError:
        if transport is not None:
            transport.abort()

