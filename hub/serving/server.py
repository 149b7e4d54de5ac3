"""The hub's shell: sockets, timers and worker futures around the sans-IO `hub.core.core.HubCore`.

Everything that happens reaches the core as one event through `Hub.feed`: frames and the ends
of connections from the pump (`hub.serving.pump.Connections`), finished scorings and spot-checks
from their futures, the overlay's encodes, probes and checks (`hub.serving.overlay_shell`), the
learner's events (a version published, a step finished, a replan; `wait_batch` asks for a
batch), the timer's Ticks (while the hub serves: `async with hub`) and the end of each event
loop turn. `_carry_out` then does what the core answered, in order (`hub.core.actions`): frames
to the peers' writers (held until `not_before`), refusals, journal records, run log records,
scorings and spot-checks started, the learner's batch queued. No part calls another back: the
core's parts emit actions, and this is the one place that acts on them (as
`echo2p2p.peer.client` does for the peer).

Everyone else (/status, /metrics, the dashboard, the step record, tests and benches) reads the
hub through `statistics()`, `peer_views()` and `core` (its step, run id, key, versions), and
waits with `until(condition)`, re-checked after each event the hub handled. `Hub`'s public
names are these, `feed`, `wait_batch`, `routes`, `checkpoint`, `restore`, the `scorer`, the
run's `setup` and `chunk_lookup` (the hub's chunks, which tests wrap).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from echo2p2p.buffer import ScoredGroup
from echo2p2p.completions import CompletionDecoder
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S
from echo2p2p.overlay.serving import TokenBucket, UploadMeter, chunk_handler
from echo2p2p.overlay.tickets import Tickets
from echo2p2p.runtime.process import loop_now
from echo2p2p.scoring.scorer import OverBudget, Scorer
from echo2p2p import messages as m

from ..config import HubConfig
from ..core import actions as a
from ..core import events as ev
from ..core.core import HubCore, RunFacts
from ..learning.checkpoint import hub_state, restore_hub
from ..learning.durable import Journal, group_to_wire
from ..core.overlay_actions import BuildDelta, CheckGossip, CheckRelay, ProbeRelay, WakeAt
from ..overlay.seeding import watched
from ..tasks.task_setup import TaskSetup, TokenizedProblem
from .counters import Changes, HubStatistics, PeerView, peer_view, statistics_of
from .door import Tarpit
from .overlay_shell import OverlayShell
from .pump import Connections
from .tokens import TokenBook

if TYPE_CHECKING:  # hub.learning.spotcheck imports torch, which `echo2-hub --help` must not wait for
    from .spotcheck import SpotChecker, SpotResult

log = logging.getLogger(__name__)

__all__ = ["Hub", "HubStatistics", "PeerView", "TokenizedProblem", "new_lease_id"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def new_lease_id() -> str:
    """A random lease id (16 characters, 96 bits): naming one proves it was granted to you, and
    ids say nothing of how many leases there were."""
    return secrets.token_urlsafe(12)


class Hub:
    """The hub's network shell, owned by one event loop; its decisions are `self.core`'s."""

    def __init__(self, cfg: HubConfig, run_id: str, task: Any, problems: list[TokenizedProblem],
                 signing_key: bytes = b"",
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 spot: SpotChecker | None = None, decode: CompletionDecoder | None = None,
                 setup: TaskSetup | None = None):
        """`signing_key`: the hub's Ed25519 private key, for the tickets it hands peers (b"": a
        bench rig without tickets). `on_event`: the run log. `spot`: recomputes the behaviour
        logprobs of a share of the rollouts (None: no spot-checks). `decode`: the run's
        tokenizer, which rollouts are scored by (None: a hub that refuses every rollout, e.g.
        a broadcast bench). `setup`: how `task` is scored (None: by its own reward)."""
        self._cfg = cfg
        self.setup = setup = setup or TaskSetup.builtin(task)
        self.scorer = None if decode is None else Scorer(  # its workers start on the first rollout
            setup.reward, decoder=decode, timeout_s=cfg.scoring.score_timeout_s,
            sample_budget_s=cfg.scoring.score_sample_budget_s,
            workers=cfg.scoring.score_workers, name="hub-scorer")
        self.core = core = HubCore(
            cfg, run_id, problems, facts=RunFacts(
                setup.kind, setup.env, setup.env_version, getattr(setup.reward, "turn", ("", "")),
                setup.runs_programs, setup.peers_score),
            new_lease_id=new_lease_id, signing_key=signing_key, scoring=self.scorer,
            vocab_size=decode.vocab_size if decode is not None else None,
            spot_checks=spot is not None, tokens=bool(cfg.network.tokens),
            relay_floor_bytes_s=MIN_RATE_BYTES_S)
        self._spot, self._on_event = spot, on_event or (lambda record: None)
        self._changes = Changes()  # what `until` waits on: every event the hub handles
        self._journal_to: Journal | None = None  # where changes since the last checkpoint go
        self._scoring: dict[str, asyncio.Future] = {}  # by lease id
        self._checks: dict[str, asyncio.Task] = {}  # by lease id
        self._batches: asyncio.Queue[a.BatchReady] = asyncio.Queue()  # the learner reads these
        self._closing: set[asyncio.Task] = set()  # closes the core asked for, under way
        self._turn_due = False
        self._tarpit = Tarpit()
        self._timer: asyncio.Future | None = None  # the Ticks, while the hub serves
        self._conns = Connections(cfg, TokenBook(cfg.network.tokens) if cfg.network.tokens
                                  else None, self.feed)
        self._overlay = overlay = OverlayShell(  # encodes, probes, checks, the seed watch's timer
            signing_key, run_id, new_peer_id=core.new_peer_id, feed=self.feed,
            snapshot=core.tracker.snapshot, now=loop_now)
        self._do = {a.Send: self._send,
                    a.Joined: lambda x: self._conns.joined(x.conn_id, x.peer_id),
                    a.Refused: lambda x: self._conns.refused(x.conn_id, x.code, x.reason),
                    a.Close: self._close, a.Journal: lambda x: self._journal(x.record),
                    a.Record: lambda x: self._on_event(x.record), a.Score: self._score,
                    a.SpotCheck: self._spot_check, a.SpotCheckDropped: self._spot_dropped,
                    a.BatchReady: self._batches.put_nowait, a.EndTurn: self._end_turn,
                    **dict.fromkeys((WakeAt, BuildDelta, ProbeRelay, CheckRelay, CheckGossip),
                                    overlay.run)}
        self.chunk_lookup = overlay.chunk_lookup  # the hub's chunks (tests wrap it)

    # --- the one way in, and the one place actions are carried out ----------------------

    def feed(self, event: ev.Event) -> None:
        """Tell the core what happened (now, on the loop's clock) and carry out its answer."""
        self._carry_out(self.core.handle(event, loop_now()))

    def _carry_out(self, actions: list[Any]) -> None:
        do = self._do
        for action in actions:
            do[type(action)](action)
        self._changes.notify()

    def _end_turn(self, action: a.EndTurn) -> None:
        if self._turn_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): now
            return self.feed(ev.TurnEnded())
        self._turn_due = True
        loop.call_soon(self._turn_ended)

    def _turn_ended(self) -> None:
        self._turn_due = False
        self.feed(ev.TurnEnded())

    def _send(self, send: a.Send) -> None:
        conn = self._conns.by_peer.get(send.peer_id)
        if conn is None:
            return  # gone
        if send.not_before and send.not_before > loop_now():  # a code reward's held answer
            asyncio.get_running_loop().call_at(send.not_before, conn.post, send.message)
        else:
            conn.post(send.message)

    def _close(self, close: a.Close) -> None:
        if (conn := self._conns.by_peer.get(close.peer_id)) is not None:
            task = asyncio.ensure_future(conn.close(close.code, close.reason))
            self._closing.add(task)  # awaited by close_all
            task.add_done_callback(self._closing.discard)

    def _score(self, score: a.Score) -> None:
        """Queued for scoring now (a task would start it an event loop turn later)."""
        future = self.scorer.submit_ids(score.problem, list(score.token_ids), list(score.texts),
                                        None if score.turns is None else list(score.turns),
                                        owner=score.owner)
        self._scoring[score.lease_id] = future
        future.add_done_callback(lambda f, lease_id=score.lease_id: self._scored(lease_id, f))

    def _scored(self, lease_id: str, future: asyncio.Future) -> None:
        if self._scoring.pop(lease_id, None) is None:
            return  # fed already (close_all)
        if future.cancelled():
            return self.feed(ev.ScoringFinished(lease_id, error="failed"))
        if isinstance(exc := future.exception(), OverBudget):
            return self.feed(ev.ScoringFinished(lease_id, error="over_budget"))
        if exc is not None:
            log.error("judging a rollout failed", exc_info=exc)
            return self.feed(ev.ScoringFinished(lease_id, error="failed"))
        s = future.result()
        self.feed(ev.ScoringFinished(lease_id, None, tuple(s.rewards), bool(s.malformed),
                                      tuple(s.faults), bool(s.mismatched), s.forged))

    def _spot_check(self, check: a.SpotCheck) -> None:
        """Its weights are looked up now (`SpotChecker.check`); the check runs meanwhile."""
        task = asyncio.ensure_future(self._spot.check(check.group))
        self._checks[check.lease_id] = task
        task.add_done_callback(lambda t, lease_id=check.lease_id: self._spot_checked(lease_id, t))

    def _spot_checked(self, lease_id: str, task: asyncio.Task[SpotResult]) -> None:
        if self._checks.pop(lease_id, None) is None:
            return  # dropped, or fed already
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                log.error("spot-checking a rollout failed", exc_info=task.exception())
            return self.feed(ev.SpotCheckFinished(lease_id, "failed"))
        result = task.result()
        self.feed(ev.SpotCheckFinished(lease_id, result.reason, result.tokens, result.detail()))

    def _spot_dropped(self, dropped: a.SpotCheckDropped) -> None:
        if (task := self._checks.pop(dropped.lease_id, None)) is not None:
            task.cancel()

    def _journal(self, record: tuple[Any, ...]) -> None:
        if self._journal_to is not None:
            kind, *rest = record
            if kind == "admit" and isinstance(rest[0], ScoredGroup):
                rest[0] = group_to_wire(rest[0])
            self._journal_to.write([kind, *rest])

    # The core's peers, pool and trust book, by the names benches and tests that stage a hub
    # without sockets (bench/dashboard_scale.py) reach for; the connections' protocol versions
    # (`echo2p2p.negotiation.Speaks`), which a compatibility test changes.
    _peers = property(lambda self: self.core.peers)
    _pool = property(lambda self: self.core.pool)
    _trust = property(lambda self: self.core.trust)
    _speaks = property(lambda self: self._conns.speaks,
                       lambda self, speaks: setattr(self._conns, "speaks", speaks))

    # --- what the learner loop asks -----------------------------------------------------

    async def wait_batch(self) -> list[ScoredGroup]:
        """Block until `prompts_per_step` fresh groups are queued for the current step: the
        core is told the learner wants one (`BatchWanted`) and answers with a `BatchReady`,
        which lands in the one batch queue the learner reads. Everything else the learner
        says is an event (`feed`: VersionPublished, StepFinished, Replanned)."""
        self.feed(ev.BatchWanted())
        return list((await self._batches.get()).groups)

    async def _timers(self) -> None:
        """Forever: a Tick for the core (leases past their deadline, the rejections' summary)."""
        while True:
            # a timer, not a sync
            await asyncio.sleep(min(1.0, self._cfg.staleness.lease_timeout_s / 4))
            self.feed(ev.Tick())

    # --- what the hub says of itself -------------------------------------------------

    def statistics(self) -> HubStatistics:
        """A frozen look at the hub: peers, queues, leases, trust, versions and counters."""
        core = self.core
        return statistics_of(
            core.step, core.training, core.peers, core.counters, core.leases, core.buffer,
            core.pool, core.trust, core.tracker, len(core.admission.judging),
            core.accusations.bad, self.scorer, self._spot is not None, loop_now())

    def spot_mismatch(self) -> dict[str, Any]:
        """The engine-vs-learner mismatch the spot-checks measured since the last call, by lag
        (`SpotChecker.mismatch`: `spot/mismatch_kl`, ...); {} without a checker or checks."""
        return self._spot.mismatch() if self._spot is not None else {}

    def peer_views(self) -> dict[str, PeerView]:
        """Each connected peer as the hub sees it, by peer id, in the order they joined."""
        core, now = self.core, loop_now()
        leases, accounts = core.leases.open_by_peer(), core.pool.per_peer(now)
        return {c.peer_id: peer_view(
            c, core.trust, core.pool.is_active(c.peer_id), now, leases.get(c.peer_id, ()),
            accounts.get(c.peer_id, {}), self.scorer.usage_s(c.identity) if self.scorer else 0.0,
            core.admission.over_budget(c)) for c in core.peers.values()}

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds, looked at again after each event the hub handled (a
        frame, a judged submission, a step, a publication, a lease expiry): no polling."""
        await self._changes.wait_for(condition)

    # --- connections ------------------------------------------------------------------

    def routes(self) -> dict[str, Handler]:
        """The hub's GET routes for `hub.serving.app.serve`: the peers' websocket (/ws) and the
        hub's share of the chunks (/chunk/..., ticket-checked, rate-limited, watched:
        hub.overlay.seeding)."""
        mbps = self._cfg.overlay.upload_limit_mbps
        tickets = Tickets(self.core.hub_key, self.core.run_id, "hub")
        chunks = chunk_handler(self.chunk_lookup, UploadMeter(), TokenBucket(mbps * 1e6) if mbps
                               else None, on_served=self._overlay.chunk_served, authorize=tickets)
        return {"/ws": self._handle_ws, "/chunk/{version}/{base}/{index}": watched(
            chunks, tickets, asked=self._overlay.asked, answered=self._overlay.answered)}

    async def _handle_ws(self, request: web.Request) -> web.StreamResponse:
        """One peer connection, through the frame pump, unless the core's door turns it away
        first (HTTP 429, held back: the join limits, before any websocket work)."""
        why = self.core.knock(request.remote, loop_now())
        self._changes.notify()
        if why is not None:
            return await self._tarpit.turn_away(why)
        return await self._conns.pump(request)

    async def __aenter__(self) -> Hub:
        """Start the hub's timer (its Ticks); the hub serves from here until the exit."""
        self._timer = asyncio.ensure_future(self._timers())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self._close_all()

    async def _close_all(self, reason: str = "hub shutting down") -> None:
        """Peers first: no submission may reach the scorer once it is closed; each submission
        still being judged puts its prompt back."""
        await asyncio.gather(*(conn.close(m.CLOSE_GOING_AWAY, reason)
                               for conn in list(self._conns.by_peer.values())))
        for lease_id in list(self._scoring):
            self._scoring.pop(lease_id).cancel()
            self.feed(ev.ScoringFinished(lease_id, error="failed"))
        checks = [*self._checks.values(), *self._closing]
        self._checks.clear()
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
        if self.scorer is not None:
            self.scorer.close()
        await self._overlay.close()

    # --- durability (echo2p2p.hub.learning.durable) -------------------------------------------

    def checkpoint(self, journal: Journal | None) -> dict[str, Any]:
        """What a checkpoint keeps of the hub, as plain data (hub.learning.checkpoint); from now on
        its changes go to `journal` (the last one closed): in one go, so none falls between."""
        self._carry_out(self.core.drain())  # what the overlay emitted, into the old journal
        if self._journal_to is not None:
            self._journal_to.close()
        self._journal_to = journal
        return hub_state(self.core, self.scorer, loop_now())

    def restore(self, state: dict[str, Any], journal: list[list]) -> None:
        """Come back to `state` plus the journal after it; the caller restores the learner."""
        restore_hub(state, journal, self.core, self.scorer, loop_now())
