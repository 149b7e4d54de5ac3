"""The hub's network shell: one websocket per peer, pumping frames through the core.

Each connection's handler reads a frame, feeds it to its `Session` (validation and the state
table live there), and acts on the message: leases from the `LeaseBook`, rollouts through
`echo2p2p.hub.admission` into the `RolloutBuffer`, acks and rejects back. Replies never wait on a
socket: they go into the peer's outbox, which a writer task drains under a deadline, so one peer
that stops reading is closed instead of stalling lease dispatch for all. Another task per connection
sends heartbeats. A misbehaving peer is closed with a code and a short reason; nothing it sends
reaches the learner unvalidated or stops the other peers.

Versions: the hub is the overlay's tracker. `publish` announces each version to every peer
(as a delta to those that hold its base, else in full) with a relay plan per manifest
(`echo2p2p.relay.Broadcast`); chunks then move over HTTP (`chunk_lookup` serves the hub's
share). Plans are re-dealt when a relaying peer leaves or is reported; each peer's report of a
finished transfer feeds its measured upload bandwidth and the per-version propagation record.

The learner loop itself lives in `echo2p2p.hub.trainer`; it calls `publish`, `dispatch` and
`wait_batch` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.buffer import RolloutBuffer, ScoredGroup
from echo2p2p.errors import ConfigError, RemoteProtocolError
from echo2p2p.leases import LeaseBook, shuffled_epochs
from echo2p2p.relay import Broadcast, Member
from echo2p2p.completions import CompletionDecoder
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.session import Session, Side, State
from echo2p2p.staleness import lease_budget, min_fresh_version
from echo2p2p.tasks import Problem

from echo2p2p.runtime import http_deadlines
from echo2p2p.overlay.serving import TokenBucket, UploadMeter, chunk_handler
from echo2p2p.overlay.store import GONE
from echo2p2p.overlay.tickets import Credentials, Tickets

from echo2p2p.trust import TrustBook

from .admission import Admission
from .config import HubConfig
from .durable import Journal
from .peers import PeerConn
from .pool import Pool
from .relays import RelayCheck, RelayJudge
from .tokens import TokenBook
from .versions import Propagation, Published, Snapshot

if TYPE_CHECKING:  # hub.spotcheck imports torch, which `echo2-hub --help` must not wait for
    from .spotcheck import SpotChecker

log = logging.getLogger(__name__)

CLOSE_DEADLINE_S = 5.0  # how long a close may take before the connection is cut


@dataclass(frozen=True)
class TokenizedProblem:
    problem: Problem
    prompt_ids: list[int]


@dataclass
class Counters:
    admitted_groups: int = 0
    admitted_samples: int = 0
    stale_on_arrival: int = 0
    rejected: int = 0
    duplicates: int = 0
    closed_for_protocol: int = 0
    refused: int = 0  # joins without a valid token
    cut_off: int = 0  # peers that stopped reading
    spot_checked: int = 0  # submissions whose logprobs or version tag were checked
    spot_failed: int = 0  # of those, forged (see hub.spotcheck)
    relay_reports: Counter[tuple[str, str]] = field(default_factory=Counter)  # (peer, reason)


class Hub(Admission):
    """Peers, leases and admitted rollouts; owned by one event loop."""

    def __init__(self, cfg: HubConfig, run_id: str, task: Any, problems: list[TokenizedProblem],
                 signing_key: bytes = b"",
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 spot: SpotChecker | None = None, decode: CompletionDecoder | None = None):
        """`signing_key`: the hub's Ed25519 private key, for the tickets it hands peers (b"": a
        bench rig without tickets; manifests are signed by the caller). `spot`: recomputes the
        behaviour logprobs of a share of the rollouts (None: no spot-checks). `decode`: the
        run's tokenizer as `echo2p2p.completions.CompletionDecoder`, which rollouts are scored by
        (None: a hub that refuses every rollout, e.g. a broadcast bench)."""
        self.cfg = cfg
        self._signing_key = signing_key
        self.hub_key = signing.public_key(signing_key) if signing_key else b""
        self.run_id = run_id
        self.task = task
        self.step = 0  # == the learner's version
        self.training = False  # a batch was taken and step `step` is running on it
        self.leases: LeaseBook[TokenizedProblem] = LeaseBook(
            problems, cfg.lease_timeout_s, shuffled_epochs(len(problems), cfg.seed))
        self.buffer = RolloutBuffer(cfg.max_lag)
        self.peers: dict[str, PeerConn] = {}
        self.counters = Counters()
        self.published: dict[int, Published] = {}  # the newest cfg.keep_versions
        self.broadcasts: dict[tuple[int, int | None], Broadcast] = {}
        self.propagation: dict[int, Propagation] = {}
        self.pool = Pool(cfg.activation, cfg.activation_margin)
        self.tokens = TokenBook(cfg.tokens) if cfg.tokens else None
        self.trust = TrustBook()
        credentials = Credentials(run_id, "hub", signing_key, signing.sign_ticket(
            signing_key, run_id, "hub", self.hub_key)) if signing_key else None
        self.relays = RelayJudge(RelayCheck(credentials), distrust=self._distrust,
                                 failed=self._relay_failed,
                                 on_event=lambda r: self.on_event({**r, "step": self.step}))
        self.on_event = on_event or (lambda record: None)
        self._admitted = asyncio.Event()
        self._next_peer = 0
        self.spot = spot
        self._checks: set[asyncio.Task] = set()  # submissions being judged (echo2p2p.hub.admission)
        self.scorer = None if decode is None else Scorer(  # its workers start on the first rollout
            task.reward, decoder=decode, timeout_s=cfg.score_timeout_s,
            workers=cfg.score_workers, name="hub-scorer")
        self.journal: Journal | None = None  # where changes since the last checkpoint go
        self.leases.on_change = lambda change: self._journal("lease", *change)

    # --- learner-facing --------------------------------------------------------------

    async def wait_batch(self) -> list[ScoredGroup]:
        """Block until `prompts_per_step` fresh groups are queued for the current step."""
        n = self.cfg.prompts_per_step
        for group in self.buffer.drop_stale(self.step):
            log.debug("dropped %s: v%d is too stale for step %d", group.lease_id, group.version,
                      self.step)
        while len(self.buffer) < n or (batch := self.buffer.take_batch(self.step, n)) is None:
            self._admitted.clear()
            self.dispatch()  # stale drops may have freed lease budget
            await self._admitted.wait()
        self.training = True
        return batch

    def finish_step(self, version: int) -> None:
        """The learner finished the step whose batch `wait_batch` gave: it is at `version`."""
        self.step = version
        self.training = False

    @property
    def newest(self) -> Published | None:
        return self.published[max(self.published)] if self.published else None

    def publish(self, version: Published) -> None:
        """Make `version` the newest and announce it to every peer, with a relay plan."""
        for old in list(self.propagation.values()):
            self._report_propagation(old, final=True)  # superseded: say how far it got
        self.published[version.version] = version
        for old in sorted(self.published)[:-self.cfg.keep_versions]:
            del self.published[old]
        self.broadcasts = {k: b for k, b in self.broadcasts.items() if k[0] in self.published}
        conns = [c for c in self.peers.values() if c.session.state is State.READY
                 and (self.cfg.standby == "warm" or self.pool.is_active(c.peer_id))]
        delta = version.delta
        on_delta = [c for c in conns
                    if delta is not None and c.stream_version == delta.manifest.base_version]
        in_full = [c for c in conns if c not in on_delta]
        self.propagation[version.version] = Propagation(
            version.version, _now(), {c.peer_id for c in conns}, on_delta=len(on_delta))
        for snap, members in ((delta, on_delta), (version.full, in_full)):
            if not members:
                continue
            broadcast = self._broadcast(snap)
            plan = broadcast.start([self._member(c) for c in members])
            for conn in members:
                conn.announced = version.version
                conn.post(m.VersionAnnouncement(snap.manifest, plan, snap.signature))

    def _broadcast(self, snap: Snapshot) -> Broadcast:
        key = (snap.manifest.version, snap.manifest.base_version)
        if key not in self.broadcasts:
            self.broadcasts[key] = Broadcast(*key, len(snap.chunks), self.cfg.relay)
        return self.broadcasts[key]

    async def chunk_lookup(self, version: int, base: int | None, index: int, wait_s: float) -> bytes:
        """The hub's side of GET /chunk/...: it holds every chunk of the versions it keeps."""
        snap = self._snapshot(version, base)
        if snap is None or not 0 <= index < len(snap.chunks):
            return GONE
        return snap.chunks[index]

    def chunk_served(self, version: int, nbytes: int) -> None:
        if (prop := self.propagation.get(version)) is not None:
            prop.bytes_from_hub += nbytes
            prop.hub_sent_after_s = _now() - prop.started

    def dispatch(self) -> None:
        """Grant leases to peers with credits while the budget allows, newest holders first."""
        cfg = self.cfg
        ready = sorted((p for p in self.peers.values() if p.credits > 0
                        and self.pool.is_active(p.peer_id) and not self._quarantined(p)),
                       key=lambda p: -1 if p.held_version is None else p.held_version, reverse=True)
        while ready:  # round-robin over the peers, newest version first
            for conn in list(ready):
                outstanding = self.leases.open_count + len(self.buffer) + len(self._checks)
                if outstanding >= lease_budget(cfg.prompts_per_step, cfg.max_lag):
                    return
                if conn.credits <= 0 or conn.ws.closed:
                    ready.remove(conn)
                    continue
                # The group will be trained on once the batches ahead of it are consumed (and
                # after the step running now, whose batch has left the buffer).
                consume_step = self.step + self.training + outstanding // cfg.prompts_per_step
                lease = self.leases.grant(conn.peer_id, _now(),
                                          min_fresh_version(consume_step, cfg.max_lag))
                conn.credits -= 1
                log.debug("granted %s (problem %d) to %s", lease.lease_id, lease.index, conn.peer_id)
                p = lease.problem
                conn.post(m.LeaseGrant(
                    lease.lease_id, p.problem.id, p.problem.prompt, p.prompt_ids, p.problem.answer,
                    cfg.group_size, cfg.lease_timeout_s, lease.min_version))

    @staticmethod
    def now() -> float:
        """The hub's clock (the event loop's), which the pool's cost meter runs on."""
        return _now()

    def replan(self, required: float | None) -> None:
        """Re-choose the active peers for `required` rollouts/s (None: all; see hub.pool).
        Called by the learner loop every step (drift) and here on join and leave."""
        now = _now()
        activated, standby = self.pool.replan(required, now)
        if not (activated or standby):
            return
        for peer_id in activated:
            if self.cfg.standby == "cold" and (conn := self.peers.get(peer_id)) is not None:
                self._catch_up(conn)
        plan = self.pool.plan
        record = {"event": "activation", "step": self.step, "required_rollouts_per_s": required,
                  "activated": activated, "standby": standby,
                  "active": sorted(p for p in self.pool.accounts if self.pool.is_active(p)),
                  "usd_per_hour": round(self.pool.usd_per_hour(), 4),
                  "lp_bound_usd_per_hour": self.pool.lp_bound(),
                  "planned_rollouts_per_s": round(plan.rollouts_per_s, 3) if plan else None}
        log.info("activation at step %d: +%s -%s; %d active, $%.2f/h", self.step, activated,
                 standby, len(record["active"]), record["usd_per_hour"])
        self.on_event(record)
        self.dispatch()

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
                while True:
                    try:  # before its hello, nothing keeps a silent connection in check
                        frame = await ws.receive(None if conn else self.cfg.peer_timeout_s)
                    except TimeoutError:
                        await _close(ws, session, m.CLOSE_TIMEOUT,
                                     f"no hello within {self.cfg.peer_timeout_s:.0f} s",
                                     request.transport)
                        break
                    if frame.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                        break
                    try:
                        msg = session.receive(self._frame_bytes(frame), _now())
                    except RemoteProtocolError as exc:
                        self.counters.closed_for_protocol += 1
                        log.info("closing %s: %s", conn.peer_id if conn else request.remote, exc.reason)
                        await _close(ws, session, exc.code, exc.reason, request.transport)
                        break
                    if (pause_s := session.pause_s(_now())) > 0:  # over its read budget: a rate
                        await asyncio.sleep(pause_s)  # limit, not a sync; backpressures this peer
                    if isinstance(msg, m.Hello):
                        if (why := self._refusal(msg.token)) is not None:
                            self.counters.refused += 1
                            log.info("refused %s: %s", request.remote, why)
                            await _close(ws, session, m.CLOSE_UNAUTHORIZED, why, request.transport)
                            break
                        if self._crowded(request.remote):
                            self.counters.refused += 1
                            await _close(ws, session, m.CLOSE_TOO_MANY, "too many connections "
                                         "from this address", request.transport)
                            break
                        conn = self._join(ws, session, msg, request.transport, request.remote)
                        helpers = [tg.create_task(self._write(conn)),
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

    def _crowded(self, remote: str | None) -> bool:
        """Whether `remote` already holds its cap of joined connections (one attacker's many
        connections are bounded; a lab behind one NAT raises --max-peers-per-address)."""
        return sum(c.remote == remote for c in self.peers.values()) >= self.cfg.max_peers_per_address

    def _join(self, ws: web.WebSocketResponse, session: Session, hello: m.Hello,
              transport: asyncio.BaseTransport | None, remote: str | None = None) -> PeerConn:
        self._next_peer += 1
        self._journal("peer", self._next_peer)  # a resumed hub never hands out an id again
        peer_id = f"p{self._next_peer}"
        conn = PeerConn(peer_id, hello, ws, session, transport, remote=remote)
        cfg = self.cfg
        newest = self.newest
        key = self._signing_key
        conn.post(m.Welcome(
            peer_id, self.run_id, cfg.model, self.task.kind, newest.version if newest else 0,
            cfg.max_lag, cfg.group_size, cfg.temperature, cfg.top_p, cfg.max_new_tokens,
            cfg.seed * 100_003 + self._next_peer, self.hub_key,
            signing.sign_ticket(key, self.run_id, peer_id, hello.peer_key) if key else b"",
            signing.sign_welcome(key, hello.nonce, self.run_id, peer_id, hello.peer_key)
            if key and hello.nonce else b""))
        self.peers[peer_id] = conn
        self.pool.join(peer_id, hello.name, hello.price_per_hour, hello.engine != "relay", _now())
        self.relays.probe(conn, newest.version if newest else 0)
        self._catch_up(conn)
        log.info("peer joined: %s (%s, %s on %s, $%.2f/h)", peer_id, hello.name, hello.engine,
                 hello.device, hello.price_per_hour)
        self.replan(self.pool.required)
        return conn

    def _catch_up(self, conn: PeerConn) -> None:
        """A late joiner, or a cold standby peer put to work, pulls the newest version in full."""
        newest = self.newest
        if newest is None or conn.announced >= newest.version:
            return
        conn.announced = newest.version
        broadcast = self._broadcast(newest.full)
        plan = (broadcast.join(self._member(conn)) if broadcast.members
                else broadcast.start([self._member(conn)]))
        conn.post(m.VersionAnnouncement(newest.full.manifest, plan, newest.full.signature))

    def _leave(self, conn: PeerConn) -> None:
        self.peers.pop(conn.peer_id, None)
        self.pool.leave(conn.peer_id, _now())
        back = self.leases.release_peer(conn.peer_id)
        log.info("peer left: %s (%s); %d leases re-queued", conn.peer_id, conn.hello.name, len(back))
        for broadcast in self.broadcasts.values():
            self._reroute(broadcast, conn.peer_id)
        for prop in list(self.propagation.values()):
            self._report_propagation(prop)
        self.replan(self.pool.required)
        self.dispatch()

    def _reroute(self, broadcast: Broadcast, peer_id: str) -> None:
        """Deal `peer_id`'s chunks to other relays and tell every member still here."""
        plan = broadcast.drop(peer_id)
        if plan is None:
            return
        for member in broadcast.members:
            if (conn := self.peers.get(member)) is not None:
                conn.post(plan)

    def _on_message(self, conn: PeerConn, msg: m.Message) -> None:
        if isinstance(msg, m.LeaseRequest):
            conn.credits = min(conn.credits + max(msg.n, 0), 64)
            self.dispatch()
        elif isinstance(msg, m.RolloutSubmission):
            self._on_rollout(conn, msg)
        elif isinstance(msg, m.VersionHeld):
            if self.newest is None or msg.version > self.newest.version:
                return  # a version this hub never published: nobody could hold it
            conn.held_version = msg.version
            conn.held_max = max(conn.held_max, msg.version)
            log.debug("%s holds v%d", conn.peer_id, msg.version)
        elif isinstance(msg, m.TransferReport):
            self._on_transfer(conn, msg)
        elif isinstance(msg, m.RelayReport):
            self._on_relay_report(conn, msg)
        # Heartbeat: the session already noted that the peer is alive.

    def _on_transfer(self, conn: PeerConn, msg: m.TransferReport) -> None:
        snap = self._snapshot(msg.version, msg.base_version)
        if snap is None:
            return
        conn.stream_version = max(msg.version, conn.stream_version or 0)
        prop = self.propagation.get(msg.version)
        if prop is None or conn.peer_id not in prop.expected or conn.peer_id in prop.done_after_s:
            return  # not a version being tracked, or not the first report: nothing to count
        prop.done_after_s[conn.peer_id] = _now() - prop.started
        prop.count(conn.peer_id, msg, snap.wire_bytes)
        self._report_propagation(prop)

    def _snapshot(self, version: int, base: int | None) -> Snapshot | None:
        """The published manifest (version, base) this hub still keeps, if any."""
        pub = self.published.get(version)
        snap = pub and (pub.full if base is None else pub.delta)
        return snap if snap is not None and snap.manifest.base_version == base else None

    def _on_relay_report(self, conn: PeerConn, msg: m.RelayReport) -> None:
        """An accusation: the hub looks for itself before anything follows from it."""
        accused = self.peers.get(msg.peer_id)
        if accused is None or accused is conn or msg.reason not in m.RELAY_FAULTS:
            return  # nonsense, or about a peer already gone (and so already routed around)
        self.counters.relay_reports[(msg.peer_id, msg.reason)] += 1
        log.info("%s reports relay %s on v%d: %s", conn.peer_id, msg.peer_id, msg.version,
                 msg.reason)
        # Only a chunk the accuser was told to fetch from the accused is worth a look.
        broadcast = self.broadcasts.get((msg.version, msg.base_version))
        snap = self._snapshot(msg.version, msg.base_version)
        if (snap is not None and broadcast is not None and conn.peer_id in broadcast.members
                and broadcast.owner(msg.index) == accused.peer_id):
            self.relays.accused(conn, accused, msg.reason, snap.manifest, msg.index)

    def _relay_failed(self, conn: PeerConn) -> None:
        """`conn`'s chunk server failed the hub's own check: route around it everywhere."""
        for broadcast in self.broadcasts.values():
            self._reroute(broadcast, conn.peer_id)

    def _report_propagation(self, prop: Propagation, final: bool = False) -> None:
        """Log how `prop`'s version spread, once every expected peer that is still here has it
        (or, `final`, once a newer version supersedes it)."""
        waiting = {p for p in prop.expected - prop.done_after_s.keys() if p in self.peers}
        if waiting and not final:
            return
        del self.propagation[prop.version]
        if not prop.expected:
            return  # published before any peer joined: nothing spread
        for peer_id, rate in prop.upload_rates().items():
            if (conn := self.peers.get(peer_id)) is not None:
                conn.upload_bps = rate if not conn.upload_bps else 0.5 * (conn.upload_bps + rate)
        # Complete: every expected peer still here has it, and one at least did (when all
        # left before finishing, there is no spread to time).
        record = prop.record(self.published.get(prop.version),
                             complete=not waiting and bool(prop.done_after_s))
        record["peer_upload_mbps"] = {c.peer_id: round(c.upload_bps / 1e6, 2)
                                      for c in self.peers.values() if c.upload_bps}
        self.on_event(record)

    def _member(self, conn: PeerConn) -> Member:
        return conn.member(relays=not self._quarantined(conn))

    def _quarantined(self, conn: PeerConn) -> bool:
        return conn.identity in self.trust.quarantined

    def _distrust(self, conn: PeerConn, event: str) -> None:
        """Count `event` against `conn`; on quarantine: no more leases (open ones go back to
        the queue), its relays routed around, and a run log record."""
        if not self.trust.record(conn.identity, event):
            return
        back = self.leases.release_peer(conn.peer_id)
        for broadcast in self.broadcasts.values():
            self._reroute(broadcast, conn.peer_id)
        record = {"event": "quarantine", "step": self.step, "peer": conn.peer_id,
                  "name": conn.hello.name, "identity": conn.identity,
                  "score": round(self.trust.score(conn.identity), 3),
                  "events": self.trust.events[conn.identity], "leases_requeued": len(back)}
        log.warning("quarantined %s (%s): %s", conn.peer_id, conn.hello.name, record["events"])
        self.on_event(record)
        self.dispatch()

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
            if (why := self._refusal(conn.hello.token, joining=False)) is not None:  # revoked
                await _close(conn.ws, conn.session, m.CLOSE_UNAUTHORIZED, why, conn.transport)
                return
            conn.post(m.Heartbeat())

    def _refusal(self, token: str, joining: bool = True) -> str | None:
        """Why a peer with `token` may not be here, or None (also when no token is required).
        While the token file cannot be read, new peers are refused and connected ones stay."""
        try:
            return self.tokens.refusal(token) if self.tokens is not None else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("cannot read the token file %s: %s", self.tokens.path, exc)
            return "the hub cannot check join tokens now" if joining else None

    async def close_all(self, reason: str = "hub shutting down") -> None:
        checks = list(self._checks)
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
        if self.scorer is not None:
            self.scorer.close()
        await self.relays.close()
        for conn in list(self.peers.values()):
            await _close(conn.ws, conn.session, m.CLOSE_GOING_AWAY, reason, conn.transport)


@contextlib.asynccontextmanager
async def serve(hub: Hub, host: str, port: int, routes: dict[str, Any] | None = None
                ) -> AsyncIterator[int]:
    """Serve the peers' websocket (/ws), the hub's chunks (/chunk/...) and any extra GET
    `routes` on host:port; yields the bound port. Peers are sent away on exit."""
    app = web.Application()
    app.router.add_get("/ws", hub.handle_ws)
    limiter = TokenBucket(hub.cfg.upload_limit_mbps * 1e6) if hub.cfg.upload_limit_mbps else None
    app.router.add_get("/chunk/{version}/{base}/{index}", chunk_handler(
        hub.chunk_lookup, UploadMeter(), limiter, on_served=hub.chunk_served,
        authorize=Tickets(hub.hub_key, hub.run_id, "hub")))
    for path, handler in (routes or {}).items():
        app.router.add_get(path, handler)
    runner = http_deadlines.runner(app)  # idle and request-head deadlines
    await runner.setup()
    tls = None
    if hub.cfg.tls_cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            tls.load_cert_chain(hub.cfg.tls_cert, hub.cfg.tls_key)
        except (OSError, ssl.SSLError) as exc:
            await runner.cleanup()
            raise ConfigError("tls_cert", f"cannot load {hub.cfg.tls_cert} with key "
                                          f"{hub.cfg.tls_key}: {exc}") from None
    try:
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
        yield runner.addresses[0][1]
    finally:
        await hub.close_all()
        await runner.cleanup()


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
