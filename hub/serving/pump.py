"""The frame pump of the hub's peer connections: frames in, events out, sockets kept here.

`Connections.pump` serves one websocket: it reads each frame into the connection's
`echo2p2p.hub_protocol.HubProtocol` and turns what the protocol makes of it into an event of
`hub.core.events` for `feed` (the hub's, which hands it to the core and carries out its
actions): the hello (`HelloReceived`: the core joins the peer, `joined`, or refuses it,
`refused`), every later frame (`FrameReceived`), a frame that breaks the protocol
(`ProtocolBroken`, and the connection is closed with its code and a short reason), a peer that
stopped reading (`PeerStalled`) and the end of the connection (`PeerLeft`). A connection with no
hello within `peer_timeout_s` is closed; a peer over its read budget is paused, not closed.
Beside the pump run the peer's writer (its outbox under a deadline) and keep-alive
(`hub.serving.peers`). It decides nothing about leases, versions, rollouts or trust.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import WSMsgType, web

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m
from echo2p2p.errors import Flooding, RemoteProtocolError
from echo2p2p.negotiation import SPEAKS, Speaks
from echo2p2p.runtime.process import loop_now

from ..config import HubConfig
from ..core import events as ev
from .peers import PeerConn, close_connection, keep_alive, write_outbox
from .tokens import TokenBook, join_refusal

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side

_ENDED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


class Connections:
    """The hub's peer sockets by peer id, and the pump that serves each."""

    def __init__(self, cfg: HubConfig, tokens: TokenBook | None, feed: Callable[[ev.Event], None],
                 speaks: Speaks = SPEAKS):
        """`tokens`: the join tokens a peer must hold (None: none needed); `feed`: the hub's
        way in to its core; `speaks`: what hellos are answered with (`echo2p2p.negotiation`)."""
        self.cfg, self.tokens, self.feed, self.speaks = cfg, tokens, feed, speaks
        self.by_peer: dict[str, PeerConn] = {}
        self._greeting: dict[str, PeerConn] = {}  # by connection id, until the core answers
        self._refusals: dict[str, tuple[int, str]] = {}
        self._next = 0

    def joined(self, conn_id: str, peer_id: str) -> None:
        """The core joined connection `conn_id` as `peer_id` (before its welcome is sent)."""
        conn = self._greeting.pop(conn_id)
        conn.peer_id = peer_id
        self.by_peer[peer_id] = conn

    def refused(self, conn_id: str, code: int, reason: str) -> None:
        self._refusals[conn_id] = (code, reason)

    async def pump(self, request: web.Request) -> web.StreamResponse:
        """Serve one peer connection until it ends."""
        cfg = self.cfg
        # aiohttp's own limit is a backstop that closes with 1009 and no reason; frames between
        # max_frame_bytes and twice that get our close with a readable reason.
        ws = web.WebSocketResponse(max_msg_size=2 * cfg.limits.max_frame_bytes, compress=False)
        try:
            await ws.prepare(request)
        except ConnectionError:  # it left mid-handshake (a peer stopping): nothing to serve or log
            # Not `ws`: half prepared, aiohttp would close it again and log "Call .prepare() first".
            return web.Response()
        protocol = hp.HubProtocol(loop_now(), cfg.limits.max_frame_bytes, speaks=self.speaks)
        conn: PeerConn | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                helpers: list[asyncio.Task] = []
                while (event := await self._next_event(ws, protocol, conn, request)) is not None:
                    if not isinstance(event, hp.HelloReceived):
                        self.feed(ev.FrameReceived(conn.peer_id, event))
                    elif (conn := await self._greet(ws, protocol, event.hello, request)) is None:
                        break
                    else:
                        helpers = [tg.create_task(self._write(conn)),
                                   tg.create_task(self._keep_alive(conn))]
                for task in helpers:
                    task.cancel()
        except Exception:
            # The one per-connection boundary: a bug while serving this peer closes this peer
            # only. The details go to our log, never to the peer.
            log.exception("internal error serving %s", conn.peer_id if conn else request.remote)
            await ws.close(code=1011, message=b"internal error")
        finally:
            if conn is not None:
                self.by_peer.pop(conn.peer_id, None)
                self.feed(ev.PeerLeft(conn.peer_id))
        return ws

    async def _greet(self, ws: web.WebSocketResponse, protocol: hp.HubProtocol, hello: m.Hello,
                     request: web.Request) -> PeerConn | None:
        """The core's answer to `hello`: the joined connection, or None (refused and closed)."""
        self._next += 1
        conn_id = f"c{self._next}"
        conn = PeerConn(conn_id, hello, ws, protocol, request.transport, remote=request.remote)
        self._greeting[conn_id] = conn
        self.feed(ev.HelloReceived(conn_id, hello, protocol, request.remote,
                                   join_refusal(self.tokens, hello.token)))
        self._greeting.pop(conn_id, None)
        if (refused := self._refusals.pop(conn_id, None)) is not None:
            await close_connection(ws, protocol.session, *refused, request.transport)
            return None
        return conn

    async def _next_event(self, ws: web.WebSocketResponse, protocol: hp.HubProtocol,
                          conn: PeerConn | None, request: web.Request) -> hp.Event | None:
        """The peer's next event, or None once the connection ends (closed here if need be)."""
        peer_timeout_s = self.cfg.network.peer_timeout_s
        try:  # before its hello, nothing keeps a silent connection in check
            frame = await ws.receive(None if conn else peer_timeout_s)
        except TimeoutError:
            await close_connection(ws, protocol.session, m.CLOSE_TIMEOUT,
                                   f"no hello within {peer_timeout_s:.0f} s", request.transport)
            return None
        if frame.type in _ENDED:
            return None
        data = frame.data if frame.type in (WSMsgType.BINARY, WSMsgType.TEXT) else None
        try:
            event = protocol.receive_frame(data, loop_now())
        except RemoteProtocolError as exc:
            self.feed(ev.ProtocolBroken(conn.peer_id if conn else None,
                                        exc.kind if isinstance(exc, Flooding) else None))
            log.info("closing %s: %s", conn.peer_id if conn else request.remote, exc.reason)
            await close_connection(ws, protocol.session, exc.code, exc.reason, request.transport,
                                   fault=True)
            return None
        if (pause_s := protocol.pause_s(loop_now())) > 0:  # over its read budget: a rate limit,
            await asyncio.sleep(pause_s)  # not a sync; backpressures this peer
        return None if isinstance(event, hp.GoodbyeReceived) else event

    async def _write(self, conn: PeerConn) -> None:
        """Drain the outbox into the socket; a send stalled past the deadline cuts the peer."""
        if await write_outbox(conn, self.cfg.network.peer_timeout_s):
            self.feed(ev.PeerStalled(conn.peer_id))

    async def _keep_alive(self, conn: PeerConn) -> None:
        net, tokens = self.cfg.network, self.tokens
        await keep_alive(conn, net.heartbeat_s, net.peer_timeout_s, loop_now,
                         lambda: join_refusal(tokens, conn.hello.token, joining=False))
