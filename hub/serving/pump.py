"""The frame pump of one peer connection: frames in, events out, the connection's helpers.

`pump` reads each frame of a peer's websocket into its `echo2p2p.hub_protocol.HubProtocol`
and hands what the protocol makes of it to the hub: the hello to `greet` (the joined
`PeerConn`, or None: refused and closed), every later event through the `on` table, and the
end of the connection to `leave`. A frame that breaks the protocol closes the connection with
its code and a short reason (one of a kind sent far past its rate, `Flooding`, is first handed
to `on[Flooding]`: it costs trust); a connection with no hello within `peer_timeout_s` is
closed; a peer over its read budget is paused, not closed. Beside the pump run the peer's writer (its
outbox under a deadline) and keep-alive (`hub.serving.peers`). It knows nothing of leases, versions or
rollouts: the hub's handlers do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import WSMsgType, web

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m
from echo2p2p.errors import Flooding, RemoteProtocolError
from echo2p2p.negotiation import SPEAKS, Speaks
from echo2p2p.runtime.process import loop_now

from ..config import HubConfig
from .peers import PeerConn, close_connection, keep_alive, write_outbox
from .tokens import TokenBook, join_refusal

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side

_ENDED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)

Greet = Callable[[web.WebSocketResponse, hp.HubProtocol, m.Hello, web.Request],
                 Awaitable[PeerConn | None]]


async def pump(request: web.Request, cfg: HubConfig, counters: Any, tokens: TokenBook | None, *,
               greet: Greet, on: Mapping[type, Callable[[PeerConn, Any], None]],
               leave: Callable[[PeerConn], None], speaks: Speaks = SPEAKS) -> web.WebSocketResponse:
    """Serve one peer connection until it ends. `counters`: the hub's `Counters` (protocol
    closes, cut-offs); `tokens`: the join tokens a connected peer must still hold (None: none
    needed); `greet`, `on`, `leave`: the hub's handlers; `speaks`: the protocol versions and
    features the hello is answered with (`echo2p2p.negotiation`)."""
    # aiohttp's own limit is a backstop that closes with 1009 and no reason; frames between
    # max_frame_bytes and twice that get our close with a readable reason.
    ws = web.WebSocketResponse(max_msg_size=2 * cfg.limits.max_frame_bytes, compress=False)
    try:
        await ws.prepare(request)
    except ConnectionError:  # it left mid-handshake (a peer stopping): nothing to serve or log
        return ws
    protocol = hp.HubProtocol(loop_now(), cfg.limits.max_frame_bytes, speaks=speaks)
    conn: PeerConn | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            helpers: list[asyncio.Task] = []
            while (event := await _next_event(ws, protocol, conn, request, cfg.network.peer_timeout_s,
                                              counters, on)) is not None:
                if not isinstance(event, hp.HelloReceived):
                    on[type(event)](conn, event)
                elif (conn := await greet(ws, protocol, event.hello, request)) is None:
                    break
                else:
                    helpers = [tg.create_task(_write(conn, cfg.network.peer_timeout_s, counters)),
                               tg.create_task(_keep_alive(conn, cfg, tokens))]
            for task in helpers:
                task.cancel()
    except Exception:
        # The one per-connection boundary: a bug while serving this peer closes this peer
        # only. The details go to our log, never to the peer.
        log.exception("internal error serving %s", conn.peer_id if conn else request.remote)
        await ws.close(code=1011, message=b"internal error")
    finally:
        if conn is not None:
            leave(conn)
    return ws


async def _next_event(ws: web.WebSocketResponse, protocol: hp.HubProtocol, conn: PeerConn | None,
                      request: web.Request, peer_timeout_s: float, counters: Any,
                      on: Mapping[type, Callable[[PeerConn, Any], None]]) -> hp.Event | None:
    """The peer's next event, or None once the connection ends (closed here if need be)."""
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
        counters.closed_for_protocol += 1
        if isinstance(exc, Flooding) and conn is not None:
            on[Flooding](conn, exc)
        log.info("closing %s: %s", conn.peer_id if conn else request.remote, exc.reason)
        await close_connection(ws, protocol.session, exc.code, exc.reason, request.transport,
                               fault=True)
        return None
    if (pause_s := protocol.pause_s(loop_now())) > 0:  # over its read budget: a rate limit,
        await asyncio.sleep(pause_s)  # not a sync; backpressures this peer
    return None if isinstance(event, hp.GoodbyeReceived) else event


async def _write(conn: PeerConn, peer_timeout_s: float, counters: Any) -> None:
    """Drain the outbox into the socket; a send stalled past the deadline cuts the peer."""
    if await write_outbox(conn, peer_timeout_s):
        counters.cut_off += 1


async def _keep_alive(conn: PeerConn, cfg: HubConfig, tokens: TokenBook | None) -> None:
    await keep_alive(conn, cfg.network.heartbeat_s, cfg.network.peer_timeout_s, loop_now,
                     lambda: join_refusal(tokens, conn.hello.token, joining=False))
