"""`HubCore`: the hub's decisions as one state machine, events in, actions out.

In the spirit of h11's `Connection` and the websockets library's sans-IO `Protocol`: the shell
(`hub.serving.server`) turns what happened (a hello, a frame, a finished score or spot-check,
the learner's step, a publication, a deadline, the end of a loop turn: `hub.core.events`) into
`handle(event, now)`, and carries out what it returns (`hub.core.actions`: send, close, score,
spot-check, journal, record, the learner's batch). Who may join (`hub.core.door`), leases and
their dispatch (`echo2p2p.leases`, `hub.core.leasing`), admission (`hub.core.admission`), trust
and quarantine (`hub.core.quarantine`) and the counters live here; nothing here touches a
socket, a clock, a thread or a file: time comes in as `now`, and a test feeds events with a
fake clock and reads the actions back.

Theory of operation. Every part that decides something the world must see emits an action into
the one `Outbox`; `handle` runs the event's handler and drains it. Lease passes coalesce per
event loop turn: a handler that frees budget or credits asks for one (`EndTurn`, once), and the
shell feeds `TurnEnded` when the turn's frames are read (at 64 peers a pass per frame was most
of the hub's time: `bench/ingest.py`). The overlay's tracker and relay judges
(`hub.core.tracker`, `hub.core.accusations`) are parts like the others: what they ask beyond a
send (an encode, a probe, a check, a wake-up: `hub.core.overlay_actions`) the shell carries out,
and what came of it comes back as an event, as does the hub's chunk route's evidence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.buffer import RolloutBuffer
from echo2p2p.lease_quota import LeaseQuota, QuotaPolicy
from echo2p2p.leases import LeaseBook, shuffled_epochs
from echo2p2p.negotiation import LEAF_NOTICE
from echo2p2p.pool import Pool
from echo2p2p.staleness import lease_min_version
from echo2p2p.trust import TrustBook, TrustPolicy

from ..config import HubConfig
from . import events as ev
from .actions import Close, EndTurn, Joined, Journal, Outbox, Record, Refused
from .accusations import Accusations
from .admission import Admission, AdmissionRules, Prompt, ScoringLedger
from .batching import Batching
from .counters import Counters
from .door import Door
from .leasing import Quotas, grant_of
from .peer import Peer
from .quarantine import TrustGuard
from .tracker import VersionTracker

log = logging.getLogger("echo2p2p.hub.serving.server")  # one logger for the hub's peer-facing side


@dataclass(frozen=True)
class RunFacts:
    """What the core reads of the run's task (`hub.tasks.task_setup.TaskSetup`)."""

    kind: str  # what the welcome tells peers
    env: str = ""  # a multi-turn run's environment ('' otherwise)
    env_version: str = ""
    turn: tuple[str, str] = ("", "")  # the markup around each observation (episodes.in_turn)
    runs_programs: bool = False  # its reward runs the completion's program: answers are held
    peers_score: bool = False  # peers score the reward too: their claims can be checked


class HubCore:
    """The hub's peers, leases, admission and trust; `handle(event, now)` -> actions."""

    def __init__(self, cfg: HubConfig, run_id: str, problems: Sequence[Prompt], *,
                 facts: RunFacts, new_lease_id: Callable[[], str], signing_key: bytes = b"",
                 scoring: ScoringLedger | None = None, vocab_size: int | None = None,
                 spot_checks: bool = False, tokens: bool = False,
                 relay_floor_bytes_s: float = 0.0):
        """`new_lease_id`: unguessable ids (the shell draws them); `signing_key`: the hub's
        Ed25519 key for tickets and welcome proofs (b"": a rig without); `scoring`: the scorer's
        ledger (None: a hub that refuses every rollout); `spot_checks`: the shell has a
        checker; `tokens`: joins need tokens (the shell reads the token file);
        `relay_floor_bytes_s`: the receivers' stall floor a relay is judged by
        (`echo2p2p.overlay.fetch.MIN_RATE_BYTES_S`)."""
        self.cfg, self.run_id, self.facts, self._signing_key = cfg, run_id, facts, signing_key
        self.hub_key = signing.public_key(signing_key) if signing_key else b""
        self.model_index = (b"", b"")  # GET /model/'s (digest, signature), set where served
        self.outbox = Outbox()
        self.step = 0  # the run's one step counter: the learner's version is this
        self.training = False  # a batch was taken and step `step` is running on it
        self.next_peer = 0
        self.peers: dict[str, Peer] = {}
        self._dispatch_due = False  # an EndTurn was asked for and its TurnEnded not yet fed
        self.counters = Counters()
        self.leases: LeaseBook[Prompt] = LeaseBook(
            problems, cfg.staleness.lease_timeout_s, shuffled_epochs(len(problems), cfg.run.seed),
            self._lease_changed, new_lease_id)
        self.buffer = RolloutBuffer(cfg.staleness.max_lag, cfg.grpo.dynamic_sampling)
        self.batching = Batching(cfg, self.buffer, self.outbox)
        self.pool = Pool(cfg.staleness.activation, cfg.staleness.activation_margin)
        self.trust = TrustBook(TrustPolicy(probation_checks=cfg.trust.spot_check_probation))
        self.guard = TrustGuard(self.trust, self.leases, self.buffer, self.counters, self.outbox)
        self.door = Door(cfg.limits, tokens, self.counters, self.guard)
        quota = LeaseQuota(QuotaPolicy(start=cfg.staleness.new_peer_leases))  # earned by admissions
        self.admission = Admission(
            AdmissionRules.of(cfg, runs_programs=facts.runs_programs, episodes=bool(facts.env),
                              peers_score=facts.peers_score, vocab_size=vocab_size,
                              spot_checks=spot_checks),
            self.leases, self.buffer, self.pool, self.counters, self.guard, quota, self.outbox,
            scoring=scoring, seed=cfg.run.seed)
        self.quotas = Quotas(cfg, self.peers, self.leases, self.guard, self.counters, quota,
                             self.pool.gen_rollouts_per_s, lambda: self.newest_version,
                             self.buffer.informative_frac)
        self.tracker = VersionTracker(cfg.overlay, self.peers, self.pool, self.outbox,
                                      quarantined=self.guard.quarantined)
        self.accusations = Accusations(
            cfg.overlay.relay, self.peers, self.tracker, self.outbox, self.counters,
            distrust=self.guard.distrust, tickets=bool(signing_key),
            min_rate_bytes_s=relay_floor_bytes_s)
        self.guard.overlay = self  # a quarantined peer's chunks are re-dealt (`route_around`)
        self.now = 0.0  # the `now` of the event being handled

    @property
    def newest_version(self) -> int | None:
        return self.tracker.newest_version

    def route_around(self, peer_id: str) -> None:
        """Deal `peer_id`'s chunks to others, in every broadcast (it was quarantined)."""
        self.tracker.route_around(peer_id, self.now)

    # --- the one entry point ----------------------------------------------------------

    def _lease_changed(self, change: tuple) -> None:
        """Journal a lease book change; log leases closed unanswered (tests/chaos reads it)."""
        self.outbox.emit(Journal(("lease", *change)))
        if change[0] in ("requeue", "drop"):
            log.debug("lease %s closed: %s", change[1], change[-1] if change[0] == "requeue"
                      else "expired")

    def handle(self, event: ev.Event, now: float) -> list[Any]:
        """Take `event` (at `now`, the hub's clock) and return what to do, in order."""
        handler = _HANDLERS[type(event)]
        self.now = now
        handler(self, event, now)
        return self.drain()

    def drain(self) -> list[Any]:
        """The actions emitted so far, run log records dated by the learner's step."""
        actions = self.outbox.drain()
        for i, action in enumerate(actions):
            if isinstance(action, Record) and action.dated:
                actions[i] = Record({**action.record, "step": self.step})
            elif isinstance(action, EndTurn):
                self._dispatch_due = True
        return actions

    def knock(self, remote: str | None, now: float) -> str | None:
        """Why a connection from `remote` may not even upgrade to a websocket now (the shell
        answers HTTP 429 with it), or None (`hub.core.door.Door.knock`)."""
        return self.door.knock(remote, self.peers.values(), now)

    def new_peer_id(self) -> str:
        """A peer id never handed out before (a resumed hub's journal keeps the count): for a
        peer that joins, and the hub's own checks (a liar must not tell them from one)."""
        self.next_peer += 1
        self.outbox.emit(Journal(("peer", self.next_peer)))
        return f"p{self.next_peer}"

    # --- joins and leaves -------------------------------------------------------------

    def _hello(self, event: ev.HelloReceived, now: float) -> None:
        """Join the peer that said hello, or refuse it (`hub.core.door`: joining too often, no
        valid token, a crowded address)."""
        hello = event.hello
        refused = self.door.refusal(hello, event.remote, self.peers.values(), now,
                                    event.token_refusal)
        if refused is not None:
            self.outbox.emit(Refused(event.conn_id, *refused))
            return
        peer_id = self.new_peer_id()
        conn = Peer(peer_id, hello, event.protocol, self.outbox, remote=event.remote)
        self.door.admitted(conn, now)  # its identity's frame budget, shared
        self.outbox.emit(Joined(event.conn_id, peer_id))
        conn.post(self._welcome(conn))
        self.peers[peer_id] = conn
        self.pool.join(peer_id, hello.name, hello.price_per_hour,
                       generates=hello.engine != "relay", now=now)
        newest = self.newest_version
        self.accusations.probe(conn, newest or 0)
        self.tracker.catch_up(conn, now)
        log.info("peer joined: %s (%s, %s on %s in %s, $%.2f/h)", peer_id, hello.name,
                 hello.engine, hello.device, hello.dtype or "?", hello.price_per_hour)
        self._replan(self.pool.required, now)

    def _welcome(self, conn: Peer) -> m.Welcome:
        cfg, key, hello, facts = self.cfg, self._signing_key, conn.hello, self.facts
        agreed, peer_id = conn.protocol.agreed, conn.peer_id
        digest, signature = self.model_index
        return m.Welcome(
            peer_id=peer_id, run_id=self.run_id, model=cfg.run.model, task=facts.kind,
            version=self.newest_version or 0, max_lag=cfg.staleness.max_lag,
            group_size=cfg.grpo.group_size, temperature=cfg.grpo.temperature,
            top_p=cfg.grpo.top_p, max_new_tokens=cfg.grpo.max_new_tokens,
            seed=cfg.run.seed * 100_003 + self.next_peer, hub_key=self.hub_key,
            ticket=signing.sign_ticket(key, self.run_id, peer_id, hello.peer_key) if key else b"",
            proof=signing.sign_welcome(key, hello.nonce, self.run_id, peer_id, hello.peer_key)
            if key and hello.nonce else b"",
            model_digest=digest, model_signature=signature, env=facts.env,
            env_version=facts.env_version, env_turn_before=facts.turn[0],
            env_turn_after=facts.turn[1], protocol=agreed.protocol, features=list(agreed.features),
            leaf=conn.leaf and LEAF_NOTICE in agreed.features,  # told only where it reads it
            spot_check_tolerance=self.admission.rules.spot_tolerance)

    def _left(self, event: ev.PeerLeft, now: float) -> None:
        conn = self.peers.pop(event.peer_id, None)
        if conn is None:
            return
        conn.closing = True
        self.pool.leave(conn.peer_id, now)
        back = self.leases.release_peer(conn.peer_id)
        self.quotas.left(conn)
        log.info("peer left: %s (%s); %d leases re-queued", conn.peer_id, conn.hello.name,
                 len(back))
        self.tracker.peer_left(conn.peer_id, now)
        self._replan(self.pool.required, now)
        self._want_dispatch()

    # --- a joined peer's frames ---------------------------------------------------------

    def _frame(self, event: ev.FrameReceived, now: float) -> None:
        conn, frame = self.peers.get(event.peer_id), event.event
        if conn is None:
            return  # it left meanwhile
        if isinstance(frame, hp.CreditsAdded):
            self._want_dispatch()
        elif isinstance(frame, hp.RolloutReceived):
            if self.admission.submit(conn, frame.submission, self.step, self.newest_version, now):
                self._want_dispatch()
        elif isinstance(frame, hp.HoldingReported):
            if conn.protocol.note_held(frame.version, self.newest_version):
                log.debug("%s holds v%d", conn.peer_id, frame.version)  # tests/chaos reads it
                self.tracker.holding_reported(conn, frame.version, now)  # T_bcast: the reload
        elif isinstance(frame, hp.TransferReported):
            self.tracker.transfer_reported(conn, frame.report, now)
        elif isinstance(frame, hp.RelayAccused):
            self.accusations.heard(conn, frame.report)
        elif isinstance(frame, hp.FrameDropped):
            self.door.dropped(conn, frame)

    def _sent_away(self, event: ev.SentAway, now: float) -> None:
        if (conn := self.peers.get(event.peer_id)) is not None:
            conn.closing = True
            self.outbox.emit(Close(conn.peer_id, m.CLOSE_GOING_AWAY, event.reason))

    def _broken(self, event: ev.ProtocolBroken, now: float) -> None:
        """A connection is being closed for breaking the protocol; a flood costs its sender."""
        self.counters.closed_for_protocol += 1
        conn = self.peers.get(event.peer_id or "")
        if conn is not None:
            conn.closing = True
            if event.flooding is not None:
                self.door.flooded(conn, event.flooding, now)

    def _stalled(self, event: ev.PeerStalled, now: float) -> None:
        self.counters.cut_off += 1
        if (conn := self.peers.get(event.peer_id)) is not None:
            conn.closing = True

    # --- judging ------------------------------------------------------------------------

    def _scored(self, event: ev.ScoringFinished, now: float) -> None:
        if self.admission.scored(event, now):
            self._want_dispatch()
        self._offer_batch()

    def _spot_checked(self, event: ev.SpotCheckFinished, now: float) -> None:
        if self.admission.spot_checked(event, now):
            self._want_dispatch()
        self._offer_batch()

    # --- the learner --------------------------------------------------------------------

    def _batch_wanted_(self, event: ev.BatchWanted, now: float) -> None:
        self.batching.want(self.step)
        self._offer_batch()

    def _offer_batch(self) -> None:
        """The learner's batch if ready (`hub.core.batching`); if wanted and not, a lease pass."""
        self.training = self.batching.offer(self.step) or self.training
        if self.batching.wanted:  # still: not ready
            self._want_dispatch()

    def _step_finished(self, event: ev.StepFinished, now: float) -> None:
        self.step += 1
        self.training = False
        if not event.stopping:
            self._want_dispatch()

    def _replanned(self, event: ev.Replanned, now: float) -> None:
        self._replan(event.required, now)

    def _replan(self, required: float | None, now: float) -> None:
        """Re-choose the active peers for `required` rollouts/s (None: all; `echo2p2p.pool`):
        every step (drift), and on join and leave."""
        activated, standby = self.pool.replan(required, now)
        if not (activated or standby):
            return
        for peer_id in activated:
            conn = self.peers.get(peer_id)
            if self.cfg.overlay.standby == "cold" and conn is not None:
                self.tracker.catch_up(conn, now)
        record = self.pool.activation_record(self.step, required, activated, standby)
        log.info("activation at step %d: +%s -%s; %d active, $%.2f/h", self.step, activated,
                 standby, len(record["active"]), record["usd_per_hour"])
        self.outbox.emit(Record(record))
        self._want_dispatch()

    def _published(self, event: ev.VersionPublished, now: float) -> None:
        self.tracker.publish(event.version, now)

    def _overlay_result(self, event: Any, now: float) -> None:
        """What came of an overlay action (`hub.core.overlay_actions`), or the chunk route."""
        tracker, accusations = self.tracker, self.accusations
        if isinstance(event, ev.ChunkServed):
            tracker.chunk_served(event.version, event.nbytes, now)
        elif isinstance(event, ev.ChunkAsked):
            tracker.seeding.asked(event.peer_id, event.key, event.index, now)
        elif isinstance(event, ev.ChunkAnswered):
            tracker.seeding.answered(event.peer_id, event.key, event.index, event.fetched, now)
        elif isinstance(event, ev.DeltaBuilt):
            tracker.delta_built(event.key, event.snapshot, now)
        elif isinstance(event, ev.RelayProbed):
            accusations.probed(event.peer_id, event.ok, event.rate_bps)
        elif isinstance(event, ev.RelayChecked):
            accusations.relay_checked(event.check_id, event.verdict, event.elapsed_s, now)
        elif isinstance(event, ev.GossipChecked):
            accusations.gossip_checked(event.check_id, event.verdict, now)

    # --- deadlines and lease passes -----------------------------------------------------

    def _tick(self, event: ev.Tick, now: float) -> None:
        """Re-issue leases whose deadline passed (hoarding costs), tell the rejections not told,
        re-deal the shares of dealt peers silent past their grace (`hub.core.seeding`)."""
        self.admission.rejections.flush(now)  # the summary of rejections, if due
        self.tracker.tick(now)
        if late := self.leases.expire(now):
            self.quotas.expired(late)
            self._want_dispatch()

    def _want_dispatch(self) -> None:
        if not self._dispatch_due:
            self._dispatch_due = True
            self.outbox.emit(EndTurn())

    def _turn_ended(self, event: ev.TurnEnded, now: float) -> None:
        self._dispatch_due = False
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        """Grant leases to peers with credits as budget and quotas (`hub.core.leasing`) allow,
        round-robin over the peers, newest version held first."""
        cfg = self.cfg
        outstanding = self.leases.open_count + self.buffer.in_leases() + len(self.admission.judging)
        if self.quotas.full(outstanding):
            return
        guard, admission, pool = self.guard, self.admission, self.pool
        ready = sorted((p for p in self.peers.values() if p.credits > 0
                        and pool.is_active(p.peer_id) and not guard.quarantined(p)
                        and not admission.over_budget(p)),
                       key=lambda p: -1 if p.held_version is None else p.held_version, reverse=True)
        holdings = self.quotas.holdings()
        while ready:
            for conn in list(ready):
                if conn.credits <= 0 or conn.closing or \
                        not self.quotas.allows(conn, outstanding, holdings):
                    ready.remove(conn)
                    continue
                wait_s, latest_s = self.quotas.wait_s(conn, holdings)  # its place in its queue
                lease = self.leases.grant(conn.peer_id, now, lease_min_version(
                    self.step, self.training, self.quotas.ahead(outstanding, holdings),
                    cfg.grpo.prompts_per_step, max_lag=cfg.staleness.max_lag),
                    wait_s=wait_s, latest_s=latest_s)
                holdings.add(conn, self.quotas.book, self.quotas.ready(lease))
                outstanding += 1
                conn.protocol.take_credit(lease.lease_id)
                log.debug("granted %s (problem %d) to %s", lease.lease_id, lease.index,
                          conn.peer_id)
                conn.post(grant_of(lease, cfg.grpo.group_size, now))


_HANDLERS: dict[type, Callable[[HubCore, Any, float], None]] = {
    ev.HelloReceived: HubCore._hello, ev.FrameReceived: HubCore._frame,
    ev.ProtocolBroken: HubCore._broken, ev.SentAway: HubCore._sent_away,
    ev.PeerStalled: HubCore._stalled,
    ev.PeerLeft: HubCore._left, ev.ScoringFinished: HubCore._scored,
    ev.SpotCheckFinished: HubCore._spot_checked, ev.BatchWanted: HubCore._batch_wanted_,
    ev.StepFinished: HubCore._step_finished, ev.Replanned: HubCore._replanned,
    ev.VersionPublished: HubCore._published, ev.Tick: HubCore._tick,
    ev.TurnEnded: HubCore._turn_ended,
    **dict.fromkeys((ev.DeltaBuilt, ev.RelayProbed, ev.RelayChecked, ev.GossipChecked,
                     ev.ChunkAsked, ev.ChunkAnswered, ev.ChunkServed), HubCore._overlay_result),
}
