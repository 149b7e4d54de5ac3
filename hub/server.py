"""The hub's network shell: one websocket per peer, a frame pump around the core.

`handle_ws` feeds each frame to the peer's `echo2p2p.hub_protocol.HubProtocol` (validation,
the state table, credits, versions held), which returns an event; a table sends each kind to
the part it concerns: lease requests to `dispatch`, rollouts to `hub.admission.Admission`,
transfer reports to `hub.tracker.VersionTracker`, relay reports to `hub.accusations.Accusations`.
Replies go into the peer's outbox, drained by a writer task under a deadline (`hub.peers`), so
a peer that stops reading is cut off instead of stalling the others. A misbehaving peer is
closed with a code and a short reason; nothing it sends reaches the learner unvalidated.

`Hub` wires the parts (lease book, buffer, tracker, admission, trust guard, activation pool,
relay judge, tokens) and grants leases. The learner loop (`echo2p2p.hub.trainer`) calls
`wait_batch`, `finish_step`, `publish`, `dispatch` and `checkpoint` here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.buffer import RolloutBuffer, ScoredGroup
from echo2p2p.completions import CompletionDecoder
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.leases import LeaseBook, shuffled_epochs
from echo2p2p.pool import Pool
from echo2p2p.runtime.process import loop_now as _now
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.staleness import lease_min_version
from echo2p2p.trust import TrustBook, TrustPolicy

from .accusations import Accusations
from .admission import Admission
from .app import serve
from .config import HubConfig
from .checkpoint import hub_state, restore_hub
from .counters import Changes, Counters, HubStatistics
from .door import Door
from .durable import Journal
from .peers import PeerConn, close_connection, keep_alive, write_outbox
from .quarantine import TrustGuard
from .leasing import Quotas, new_lease_id
from .task_setup import TaskSetup, TokenizedProblem
from .tokens import TokenBook, join_refusal
from .tracker import VersionTracker
from .versions import Published

if TYPE_CHECKING:  # hub.spotcheck imports torch, which `echo2-hub --help` must not wait for
    from .spotcheck import SpotChecker

log = logging.getLogger(__name__)

__all__ = ["Counters", "Hub", "HubStatistics", "TokenizedProblem", "serve"]

_ENDED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


class Hub:
    """Peers, leases and admitted rollouts; owned by one event loop."""

    def __init__(self, cfg: HubConfig, run_id: str, task: Any, problems: list[TokenizedProblem],
                 signing_key: bytes = b"",
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 spot: SpotChecker | None = None, decode: CompletionDecoder | None = None,
                 setup: TaskSetup | None = None):
        """`signing_key`: the hub's Ed25519 private key, for the tickets it hands peers (b"": a
        bench rig without tickets; manifests are signed by the caller). `spot`: recomputes the
        behaviour logprobs of a share of the rollouts (None: no spot-checks). `decode`: the
        run's tokenizer as `echo2p2p.completions.CompletionDecoder`, which rollouts are scored by
        (None: a hub that refuses every rollout, e.g. a broadcast bench). `setup`: how
        `task` is scored (None: by its own reward; `hub.task_setup`)."""
        self.cfg, self.run_id, self.task, self._signing_key = cfg, run_id, task, signing_key
        self.setup = setup or TaskSetup.builtin(task)
        self.hub_key = signing.public_key(signing_key) if signing_key else b""
        self.model_index = (b"", b"")  # GET /model/'s (digest, signature), set where served
        self.step = 0  # the run's one step counter: the learner's version is this
        self.training = False  # a batch was taken and step `step` is running on it
        self.leases: LeaseBook[TokenizedProblem] = LeaseBook(
            problems, cfg.lease_timeout_s, shuffled_epochs(len(problems), cfg.seed), None, new_lease_id)
        self.buffer = RolloutBuffer(cfg.max_lag)
        self.peers: dict[str, PeerConn] = {}
        self.counters = Counters()
        self.pool = Pool(cfg.activation, cfg.activation_margin)
        self.tokens = TokenBook(cfg.tokens) if cfg.tokens else None
        self.door = Door(cfg, self.tokens, self.counters)  # who may join now
        self.trust = TrustBook(TrustPolicy(probation_checks=cfg.spot_check_probation))
        self.on_event = on_event or (lambda record: None)
        self.changes = Changes()  # what the wait_... methods wait on
        log_event = lambda record: self.on_event(record)  # noqa: E731 (late-bound)
        self.tracker = VersionTracker(
            cfg, self.peers, self.pool, quarantined=lambda conn: self.guard.quarantined(conn),
            on_event=log_event, now=_now)
        self.guard = TrustGuard(self.trust, self.leases, route_around=self.tracker.route_around,
                                withdraw=lambda identity: self.admission.withdraw(identity),
                                dispatch=self.dispatch, step=lambda: self.step,
                                on_event=self.changes.after(log_event))
        self.accusations = Accusations(self, signing_key, new_peer_id=self._new_peer_id)
        self.relays = self.accusations.relays  # tests read its verdicts
        self.chunk_lookup, self.chunk_served = self.tracker.chunk_lookup, self.tracker.chunk_served
        self._next_peer = 0
        self.spot = spot
        self.scorer = None if decode is None else Scorer(  # its workers start on the first rollout
            self.setup.reward, decoder=decode, timeout_s=cfg.score_timeout_s,
            sample_budget_s=cfg.score_sample_budget_s,
            workers=cfg.score_workers, name="hub-scorer")
        self.admission = Admission(
            cfg, self.leases, self.buffer, self.pool, self.counters, self.guard,
            scorer=self.scorer, spot=spot, step=lambda: self.step,
            newest_version=lambda: self.tracker.newest_version, dispatch=self.dispatch,
            journal=self._journal, on_event=log_event, now=_now,
            vocab_size=decode.vocab_size if decode is not None else None, setup=self.setup)
        self.quotas = Quotas(cfg, self.peers, self.leases, self.guard, self.counters, self.admission.quota)
        self.journal: Journal | None = None  # where changes since the last checkpoint go
        self.leases.on_change = lambda change: self._journal("lease", *change)
        self._on = {hp.CreditsAdded: lambda conn, event: self.dispatch(),
                    hp.RolloutReceived: lambda conn, e: self.admission.submit(conn, e.submission),
                    hp.HoldingReported: self._holding,
                    hp.TransferReported: lambda c, e: self.tracker.transfer_reported(c, e.report),
                    hp.RelayAccused: lambda conn, e: self.accusations.heard(conn, e.report),
                    hp.HeartbeatReceived: lambda conn, event: None}

    # --- what the tracker keeps, under the names the learner loop and tests use --------

    published = property(lambda self: self.tracker.published)
    broadcasts = property(lambda self: self.tracker.broadcasts)
    propagation = property(lambda self: self.tracker.propagation)
    newest: Published | None = property(lambda self: self.tracker.newest)  # type: ignore[assignment]

    def publish(self, version: Published) -> None:  # newest now, announced with a relay plan
        self.tracker.publish(version)

    # --- learner-facing --------------------------------------------------------------

    async def wait_batch(self) -> list[ScoredGroup]:
        """Block until `prompts_per_step` fresh groups are queued for the current step."""
        n = self.cfg.prompts_per_step
        for group in self.buffer.drop_stale(self.step):
            log.debug("dropped %s: v%d is too stale for step %d", group.lease_id, group.version,
                      self.step)
        admitted = self.admission.admitted
        while len(self.buffer) < n or (batch := self.buffer.take_batch(self.step, n)) is None:
            admitted.clear()
            self.dispatch()  # stale drops may have freed lease budget
            await admitted.wait()
        self.training = True
        return batch

    def finish_step(self) -> None:
        """The learner finished the step whose batch `wait_batch` gave: one version on."""
        self.step += 1
        self.training = False
        self.changes.notify()

    def dispatch(self) -> None:
        """Grant leases to peers with credits as budget and quotas (`hub.leasing`) allow, newest first."""
        cfg = self.cfg
        ready = sorted((p for p in self.peers.values() if p.credits > 0
                        and self.pool.is_active(p.peer_id) and not self.guard.quarantined(p)
                        and not self.admission.over_budget(p)),
                       key=lambda p: -1 if p.held_version is None else p.held_version, reverse=True)
        holdings = self.quotas.holdings()
        while ready:  # round-robin over the peers, newest version first
            for conn in list(ready):
                outstanding = self.leases.open_count + len(self.buffer) + len(self.admission.judging)
                if conn.credits <= 0 or conn.ws.closed or \
                        not self.quotas.allows(conn, outstanding, holdings):
                    ready.remove(conn)
                    continue
                lease = self.leases.grant(conn.peer_id, _now(), lease_min_version(
                    self.step, self.training, self.quotas.ahead(outstanding, holdings),
                    cfg.prompts_per_step, cfg.max_lag))
                holdings.add(conn, self.quotas.book)
                conn.protocol.take_credit(lease.lease_id)
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
        """Re-choose the active peers for `required` rollouts/s (None: all; see echo2p2p.pool).
        Called by the learner loop every step (drift) and here on join and leave."""
        activated, standby = self.pool.replan(required, _now())
        if not (activated or standby):
            return
        for peer_id in activated:
            if self.cfg.standby == "cold" and (conn := self.peers.get(peer_id)) is not None:
                self.tracker.catch_up(conn)
        record = self.pool.activation_record(self.step, required, activated, standby)
        log.info("activation at step %d: +%s -%s; %d active, $%.2f/h", self.step, activated,
                 standby, len(record["active"]), record["usd_per_hour"])
        self.on_event(record)
        self.dispatch()

    async def expire_leases(self) -> None:
        """Forever: re-issue leases whose deadline passed."""
        while True:
            await asyncio.sleep(min(1.0, self.cfg.lease_timeout_s / 4))  # a timer, not a sync
            if late := self.leases.expire(_now()):
                self.quotas.expired(late)  # hoarding costs
                self.dispatch()

    # --- what the hub says of itself -------------------------------------------------

    def statistics(self) -> HubStatistics:
        """A frozen look at the hub: peers, queues, leases and counters."""
        counted = self.counters.totals()
        return HubStatistics(
            step=self.step, training=self.training, newest_version=self.tracker.newest_version,
            peers=len(self.peers), active_peers=sum(map(self.pool.is_active, self.peers)),
            quarantined_peers=sum(map(self.guard.quarantined, self.peers.values())),
            queued_groups=len(self.buffer), open_leases=self.leases.open_count,
            judging=len(self.admission.judging),
            relay_reports=sum(self.counters.relay_reports.values()),
            catch_up_builds=self.tracker.catchups.encodes,
            catch_up_shared=self.tracker.catchups.shared, **counted)

    async def wait_peers(self, n: int) -> None:
        """Return once exactly `n` peers are connected (joined and not yet left)."""
        await self.changes.wait_for(lambda: len(self.peers) == n)

    async def wait_step(self, step: int) -> None:
        """Return once the learner has reached `step` (`finish_step`)."""
        await self.changes.wait_for(lambda: self.step >= step)

    async def wait_quarantined(self) -> None:
        """Return once some identity is quarantined."""
        await self.changes.wait_for(lambda: bool(self.trust.quarantined))

    # --- connections ------------------------------------------------------------------

    async def handle_ws(self, request: web.Request) -> web.WebSocketResponse:
        """The frame pump of one peer connection."""
        # aiohttp's own limit is a backstop that closes with 1009 and no reason; frames between
        # max_frame_bytes and twice that get our close with a readable reason.
        ws = web.WebSocketResponse(max_msg_size=2 * self.cfg.max_frame_bytes, compress=False)
        await ws.prepare(request)
        protocol = hp.HubProtocol(_now(), self.cfg.max_frame_bytes)
        conn: PeerConn | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                helpers: list[asyncio.Task] = []
                while (event := await self._next_event(ws, protocol, conn, request)) is not None:
                    if not isinstance(event, hp.HelloReceived):
                        self._on[type(event)](conn, event)
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
                self._leave(conn)
        return ws

    async def _next_event(self, ws: web.WebSocketResponse, protocol: hp.HubProtocol,
                          conn: PeerConn | None, request: web.Request) -> hp.Event | None:
        """The peer's next event, or None once the connection ends (closed here if need be)."""
        try:  # before its hello, nothing keeps a silent connection in check
            frame = await ws.receive(None if conn else self.cfg.peer_timeout_s)
        except TimeoutError:
            await close_connection(ws, protocol.session, m.CLOSE_TIMEOUT,
                                   f"no hello within {self.cfg.peer_timeout_s:.0f} s",
                                   request.transport)
            return None
        if frame.type in _ENDED:
            return None
        data = frame.data if frame.type in (WSMsgType.BINARY, WSMsgType.TEXT) else None
        try:
            event = protocol.receive_frame(data, _now())
        except RemoteProtocolError as exc:
            self.counters.closed_for_protocol += 1
            log.info("closing %s: %s", conn.peer_id if conn else request.remote, exc.reason)
            await close_connection(ws, protocol.session, exc.code, exc.reason, request.transport)
            return None
        if (pause_s := protocol.pause_s(_now())) > 0:  # over its read budget: a rate limit,
            await asyncio.sleep(pause_s)  # not a sync; backpressures this peer
        return None if isinstance(event, hp.GoodbyeReceived) else event

    async def _greet(self, ws: web.WebSocketResponse, protocol: hp.HubProtocol, hello: m.Hello,
                     request: web.Request) -> PeerConn | None:
        """Join the peer that said `hello`, or close it (`hub.door`: joining too often, no
        valid token, a crowded address)."""
        refused = self.door.refusal(hello, request.remote, self.peers.values(), _now())
        if refused is not None:
            await close_connection(ws, protocol.session, *refused, request.transport)
            return None
        return self._join(ws, protocol, hello, request.transport, request.remote)

    def _join(self, ws: web.WebSocketResponse, protocol: hp.HubProtocol, hello: m.Hello,
              transport: asyncio.BaseTransport | None, remote: str | None = None) -> PeerConn:
        self._next_peer += 1
        self._journal("peer", self._next_peer)  # a resumed hub never hands out an id again
        peer_id = f"p{self._next_peer}"
        conn = PeerConn(peer_id, hello, ws, protocol, transport, remote=remote)
        cfg, newest, key = self.cfg, self.newest, self._signing_key
        conn.post(m.Welcome(
            peer_id, self.run_id, cfg.model, self.setup.kind, newest.version if newest else 0,
            cfg.max_lag, cfg.group_size, cfg.temperature, cfg.top_p, cfg.max_new_tokens,
            cfg.seed * 100_003 + self._next_peer, self.hub_key,
            signing.sign_ticket(key, self.run_id, peer_id, hello.peer_key) if key else b"",
            signing.sign_welcome(key, hello.nonce, self.run_id, peer_id, hello.peer_key)
            if key and hello.nonce else b"", *self.model_index, self.setup.env,
            self.setup.env_version))
        self.peers[peer_id] = conn
        self.pool.join(peer_id, hello.name, hello.price_per_hour, hello.engine != "relay", _now())
        self.relays.probe(conn, newest.version if newest else 0)
        self.tracker.catch_up(conn)
        log.info("peer joined: %s (%s, %s on %s, $%.2f/h)", peer_id, hello.name, hello.engine,
                 hello.device, hello.price_per_hour)
        self.replan(self.pool.required)
        self.changes.notify()
        return conn

    def _leave(self, conn: PeerConn) -> None:
        self.peers.pop(conn.peer_id, None)
        self.pool.leave(conn.peer_id, _now())
        back = self.leases.release_peer(conn.peer_id)
        self.quotas.left(conn)
        log.info("peer left: %s (%s); %d leases re-queued", conn.peer_id, conn.hello.name, len(back))
        self.tracker.peer_left(conn.peer_id)
        self.replan(self.pool.required)
        self.dispatch()
        self.changes.notify()

    def _holding(self, conn: PeerConn, event: hp.HoldingReported) -> None:
        if conn.protocol.note_held(event.version, self.tracker.newest_version):
            log.debug("%s holds v%d", conn.peer_id, event.version)  # tests/chaos reads it
            self.tracker.holding_reported(conn, event.version)  # T_bcast counts the reload

    def _new_peer_id(self) -> str:
        """A peer id never handed out before, for the hub's own gossip checks (a liar must not
        tell them from a neighbour that joined)."""
        self._next_peer += 1
        self._journal("peer", self._next_peer)
        return f"p{self._next_peer}"

    async def _write(self, conn: PeerConn) -> None:
        """Drain the outbox into the socket; a send stalled past the deadline cuts the peer."""
        if await write_outbox(conn, self.cfg.peer_timeout_s):
            self.counters.cut_off += 1

    async def _keep_alive(self, conn: PeerConn) -> None:
        await keep_alive(conn, self.cfg.heartbeat_s, self.cfg.peer_timeout_s, _now,
                         lambda: join_refusal(self.tokens, conn.hello.token, joining=False))

    async def close_all(self, reason: str = "hub shutting down") -> None:
        await self.admission.cancel()
        if self.scorer is not None:
            self.scorer.close()
        await self.accusations.close()
        for conn in list(self.peers.values()):
            await conn.close(m.CLOSE_GOING_AWAY, reason)

    # --- durability (echo2p2p.hub.durable) -------------------------------------------

    def _journal(self, kind: str, *record: Any) -> None:
        if self.journal is not None:
            self.journal.write([kind, *record])

    def checkpoint(self, journal: Journal | None) -> dict[str, Any]:
        """What a checkpoint keeps of the hub, as plain data (see hub.checkpoint); from now on
        its changes go to `journal` (the last one closed): in one go, so none falls between."""
        if self.journal is not None:
            self.journal.close()
        self.journal = journal
        return hub_state(self.run_id, self.step, self._next_peer, self.leases, self.buffer,
                         self.trust)

    def restore(self, state: dict[str, Any], journal: list[list]) -> None:
        """Come back to `state` plus the journal after it; the caller restores the learner."""
        self.step = state["step"]
        self._next_peer = restore_hub(state, journal, self.leases, self.buffer, self.trust, _now())
