"""The hub's network shell: one websocket per peer, a frame pump around the core.

Each peer's frames go through its `echo2p2p.hub_protocol.HubProtocol` (`hub.serving.pump`), which
returns events; a table sends each kind to the part it concerns: lease requests to `dispatch`,
rollouts to `hub.serving.admission.Admission`, transfer reports to
`hub.core.tracker.VersionTracker`, relay reports to `hub.core.accusations.Accusations` (what
those two ask for beyond a send: `hub.serving.overlay_shell`). Replies go into the peer's outbox
(`hub.serving.peers`). A misbehaving peer is closed with a code and a short reason; nothing it
sends reaches the learner unvalidated.

`Hub` is the front: it builds its parts in dependency order (lease book, buffer, pool, door,
trust book, tracker, trust guard, relay judges, scorer, admission, quotas), each given only what
it uses, and grants leases. Parts report up through return values or one channel each (a run
log record; the trust guard's quarantine), never by reaching into another part. The learner
loop (`echo2p2p.hub.learning.loop`) calls `wait_batch`, `finish_step`, `publish`, `dispatch`,
`replan` and `checkpoint`; everyone else (/status, /metrics, the dashboard, the step record,
tests and benches) reads `statistics()`, `peer_views()` and waits with `wait_<condition>()`.

Over 400 lines: `Hub` still wires its parts' callbacks itself (join, leave, dispatch, judging,
quarantine, durability); the sans-IO hub core (issue 44) takes the decisions out of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.buffer import RolloutBuffer, ScoredGroup
from echo2p2p.errors import Flooding
from echo2p2p.completions import CompletionDecoder
from echo2p2p.lease_quota import LeaseQuota, QuotaPolicy
from echo2p2p.leases import LeaseBook, shuffled_epochs
from echo2p2p.negotiation import LEAF_NOTICE, SPEAKS
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S
from echo2p2p.overlay.serving import TokenBucket, UploadMeter, chunk_handler
from echo2p2p.overlay.tickets import Tickets
from echo2p2p.pool import Pool
from echo2p2p.relay import Broadcast
from echo2p2p.runtime.process import loop_now
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.staleness import lease_min_version
from echo2p2p.trust import TrustBook, TrustPolicy

from ..core.accusations import Accusations
from .admission import Admission, AdmissionRules
from ..config import HubConfig
from ..learning.checkpoint import hub_state, restore_hub
from .counters import Changes, Counters, HubStatistics, PeerView, peer_view, statistics_of
from .door import Door
from ..learning.durable import Journal
from .peers import PeerConn, close_connection
from .pump import pump
from .quarantine import TrustGuard
from .leasing import Quotas, grant_of, new_lease_id
from ..tasks.task_setup import TaskSetup, TokenizedProblem
from .tokens import TokenBook
from ..core.tracker import VersionTracker
from ..overlay.seeding import watched
from ..overlay.versions import Published, Snapshot
from .overlay_shell import OverlayShell

if TYPE_CHECKING:  # hub.spotcheck imports torch, which `echo2-hub --help` must not wait for
    from .spotcheck import SpotChecker

log = logging.getLogger(__name__)

__all__ = ["Hub", "HubStatistics", "PeerView", "TokenizedProblem"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Hub:
    """Peers, leases and admitted rollouts; owned by one event loop."""

    def __init__(self, cfg: HubConfig, run_id: str, task: Any, problems: list[TokenizedProblem],
                 signing_key: bytes = b"",
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 spot: SpotChecker | None = None, decode: CompletionDecoder | None = None,
                 setup: TaskSetup | None = None):
        """`signing_key`: the hub's Ed25519 private key, for the tickets it hands peers (b"": a
        bench rig without tickets). `spot`: recomputes the behaviour logprobs of a share of the
        rollouts (None: no spot-checks). `decode`: the run's tokenizer, which rollouts are
        scored by (None: a hub that refuses every rollout, e.g. a broadcast bench). `setup`:
        how `task` is scored (None: by its own reward; `hub.tasks.task_setup`)."""
        self.cfg, self.run_id, self.task, self._signing_key = cfg, run_id, task, signing_key
        self.setup = setup or TaskSetup.builtin(task)
        self.hub_key = signing.public_key(signing_key) if signing_key else b""
        self.model_index = (b"", b"")  # GET /model/'s (digest, signature), set where served
        self.step = 0  # the run's one step counter: the learner's version is this
        self.speaks = SPEAKS  # what hellos are answered with (a test's hub may speak others)
        self._training = False  # a batch was taken and step `step` is running on it
        self._changes = Changes()  # what `until` waits on: every event the hub handles
        self._on_event = self._changes.after(on_event or (lambda record: None))
        self._journal_to: Journal | None = None  # where changes since the last checkpoint go
        self._next_peer = 0
        self._peers: dict[str, PeerConn] = {}
        self._judging: set[asyncio.Task] = set()  # one per submission being scored or checked
        self._dispatch_due = False  # a lease pass is scheduled for the end of this loop turn
        # The parts, each built after what it uses.
        self._counters = Counters()
        self._leases: LeaseBook[TokenizedProblem] = LeaseBook(
            problems, cfg.staleness.lease_timeout_s, shuffled_epochs(len(problems), cfg.run.seed),
            lambda change: self._journal("lease", *change), new_lease_id)
        self._buffer = RolloutBuffer(cfg.staleness.max_lag)
        self._pool = Pool(cfg.staleness.activation, cfg.staleness.activation_margin)
        self._tokens = TokenBook(cfg.network.tokens) if cfg.network.tokens else None
        self._trust = TrustBook(TrustPolicy(probation_checks=cfg.trust.spot_check_probation))
        trust = self._trust  # its quarantined set is replaced on restore: looked up each time
        self._overlay = OverlayShell(signing_key, run_id, new_peer_id=self._new_peer_id, now=loop_now,
                                     record=self._overlay_record, changed=self._changes.notify)
        self._tracker = VersionTracker(cfg.overlay, self._peers, self._pool, self._overlay.outbox,
                                       quarantined=lambda c: c.identity in trust.quarantined)
        self._guard = TrustGuard(self._trust, self._leases, self._buffer, self._counters,
                                 journal=self._journal, on_quarantine=self._quarantine,
                                 route_around=lambda p: self._tracker.route_around(p, loop_now()))
        self._door = Door(cfg.limits, self._tokens, self._counters, self._guard)  # who may join
        self._accusations = Accusations(
            cfg.overlay.relay, self._peers, self._tracker, self._overlay.outbox, self._counters,
            distrust=self._guard.distrust, tickets=bool(signing_key),
            min_rate_bytes_s=MIN_RATE_BYTES_S)
        self._overlay.bind(self._tracker, self._accusations)
        self._spot = spot
        self.scorer = None if decode is None else Scorer(  # its workers start on the first rollout
            self.setup.reward, decoder=decode, timeout_s=cfg.scoring.score_timeout_s,
            sample_budget_s=cfg.scoring.score_sample_budget_s,
            workers=cfg.scoring.score_workers, name="hub-scorer")
        quota = LeaseQuota(QuotaPolicy(start=cfg.staleness.new_peer_leases))  # earned by admissions
        self._admission = Admission(
            AdmissionRules.of(cfg, self.setup, decode.vocab_size if decode is not None else None),
            self._leases, self._buffer, self._pool, self._counters, self._guard, quota,
            scorer=self.scorer, spot=spot, journal=self._journal, on_event=self._dated)
        self._quotas = Quotas(cfg, self._peers, self._leases, self._guard, self._counters, quota,
                              self._pool.gen_rollouts_per_s, lambda: self._tracker.newest_version)
        self.chunk_lookup = self._overlay.chunk_lookup  # the hub's chunks (tests wrap it)

    def publish(self, version: Published) -> None:
        """`version` is the newest now, announced to the peers with a relay plan."""
        self._tracker.publish(version, loop_now())
        self._changes.notify()

    async def wait_batch(self) -> list[ScoredGroup]:
        """Block until `prompts_per_step` fresh groups are queued for the current step."""
        n = self.cfg.grpo.prompts_per_step
        for group in self._buffer.drop_stale(self.step):
            log.debug("dropped %s: v%d is too stale for step %d", group.lease_id, group.version,
                      self.step)
        admitted = self._admission.admitted
        while len(self._buffer) < n or (batch := self._buffer.take_batch(self.step, n)) is None:
            admitted.clear()
            self.dispatch()  # stale drops may have freed lease budget
            await admitted.wait()
        self._training = True
        return batch

    def finish_step(self) -> None:
        """The learner finished the step whose batch `wait_batch` gave: one version on."""
        self.step += 1
        self._training = False
        self._changes.notify()

    def dispatch(self) -> None:
        """Grant leases to peers with credits as budget and quotas (`hub.serving.leasing`)
        allow, newest first, at the end of this event loop turn: every frame read in one turn
        (a credit, a judged group) asks for a pass, and one pass serves them all (at 64 peers,
        a pass per frame was most of the hub's time: `bench/ingest.py`)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): now
            return self._dispatch()
        if not self._dispatch_due:
            self._dispatch_due = True
            loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._dispatch_due = False
        cfg, outstanding = self.cfg, self._leases.open_count + len(self._buffer) + len(self._judging)
        if self._quotas.full(outstanding):
            return
        ready = sorted((p for p in self._peers.values() if p.credits > 0
                        and self._pool.is_active(p.peer_id) and not self._guard.quarantined(p)
                        and not self._admission.over_budget(p)),
                       key=lambda p: -1 if p.held_version is None else p.held_version, reverse=True)
        holdings = self._quotas.holdings()
        while ready:  # round-robin over the peers, newest version first
            for conn in list(ready):
                if conn.credits <= 0 or conn.ws.closed or \
                        not self._quotas.allows(conn, outstanding, holdings):
                    ready.remove(conn)
                    continue
                now = loop_now()
                lease = self._leases.grant(conn.peer_id, now, lease_min_version(
                    self.step, self._training, self._quotas.ahead(outstanding, holdings),
                    cfg.grpo.prompts_per_step, cfg.staleness.max_lag),
                    *self._quotas.wait_s(conn, holdings))  # its place in the peer's queue
                holdings.add(conn, self._quotas.book, self._quotas.ready(lease))
                outstanding += 1
                conn.protocol.take_credit(lease.lease_id)
                log.debug("granted %s (problem %d) to %s", lease.lease_id, lease.index, conn.peer_id)
                conn.post(grant_of(lease, cfg.grpo.group_size, now))
        self._changes.notify()

    def replan(self, required: float | None) -> None:
        """Re-choose the active peers for `required` rollouts/s (None: all; see echo2p2p.pool).
        Called by the learner loop every step (drift) and here on join and leave."""
        activated, standby = self._pool.replan(required, loop_now())
        if not (activated or standby):
            return
        for peer_id in activated:
            if self.cfg.overlay.standby == "cold" and (conn := self._peers.get(peer_id)) is not None:
                self._tracker.catch_up(conn, loop_now())
        record = self._pool.activation_record(self.step, required, activated, standby)
        log.info("activation at step %d: +%s -%s; %d active, $%.2f/h", self.step, activated,
                 standby, len(record["active"]), record["usd_per_hour"])
        self._on_event(record)
        self.dispatch()

    async def expire_leases(self) -> None:
        """Forever: re-issue leases whose deadline passed, and tell the rejections not told."""
        while True:
            await asyncio.sleep(min(1.0, self.cfg.staleness.lease_timeout_s / 4))  # a timer, not a sync
            self._admission.rejections.flush(loop_now())  # the summary of rejections, if due
            if late := self._leases.expire(loop_now()):
                self._quotas.expired(late)  # hoarding costs
                self.dispatch()
                self._changes.notify()

    def _dated(self, record: dict[str, Any]) -> None:
        """A part's run log record, dated by the learner's step."""
        self._on_event({**record, "step": self.step})

    def _overlay_record(self, record: dict[str, Any]) -> None:
        """An overlay part's run log record: a relay check's dated by the learner's step."""
        (self._dated if record.get("event") == "relay_check" else self._on_event)(record)

    def _quarantine(self, record: dict[str, Any]) -> None:
        """An identity was quarantined: logged, waiters woken, its leases' budget dealt anew."""
        self._dated(record)
        self._changes.notify()
        self.dispatch()

    def _submitted(self, conn: PeerConn, event: hp.RolloutReceived) -> None:
        """A rollout submission, for `hub.serving.admission`; its judging runs as a task here."""
        judging = self._admission.submit(conn, event.submission, self.step,
                                         self._tracker.newest_version, loop_now())
        if judging is True:
            self.dispatch()
        elif judging is not False:
            task = asyncio.create_task(judging)
            self._judging.add(task)
            task.add_done_callback(self._judged)

    def _judged(self, task: asyncio.Task) -> None:
        """A submission was judged. Admitted, it holds the same lease budget in the buffer;
        otherwise the budget it held is free again (a crash is logged; its prompt went back)."""
        self._judging.discard(task)
        self._changes.notify()
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("judging a rollout failed", exc_info=task.exception())
        elif task.result():
            return
        self.dispatch()

    # --- what the hub says of itself -------------------------------------------------

    def statistics(self) -> HubStatistics:
        """A frozen look at the hub: peers, queues, leases, trust, versions and counters."""
        return statistics_of(
            self.step, self._training, self._peers, self._counters, self._leases, self._buffer,
            self._pool, self._trust, self._tracker, len(self._judging),
            self._accusations.bad, self.scorer, self._spot is not None, loop_now())

    def peer_views(self) -> dict[str, PeerView]:
        """Each connected peer as the hub sees it, by peer id, in the order they joined."""
        now, leases = loop_now(), self._leases.open_by_peer()
        accounts = self._pool.per_peer(now)
        return {c.peer_id: peer_view(
            c, self._trust, self._pool.is_active(c.peer_id), now, leases.get(c.peer_id, ()),
            accounts.get(c.peer_id, {}), self.scorer.usage_s(c.identity) if self.scorer else 0.0,
            self._admission.over_budget(c)) for c in self._peers.values()}

    def snapshot(self, version: int | None = None, base: int | None = None) -> Snapshot | None:
        """The manifest and chunks of `version` (None: the newest published) this hub keeps: in
        full (`base` None), or as a delta from `base` (published, or a catch-up's)."""
        if version is None and (version := self._tracker.newest_version) is None:
            return None
        return self._tracker.snapshot(version, base)

    def broadcasts(self) -> dict[tuple[int, int | None], Broadcast]:
        """The relay plans dealt, by (version, base: None for the full manifest)."""
        return dict(self._tracker.broadcasts)

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds, looked at again after each event the hub handled (a
        frame, a judged submission, a step, a publication, a lease expiry): no polling."""
        await self._changes.wait_for(condition)

    async def wait_peers(self, n: int) -> None:
        """Return once exactly `n` peers are connected (joined and not yet left)."""
        await self._changes.wait_for(lambda: len(self._peers) == n)

    async def wait_step(self, step: int) -> None:
        """Return once the learner has reached `step` (`finish_step`)."""
        await self._changes.wait_for(lambda: self.step >= step)

    async def wait_quarantined(self, identity: str | None = None) -> None:
        """Return once `identity` (None: some identity) is quarantined."""
        trust = self._trust
        await self._changes.wait_for(lambda: bool(trust.quarantined) if identity is None
                                     else identity in trust.quarantined)

    # --- connections ------------------------------------------------------------------

    def routes(self) -> dict[str, Handler]:
        """The hub's GET routes for `hub.serving.app.serve`: the peers' websocket (/ws) and the hub's
        share of the chunks (/chunk/..., ticket-checked, rate-limited, watched: hub.overlay.seeding)."""
        mbps, tickets = self.cfg.overlay.upload_limit_mbps, Tickets(self.hub_key, self.run_id, "hub")
        chunks = chunk_handler(self.chunk_lookup, UploadMeter(), TokenBucket(mbps * 1e6) if mbps
                               else None, on_served=self._overlay.chunk_served, authorize=tickets)
        return {"/ws": self._handle_ws, "/chunk/{version}/{base}/{index}": watched(
            chunks, tickets, asked=self._overlay.asked, answered=self._overlay.answered)}

    async def _handle_ws(self, request: web.Request) -> web.StreamResponse:
        """One peer connection, through the frame pump (`hub.serving.pump`), unless the door
        turns it away first (HTTP 429: the join limits, before any websocket work)."""
        refused = await self._door.turn_away(request.remote, self._peers.values())
        if refused is not None:
            return refused
        tracker, accusations = self._tracker, self._accusations
        on = {hp.CreditsAdded: lambda conn, event: self.dispatch(),
              hp.RolloutReceived: self._submitted, hp.HoldingReported: self._holding,
              hp.TransferReported: lambda c, e: tracker.transfer_reported(c, e.report, loop_now()),
              hp.RelayAccused: lambda c, e: accusations.heard(c, e.report),
              hp.HeartbeatReceived: lambda conn, event: None,
              hp.FrameDropped: self._door.dropped, Flooding: self._door.flooded}
        return await pump(request, self.cfg, self._counters, self._tokens, greet=self._greet,
                          on={kind: self._changing(handler) for kind, handler in on.items()},
                          leave=self._leave, speaks=self.speaks)

    def _changing(self, handler: Callable[[PeerConn, Any], None]) -> Callable[[PeerConn, Any], None]:
        def handle(conn: PeerConn, event: Any) -> None:
            handler(conn, event)
            self._changes.notify()
        return handle

    async def _greet(self, ws: web.WebSocketResponse, protocol: hp.HubProtocol, hello: m.Hello,
                     request: web.Request) -> PeerConn | None:
        """Join the peer that said `hello`, or close it (`hub.serving.door`: joining too often, no
        valid token, a crowded address)."""
        refused = self._door.refusal(hello, request.remote, self._peers.values(), loop_now())
        if refused is not None:
            await close_connection(ws, protocol.session, *refused, request.transport)
            return None
        return self._join(ws, protocol, hello, request.transport, request.remote)

    def _join(self, ws: web.WebSocketResponse, protocol: hp.HubProtocol, hello: m.Hello,
              transport: asyncio.BaseTransport | None, remote: str | None = None) -> PeerConn:
        peer_id = self._new_peer_id()
        conn = PeerConn(peer_id, hello, ws, protocol, transport, remote=remote)
        self._door.admitted(conn, loop_now())  # its identity's frame budget, shared
        cfg, newest, key = self.cfg, self._tracker.newest, self._signing_key
        agreed = protocol.agreed
        conn.post(m.Welcome(
            peer_id, self.run_id, cfg.run.model, self.setup.kind, newest.version if newest else 0,
            cfg.staleness.max_lag, cfg.grpo.group_size, cfg.grpo.temperature, cfg.grpo.top_p, cfg.grpo.max_new_tokens,
            cfg.run.seed * 100_003 + self._next_peer, self.hub_key,
            signing.sign_ticket(key, self.run_id, peer_id, hello.peer_key) if key else b"",
            signing.sign_welcome(key, hello.nonce, self.run_id, peer_id, hello.peer_key)
            if key and hello.nonce else b"", *self.model_index, self.setup.env,
            self.setup.env_version, *getattr(self.setup.reward, "turn", ("", "")),
            protocol=agreed.protocol, features=list(agreed.features),
            leaf=conn.leaf and LEAF_NOTICE in agreed.features))  # told only where it reads it
        self._peers[peer_id] = conn
        self._pool.join(peer_id, hello.name, hello.price_per_hour, hello.engine != "relay", loop_now())
        self._accusations.probe(conn, newest.version if newest else 0)
        self._tracker.catch_up(conn, loop_now())
        log.info("peer joined: %s (%s, %s on %s, $%.2f/h)", peer_id, hello.name, hello.engine,
                 hello.device, hello.price_per_hour)
        self.replan(self._pool.required)
        self._changes.notify()
        return conn

    def _leave(self, conn: PeerConn) -> None:
        self._peers.pop(conn.peer_id, None)
        self._pool.leave(conn.peer_id, loop_now())
        back = self._leases.release_peer(conn.peer_id)
        self._quotas.left(conn)
        log.info("peer left: %s (%s); %d leases re-queued", conn.peer_id, conn.hello.name, len(back))
        self._tracker.peer_left(conn.peer_id, loop_now())
        self.replan(self._pool.required)
        self.dispatch()
        self._changes.notify()

    def _holding(self, conn: PeerConn, event: hp.HoldingReported) -> None:
        if conn.protocol.note_held(event.version, self._tracker.newest_version):
            log.debug("%s holds v%d", conn.peer_id, event.version)  # tests/chaos reads it
            # T_bcast counts the reload
            self._tracker.holding_reported(conn, event.version, loop_now())

    def _new_peer_id(self) -> str:
        """A peer id never handed out before (a resumed hub's journal keeps the count): for a
        peer that joins, and the hub's own checks (a liar must not tell them from one)."""
        self._next_peer += 1
        self._journal("peer", self._next_peer)
        return f"p{self._next_peer}"

    async def disconnect(self, peer_id: str, reason: str) -> None:
        """Send peer `peer_id` away (going away, `reason`), as a hub that drops it would."""
        if (conn := self._peers.get(peer_id)) is not None:
            await conn.close(m.CLOSE_GOING_AWAY, reason)

    async def close_all(self, reason: str = "hub shutting down") -> None:
        """Peers first: no submission may reach the scorer once it is closed."""
        await asyncio.gather(*(conn.close(m.CLOSE_GOING_AWAY, reason)
                               for conn in list(self._peers.values())))
        judging = list(self._judging)  # each puts its prompt back
        for task in judging:
            task.cancel()
        await asyncio.gather(*judging, return_exceptions=True)
        if self.scorer is not None:
            self.scorer.close()
        await self._overlay.close()

    # --- durability (echo2p2p.hub.learning.durable) -------------------------------------------

    def _journal(self, kind: str, *record: Any) -> None:
        if self._journal_to is not None:
            self._journal_to.write([kind, *record])

    def checkpoint(self, journal: Journal | None) -> dict[str, Any]:
        """What a checkpoint keeps of the hub, as plain data (see hub.checkpoint); from now on
        its changes go to `journal` (the last one closed): in one go, so none falls between."""
        if self._journal_to is not None:
            self._journal_to.close()
        self._journal_to = journal
        return hub_state(self.run_id, self.step, self._next_peer, self._leases, self._buffer,
                         self._trust, self._counters, self._pool, self.scorer, loop_now())

    def restore(self, state: dict[str, Any], journal: list[list]) -> None:
        """Come back to `state` plus the journal after it; the caller restores the learner."""
        self.step = state["step"]
        self._next_peer = restore_hub(state, journal, self._leases, self._buffer, self._trust,
                                      self._counters, self._pool, self.scorer, loop_now())
