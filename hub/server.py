"""The hub's network shell: one websocket per peer, pumping frames through the core.

Each connection's handler reads a frame, feeds it to its `Session` (validation and the state
table live there), and acts on the message: leases from the `LeaseBook`, admission by the
staleness rule into the `RolloutBuffer`, acks and rejects back. Replies never wait on a socket:
they go into the peer's outbox, which a writer task drains under a deadline, so one peer that
stops reading is closed instead of stalling lease dispatch for all. Two more tasks per connection
send heartbeats and the newest published version. A misbehaving peer is closed with a code and a
short reason; nothing it sends reaches the learner unvalidated or stops the other peers.

The learner loop itself lives in `hub.trainer`; it calls `publish`, `dispatch` and
`wait_batch` here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from echo2p2p import messages as m
from echo2p2p.buffer import RolloutBuffer, ScoredGroup
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.leases import Completion, LeaseBook, shuffled_epochs
from echo2p2p.session import Session, Side, State
from echo2p2p.staleness import Verdict, judge, lease_budget, min_fresh_version
from echo2p2p.tasks import Problem

from .config import HubConfig

log = logging.getLogger(__name__)

CLOSE_DEADLINE_S = 5.0  # how long a close may take before the connection is cut


@dataclass(frozen=True)
class TokenizedProblem:
    problem: Problem
    prompt_ids: list[int]


@dataclass
class PeerConn:
    """The hub's view of one connected peer."""

    peer_id: str
    hello: m.Hello
    ws: web.WebSocketResponse
    session: Session
    transport: asyncio.BaseTransport | None
    credits: int = 0
    held_version: int | None = None
    sent_version: int = -1
    outbox: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)

    def post(self, msg: m.Message) -> None:
        """Queue `msg` for this peer's writer task; never waits on the socket."""
        if self.session.state is not State.CLOSED:  # else the connection is going: drop it
            self.outbox.put_nowait(self.session.send(msg))


@dataclass(frozen=True)
class Snapshot:
    manifest: m.Manifest
    chunks: list[bytes]
    signature: bytes = b""


@dataclass
class Counters:
    admitted_groups: int = 0
    admitted_samples: int = 0
    stale_on_arrival: int = 0
    rejected: int = 0
    duplicates: int = 0
    closed_for_protocol: int = 0
    cut_off: int = 0  # peers that stopped reading


class Hub:
    """Peers, leases and admitted rollouts; owned by one event loop."""

    def __init__(self, cfg: HubConfig, run_id: str, task: Any, problems: list[TokenizedProblem],
                 hub_key: bytes = b""):
        self.cfg = cfg
        self.hub_key = hub_key
        self.run_id = run_id
        self.task = task
        self.step = 0  # == the learner's version
        self.leases: LeaseBook[TokenizedProblem] = LeaseBook(
            problems, cfg.lease_timeout_s, shuffled_epochs(len(problems), cfg.seed))
        self.buffer = RolloutBuffer(cfg.max_lag)
        self.peers: dict[str, PeerConn] = {}
        self.counters = Counters()
        self.snapshot: Snapshot | None = None
        self._published = asyncio.Condition()
        self._admitted = asyncio.Event()
        self._next_peer = 0

    # --- learner-facing --------------------------------------------------------------

    async def wait_batch(self) -> list[ScoredGroup]:
        """Block until `prompts_per_step` fresh groups are queued for the current step."""
        n = self.cfg.prompts_per_step
        while len(self.buffer) < n or (batch := self.buffer.take_batch(self.step, n)) is None:
            self._admitted.clear()
            self.dispatch()  # stale drops may have freed lease budget
            await self._admitted.wait()
        return batch

    async def publish(self, snapshot: Snapshot) -> None:
        """Make `snapshot` the newest version; every connection's feeder sends it."""
        async with self._published:
            self.snapshot = snapshot
            self._published.notify_all()

    def dispatch(self) -> None:
        """Grant leases to peers with credits while the budget allows, newest holders first."""
        cfg = self.cfg
        ready = sorted((p for p in self.peers.values() if p.credits > 0),
                       key=lambda p: -1 if p.held_version is None else p.held_version, reverse=True)
        while ready:  # round-robin over the peers, newest version first
            for conn in list(ready):
                outstanding = self.leases.open_count + len(self.buffer)
                if outstanding >= lease_budget(cfg.prompts_per_step, cfg.max_lag):
                    return
                if conn.credits <= 0 or conn.ws.closed:
                    ready.remove(conn)
                    continue
                # The group will be trained on once the batches ahead of it are consumed.
                consume_step = self.step + outstanding // cfg.prompts_per_step
                lease = self.leases.grant(conn.peer_id, _now(),
                                          min_fresh_version(consume_step, cfg.max_lag))
                conn.credits -= 1
                p = lease.problem
                conn.post(m.LeaseGrant(
                    lease.lease_id, p.problem.id, p.problem.prompt, p.prompt_ids, p.problem.answer,
                    cfg.group_size, cfg.lease_timeout_s, lease.min_version))

    async def expire_leases(self) -> None:
        """Forever: re-issue leases whose deadline passed."""
        while True:
            await asyncio.sleep(min(1.0, self.cfg.lease_timeout_s / 4))  # a timer, not a sync
            if self.leases.expire(_now()):
                self.dispatch()

    # --- connections ------------------------------------------------------------------

    async def handle_ws(self, request: web.Request) -> web.WebSocketResponse:
        # aiohttp's own limit is a backstop that closes with 1009 and no reason; frames between
        # max_frame_bytes and twice that get our close with a readable reason.
        ws = web.WebSocketResponse(max_msg_size=2 * self.cfg.max_frame_bytes, compress=False)
        await ws.prepare(request)
        session = Session(Side.HUB, _now())
        conn: PeerConn | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                helpers: list[asyncio.Task] = []
                async for frame in ws:
                    try:
                        msg = session.receive(self._frame_bytes(frame), _now())
                    except RemoteProtocolError as exc:
                        self.counters.closed_for_protocol += 1
                        log.info("closing %s: %s", conn.peer_id if conn else request.remote, exc.reason)
                        await _close(ws, session, exc.code, exc.reason, request.transport)
                        break
                    if isinstance(msg, m.Hello):
                        conn = self._join(ws, session, msg, request.transport)
                        helpers = [tg.create_task(self._write(conn)),
                                   tg.create_task(self._feed_versions(conn)),
                                   tg.create_task(self._keep_alive(conn))]
                    elif isinstance(msg, m.Goodbye):
                        break
                    else:
                        self._on_message(conn, msg)
                for task in helpers:
                    task.cancel()
        except Exception:
            # The one per-connection boundary: a bug while serving this peer closes this peer
            # only. The details go to our log, never to the peer.
            log.exception("internal error serving %s", conn.peer_id if conn else request.remote)
            await ws.close(code=1011, message=b"internal error")
        finally:
            if conn is not None:
                self._leave(conn)
        return ws

    def _frame_bytes(self, frame: Any) -> bytes:
        if frame.type is WSMsgType.TEXT:
            raise RemoteProtocolError("text frames are not part of the protocol", m.CLOSE_UNSUPPORTED_DATA)
        if frame.type is not WSMsgType.BINARY:
            raise RemoteProtocolError("unexpected websocket frame", m.CLOSE_PROTOCOL_ERROR)
        if len(frame.data) > self.cfg.max_frame_bytes:
            raise RemoteProtocolError(
                f"frame of {len(frame.data)} bytes exceeds the {self.cfg.max_frame_bytes} byte limit",
                m.CLOSE_TOO_BIG)
        return frame.data

    def _join(self, ws: web.WebSocketResponse, session: Session, hello: m.Hello,
              transport: asyncio.BaseTransport | None) -> PeerConn:
        self._next_peer += 1
        peer_id = f"p{self._next_peer}"
        conn = PeerConn(peer_id, hello, ws, session, transport)
        cfg = self.cfg
        conn.post(m.Welcome(
            peer_id, self.run_id, cfg.model, self.task.kind,
            self.snapshot.manifest.version if self.snapshot else 0, cfg.max_lag, cfg.group_size,
            cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.seed * 100_003 + self._next_peer,
            self.hub_key))
        self.peers[peer_id] = conn
        log.info("peer joined: %s (%s, %s on %s, $%.2f/h)", peer_id, hello.name, hello.engine,
                 hello.device, hello.price_per_hour)
        return conn

    def _leave(self, conn: PeerConn) -> None:
        self.peers.pop(conn.peer_id, None)
        back = self.leases.release_peer(conn.peer_id)
        log.info("peer left: %s (%s); %d leases re-queued", conn.peer_id, conn.hello.name, len(back))
        self.dispatch()

    def _on_message(self, conn: PeerConn, msg: m.Message) -> None:
        if isinstance(msg, m.LeaseRequest):
            conn.credits = min(conn.credits + max(msg.n, 0), 64)
            self.dispatch()
        elif isinstance(msg, m.RolloutSubmission):
            self._on_rollout(conn, msg)
        elif isinstance(msg, m.VersionHeld):
            conn.held_version = msg.version
            log.debug("%s holds v%d", conn.peer_id, msg.version)
        # Heartbeat: the session already noted that the peer is alive.

    def _on_rollout(self, conn: PeerConn, msg: m.RolloutSubmission) -> None:
        outcome, lease = self.leases.complete(msg.lease_id, conn.peer_id)
        if outcome is Completion.DUPLICATE:
            self.counters.duplicates += 1
            conn.post(m.Ack(msg.lease_id, duplicate=True))
            return
        if lease is None:
            self.counters.rejected += 1
            conn.post(m.Reject(msg.lease_id, outcome.value))
            return
        verdict = judge(self.step, msg.version, self.cfg.max_lag)
        if verdict is not Verdict.FRESH:
            self.leases.requeue(lease)
            self.counters.stale_on_arrival += 1
            conn.post(m.Reject(msg.lease_id, verdict.value))
            self.dispatch()
            return
        problem = lease.problem.problem
        # Re-score with the task's own verifier: a peer's claimed reward is never used.
        rewards = [self.task.reward(problem.answer, s.text) for s in msg.samples]
        self.buffer.put(ScoredGroup(msg.lease_id, problem.id, lease.problem.prompt_ids,
                                    msg.version, msg.samples, rewards))
        self.counters.admitted_groups += 1
        self.counters.admitted_samples += len(msg.samples)
        self._admitted.set()
        conn.post(m.Ack(msg.lease_id))

    async def _feed_versions(self, conn: PeerConn) -> None:
        """Send each newly published version's manifest and chunks; skip to the newest."""
        while True:
            async with self._published:
                await self._published.wait_for(
                    lambda: self.snapshot is not None and self.snapshot.manifest.version > conn.sent_version)
                snap = self.snapshot
            version = snap.manifest.version
            conn.post(m.VersionAnnouncement(snap.manifest, snap.signature))
            for index, chunk in enumerate(snap.chunks):
                if self.snapshot.manifest.version != version:
                    break  # a newer one exists: the peer should not finish this one
                conn.post(m.ChunkData(version, index, chunk))
                await conn.outbox.join()  # one chunk queued at a time: the socket paces us
            conn.sent_version = version

    async def _write(self, conn: PeerConn) -> None:
        """Drain the outbox into the socket; a send stalled past the deadline closes the peer."""
        while True:
            frame = await conn.outbox.get()
            try:
                async with asyncio.timeout(self.cfg.peer_timeout_s):
                    await conn.ws.send_bytes(frame)
            except TimeoutError:
                # A peer that does not read cannot take a Goodbye or a close frame either.
                log.warning("cutting off %s: not reading, a send stalled for %.0f s",
                            conn.peer_id, self.cfg.peer_timeout_s)
                self.counters.cut_off += 1
                if conn.transport is not None:
                    conn.transport.abort()
                return
            except ConnectionError:
                return  # the socket is going; the reader sees it close
            finally:
                conn.outbox.task_done()

    async def _keep_alive(self, conn: PeerConn) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)  # a timer, not a sync
            if conn.session.silent_for(_now()) > self.cfg.peer_timeout_s:
                await _close(conn.ws, conn.session, m.CLOSE_TIMEOUT,
                             f"silent for over {self.cfg.peer_timeout_s:.0f} s", conn.transport)
                return
            conn.post(m.Heartbeat())

    async def close_all(self, reason: str = "hub shutting down") -> None:
        for conn in list(self.peers.values()):
            await _close(conn.ws, conn.session, m.CLOSE_GOING_AWAY, reason, conn.transport)


async def _close(ws: web.WebSocketResponse, session: Session, code: int, reason: str,
                 transport: asyncio.BaseTransport | None) -> None:
    """Say why (Goodbye), then close with the same code and reason. A peer that does not read
    cannot take even that, so after CLOSE_DEADLINE_S the connection is cut."""
    try:
        async with asyncio.timeout(CLOSE_DEADLINE_S):
            if not ws.closed and session.state is not State.CLOSED:
                try:
                    await ws.send_bytes(session.send(m.Goodbye(code, reason)))
                except ConnectionError:
                    pass  # the socket is already going; the close below still says why
            await ws.close(code=code, message=reason.encode()[:120])
    except TimeoutError:
        if transport is not None:
            transport.abort()


def _now() -> float:
    return asyncio.get_running_loop().time()
