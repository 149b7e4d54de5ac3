"""The peer's connection to its hub: open the websocket, shake hands, send under a deadline.

`connect` opens the websocket and runs the handshake (Hello -> Welcome, checked by the core's
`echo2p2p.peer_protocol.PeerProtocol`: the pinned key, the proof over our fresh nonce) under
`connect_timeout_s`, closing the socket on any failure; a hub that refuses our protocol version
(close 4000, with or without its goodbye) ends in `JoinRefused`: its sentence, no retry.
`HubConnection` is one live connection: its protocol, the HTTP session downloads use, and `send`, which gives up on a hub
that takes nothing for `hub_timeout_s` and then cancels the connection's task. `Backoff` is
the reconnect schedule the client's run loop follows. It decides nothing about messages (the
protocol does) and never retries by itself.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from dataclasses import dataclass

import aiohttp

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.errors import JoinRefused, ProtocolError, RemoteProtocolError
from echo2p2p.peer_protocol import PeerProtocol
from echo2p2p.runtime.process import loop_now

from .config import PeerConfig

log = logging.getLogger(__name__)


@dataclass
class HubConnection:
    ws: aiohttp.ClientWebSocketResponse
    protocol: PeerProtocol
    http: aiohttp.ClientSession
    hub_base_url: str  # http(s)://HOST:PORT of the hub, for its chunk route
    send_deadline_s: float
    task: asyncio.Task | None  # the connection's own task, cancelled if the hub stops reading
    tg: asyncio.TaskGroup | None = None
    lock: asyncio.Lock | None = None

    async def send(self, msg: m.Message) -> None:
        if self.lock is None:
            self.lock = asyncio.Lock()
        frame = self.protocol.send(msg)
        async with self.lock:
            try:
                async with asyncio.timeout(self.send_deadline_s):
                    await self.ws.send_bytes(frame)
            except TimeoutError:
                log.warning("the hub took nothing for %.0f s: dropping the connection",
                            self.send_deadline_s)
                if self.task is not None and self.task is not asyncio.current_task():
                    self.task.cancel()
                raise ConnectionError("send to the hub stalled") from None

    async def close(self, code: int, reason: str) -> None:
        if not self.ws.closed:
            await self.ws.close(code=code, message=reason.encode()[:120])


async def connect(http: aiohttp.ClientSession, url: str, cfg: PeerConfig, key,
                  served_url: str | None) -> tuple[aiohttp.ClientWebSocketResponse,
                                                   PeerProtocol, m.Welcome]:
    """Open the websocket to `url` and shake hands under the connect deadline; `key` is our
    private key (the hub's ticket binds its public half). Never leaves the socket open on a
    failure, a timeout included."""
    async with asyncio.timeout(cfg.connect_timeout_s):
        ws = await http.ws_connect(url, max_msg_size=cfg.max_frame_bytes, compress=0)
        try:
            protocol, welcome = await _handshake(ws, url, cfg, key, served_url=served_url)
        except BaseException as exc:
            code = exc.code if isinstance(exc, ProtocolError) else m.CLOSE_GOING_AWAY
            await ws.close(code=code, message=b"handshake failed")
            raise
    return ws, protocol, welcome


async def _handshake(ws: aiohttp.ClientWebSocketResponse, url: str, cfg: PeerConfig, key,
                     *, served_url: str | None) -> tuple[PeerProtocol, m.Welcome]:
    """Hello -> Welcome, checked by the protocol (the caller adopts the welcome)."""
    peer_key = signing.public_key(key)
    nonce = secrets.token_bytes(32)
    protocol = PeerProtocol(loop_now(), hub_url=url, peer_key=peer_key, nonce=nonce,
                            pinned_hub_key=cfg.pinned_hub_key)
    await ws.send_bytes(protocol.hello(m.Hello(
        cfg.display_name, cfg.engine, cfg.device, cfg.price_per_hour, served_url,
        cfg.token, nonce, peer_key, dtype=cfg.engine_dtype)))
    frame = await ws.receive()
    if frame.type is aiohttp.WSMsgType.CLOSE and frame.data == m.CLOSE_BAD_PROTOCOL_VERSION:
        raise JoinRefused(frame.extra or "the hub does not speak this peer's protocol version")
    if frame.type is not aiohttp.WSMsgType.BINARY:
        raise RemoteProtocolError(f"hub closed before welcome ({ws.close_code})")
    return protocol, protocol.receive_welcome(frame.data, loop_now())


class Backoff:
    """Capped exponential backoff with jitter: 0.5 s, then doubling up to `max_s`, each delay
    drawn in [half, all] of it so that peers a hub dropped together do not return together."""

    FIRST_S = 0.5

    def __init__(self, max_s: float):
        self.max_s = max_s
        self._next_s = self.FIRST_S

    def reset(self) -> None:
        """We were welcomed: the next failure starts over."""
        self._next_s = self.FIRST_S

    def delay(self) -> float:
        """The wait before the next attempt (and the one after grows)."""
        delay = self._next_s * random.uniform(0.5, 1.0)
        self._next_s = min(self._next_s * 2, self.max_s)
        return delay


def hub_base_url(ws_url: str) -> str:
    """http://HOST:PORT of the hub, whose chunk route sits beside its websocket."""
    scheme, rest = ws_url.split("://", 1)
    return f"{'https' if scheme == 'wss' else 'http'}://{rest.split('/', 1)[0]}"
