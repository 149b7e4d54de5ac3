"""The peer: join a hub, hold the newest version, turn leases into rollouts. `PeerClient` is a
pump over parts of one concept each: `connection` (websocket, handshake, backoff), the core's
`echo2p2p.peer_protocol` (frames -> events; welcome adoption and plan matching as decisions),
`fetcher` (the chunk store, downloads, staging), `chunk_server` (serving what we hold),
`model_files` (the model's config and tokenizer from the hub, verified and cached: an engine is
built from those alone), `swapper` (the engine handle: the version it holds, swaps, and
`VersionHeld`) and `worker` (leases -> generate -> score -> submit). The parts never see the
client: each is given what it uses. Here: the reconnect loop, the reader, the heartbeat, and
applying adoption decisions (handing the welcome to the parts). When the hub goes away the
peer keeps generating the leases it holds, keeps what the hub has not answered in its `Outbox`
and sends it again on the next connection (a hub resumed from its checkpoint admits it within S
of its resumed step). The "relay" engine holds and serves versions but generates nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p import peer_protocol as pp
from echo2p2p.errors import JoinRefused, ProtocolError, RemoteProtocolError, SnapshotError
from echo2p2p.overlay.serving import UploadMeter
from echo2p2p.overlay.store import ChunkStore
from echo2p2p.overlay.tickets import Credentials, Tickets
from echo2p2p.runtime.process import loop_now
from echo2p2p.runtime.tcp import socket_factory
from echo2p2p.adapters.environments import (EnvironmentMissing, InstalledEnvironment,
                                           require_environment)
from echo2p2p.tasks import REWARDS

from .attempts import Attempts
from .chunk_server import chunk_server
from .config import PeerConfig, normalize_url
from .connection import Backoff, HubConnection, connect, hub_base_url
from .fetcher import Fetcher
from .metrics import metrics_server
from .model_files import model_directory
from .outbox import Outbox
from .swapper import Swapper, build_engine, wait_built
from .worker import MakesRollouts, RolloutWorker, Rollouts

if TYPE_CHECKING:
    from echo2p2p.policy.engines import Engine
    from echo2p2p.scoring.rewards import Reward

log = logging.getLogger(__name__)

# At most one INFO summary a minute, by time and not every N versions: versions come several a
# second (the tiny demo) or one in minutes (a 7B run), and a peer whose versions stopped says so.
SUMMARY_EVERY_S = 60.0


@dataclass(frozen=True)
class PeerStats:
    connections: int
    versions_loaded: int
    version: int | None
    submitted: int
    acked: int
    rejected: dict[str, int]
    downloaded_bytes: int  # chunk bytes of every version fetched, from the hub and from peers


class PeerClient:
    """A rollout worker. `engine` may be given (tests, wrappers); else it is built on welcome.

    The chaos and hostile suites' liars pass parts that lie: `rollouts` wraps the honest
    `Rollouts` (what it returns is scored and submitted), `chunk_store(keep_versions)` makes the
    stores the fetcher holds, `reward_for(task_kind)` is the reward function claimed with."""

    def __init__(self, cfg: PeerConfig, engine: Engine | None = None, *,
                 rollouts: Callable[[Rollouts], MakesRollouts] | None = None,
                 chunk_store: Callable[[int], ChunkStore] = ChunkStore,
                 reward_for: Callable[[str], Reward | None] = REWARDS.get):
        self.cfg = cfg
        self.url = normalize_url(cfg.hub_url)
        self.welcome: m.Welcome | None = None
        self.env: InstalledEnvironment | None = None  # the run's environment, if it has one
        self._reward_for = reward_for
        self.meter = UploadMeter()
        self.tickets = Tickets()  # who may fetch from our chunk server: set at welcome
        self._key = signing.new_private_key()  # signs our chunk requests; the hub's ticket binds it
        self.credentials: Credentials | None = None  # what we show chunk servers: set at welcome
        self.served_url: str | None = None  # where other peers reach our chunk server
        self.metrics_url: str | None = None  # our /metrics while we run (cfg.metrics_port)
        self.outbox = Outbox(int(cfg.outbox_memory_mb * (1 << 20)), cfg.outbox_max, cfg.spool_dir)
        self.swapper = Swapper(engine, self.send)
        honest = Rollouts(self.swapper)
        self.worker = RolloutWorker(self.swapper, rollouts(honest) if rollouts else honest,
                                    self.outbox, self.send, score_timeout_s=cfg.score_timeout_s)
        self.fetcher = Fetcher(cfg, self.swapper, self.send, self.meter, tickets=self.tickets,
                               chunk_store=chunk_store)
        self._building: tuple[tuple, asyncio.Future] | None = None  # (model, engine on its way)
        self._model_route: tuple[aiohttp.ClientSession, str] | None = None  # GET /model/ there
        self._conn: HubConnection | None = None  # the connection now, if any
        self._connected, self._welcomed = asyncio.Event(), asyncio.Event()  # the `wait_...`s
        self._connections = self._acked = 0
        self._rejected: Counter[str] = Counter()
        self._summarized = (0.0, 0)  # (when, versions fetched) at the last summary (or start)

    @property
    def version(self) -> int | None:
        """The version the engine holds now (for a relay: the newest complete one)."""
        return self.swapper.version

    def statistics(self) -> PeerStats:
        s = self.swapper
        return PeerStats(self._connections, s.loaded, s.version, self.worker.submitted,
                         self._acked, dict(self._rejected), self.fetcher.downloaded_bytes)

    async def wait_version(self, version: int) -> None:
        """Return once the engine holds `version` or a newer one."""
        await self.swapper.wait_version(version)

    async def wait_connected(self) -> None:
        """Return once a connection is up: welcomed, the welcome adopted, the hub being read."""
        await self._connected.wait()

    async def wait_welcomed(self) -> None:
        """Return once a hub has welcomed us (and the welcome is adopted)."""
        await self._welcomed.wait()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Stay joined until `stop` is set: connect, serve, and reconnect with backoff. Raises
        JoinRefused if retrying cannot help: the hub refuses our join token, or there is no hub
        at our URL (`HubNotFound`, see `attempts`)."""
        stop = stop or asyncio.Event()
        refused: JoinRefused | None = None
        backoff = Backoff(self.cfg.reconnect_max_s)
        attempts = Attempts(self.url, self.cfg.connect_timeout_s)
        self._summarized = (loop_now(), self.fetcher.versions_fetched)
        tls = ssl.create_default_context(cafile=self.cfg.ca_cert or None)
        connector = aiohttp.TCPConnector(ssl=tls,
                                         socket_factory=socket_factory(self.cfg.tcp_congestion))
        async with aiohttp.ClientSession(connector=connector) as http, \
                metrics_server(self) as self.metrics_url, self._chunk_server(), self._workers():
            while not stop.is_set():
                failure: BaseException | None = None
                try:
                    if await self._connection_until(http, stop):
                        backoff.reset()
                except* JoinRefused as group:
                    refused = _first(group)
                except* (aiohttp.ClientError, OSError, TimeoutError, ProtocolError) as group:
                    failure = _first(group)
                why = f"the connection to hub {attempts.address} ended"
                if failure is not None and refused is None:  # HubNotFound: no retry can work
                    why = await attempts.failed(http, failure, welcomed=self._connections > 0)
                    refused = why if isinstance(why, JoinRefused) else None
                if refused is not None or stop.is_set():
                    break
                delay = backoff.delay()
                log.log(logging.WARNING if failure else logging.INFO, "%s; retrying in %.1f s",
                        why, delay)
                try:
                    await asyncio.wait_for(stop.wait(), delay)  # a timer that stop cuts short
                except TimeoutError:
                    pass
        if refused is not None:  # raised out here: inside, `_workers`' TaskGroup would wrap it
            raise refused

    async def _connection_until(self, http: aiohttp.ClientSession, stop: asyncio.Event) -> bool:
        """One connection, cut short by `stop`; True if it ended after a welcome."""
        async with asyncio.TaskGroup() as tg:
            conn = tg.create_task(self.serve_connection(http))
            stopper = tg.create_task(stop.wait())
            await asyncio.wait({conn, stopper}, return_when=asyncio.FIRST_COMPLETED)
            conn.cancel()
            stopper.cancel()
        return conn.done() and not conn.cancelled() and conn.result()

    @contextlib.asynccontextmanager
    async def _workers(self):
        """The worker and the swapper, across connections (a bug in either stops the peer)."""
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self.swapper.swap_versions())]
            if self.cfg.engine != "relay":
                tasks.append(tg.create_task(self.worker.work()))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                self.outbox.close()
                self.worker.close()

    @contextlib.asynccontextmanager
    async def _chunk_server(self):
        """Serve our chunks at `cfg.listen` for as long as the peer runs (nothing if '')."""
        async with chunk_server(self.cfg, lambda: self.fetcher.store, self.meter, self.tickets,
                                hub_url=self.url, links=self.fetcher.links) as served_url:
            if served_url is not None:
                self.served_url = served_url
            yield

    async def serve_connection(self, http: aiohttp.ClientSession) -> bool:
        """One connection's life: connect, shake hands, adopt the welcome, then read the hub
        until it goes; returns True if the hub welcomed us (a failed handshake raises), False
        if its model files did not verify (then we hung up)."""
        ws, protocol, welcome = await connect(http, self.url, self.cfg, self._key, self.served_url)
        self._connections += 1
        leaf = ", a leaf: the hub deals it no share (no chunk server)" if welcome.leaf else ""
        log.info("joined %s as %s (run %s, model %s, v%d)%s", self.url, welcome.peer_id,
                 welcome.run_id, welcome.model, welcome.version, leaf)
        conn = HubConnection(ws, protocol, http, hub_base_url(self.url), self.cfg.hub_timeout_s,
                             asyncio.current_task())
        async with ws, asyncio.TaskGroup() as tg:
            conn.tg = tg
            heartbeat = tg.create_task(self._keep_alive(conn))
            # Past the connect deadline and heartbeating: building an engine may take minutes
            # (a first torch import on a loaded machine, a vLLM model), and the hub drops a
            # peer silent for its peer_timeout_s.
            self._model_route = (http, conn.hub_base_url)
            try:
                await self._adopt(welcome)
            except SnapshotError as exc:  # a hub whose model files do not verify: retried later
                log.error("cannot build an engine from hub %s's model files: %s", self.url, exc)
                heartbeat.cancel()
                await conn.close(m.CLOSE_PROTOCOL_ERROR, "bad model files")
                return False
            self._conn = conn
            self._connected.set()
            try:
                await self._greet(conn)
                await self._read(conn)
            finally:
                self._conn = None
                self._connected.clear()
                self.fetcher.cancel()
                heartbeat.cancel()
        return True

    async def _greet(self, conn: HubConnection) -> None:
        """What a new connection says first: what we hold, what the hub has not answered, and
        how many leases we can take."""
        await self.swapper.announce()
        for sub in self.outbox.pending():  # unanswered: the hub may never have seen them
            await conn.send(sub)
        if self.cfg.engine != "relay":
            held = self.worker.held()
            await conn.send(m.LeaseRequest(max(self.cfg.leases_in_flight - held, 0)))

    # --- adoption ------------------------------------------------------------------------

    async def _adopt(self, welcome: m.Welcome) -> None:
        """Apply what the protocol decides a welcome means (`peer_protocol.adoption`)."""
        # First, so that our chunk server answers the hub's probe while an engine is built.
        if welcome.env and self.cfg.engine != "relay":  # before an engine is built for nothing
            try:  # off the loop: loading one (verifiers: its import, its rows) takes seconds
                self.env = await asyncio.to_thread(require_environment, welcome.env,
                                                   welcome.env_version)
            except EnvironmentMissing as exc:
                raise JoinRefused(str(exc)) from None
        self.tickets.admit(welcome.hub_key, welcome.run_id, welcome.peer_id)
        self.credentials = Credentials(welcome.run_id, welcome.peer_id, self._key, welcome.ticket)
        self.fetcher.adopt(self.credentials)
        decision = pp.adoption(self.welcome, welcome, held_version=self.version,
                               has_engine=self.swapper.engine is not None,
                               relay=self.cfg.engine == "relay")
        if decision.build_model is not None:
            self.swapper.set_engine(await self._build(welcome))
        if decision.new_run:
            # A different run: our weights say nothing about its versions, its leases are not ours.
            self._drop_versions()
            self.worker.drop_leases()
            self.outbox.clear()
        elif decision.resumed_behind:
            # The hub resumed from a checkpoint older than what we hold: our newer versions
            # will never be trained on, and it will publish different ones under their numbers.
            dropped = self.outbox.drop_newer_than(welcome.version)
            log.warning("hub resumed at v%d, behind our v%d: dropping it and %d rollouts made "
                        "with it", welcome.version, self.version, dropped)
            self._drop_versions()
        self.welcome = welcome
        # the reward is None where only the hub scores
        self.worker.adopt(welcome, self.env, self._reward_for(welcome.task_kind))
        self._welcomed.set()

    async def _build(self, welcome: m.Welcome) -> Engine:
        """The engine for `welcome`'s model: its files fetched from the hub and verified
        (`model_files`; never `welcome.model` as a path), then built in a worker thread.
        Never cancelled (`wait_built`): a thread cannot be, so a connection lost meanwhile leaves
        the build running, and the next connection waits for it instead of starting another."""
        model = (welcome.model, welcome.model_digest)
        if self._building is None or self._building[0] != model:
            assert self._model_route is not None and self.credentials is not None
            http, base_url = self._model_route
            source = await model_directory(
                http, base_url, welcome, self.credentials.header("hub"),
                cache=self.cfg.model_cache_dir, timeout_s=self.cfg.hub_timeout_s)
            self._building = (model, asyncio.get_running_loop().run_in_executor(
                None, build_engine, self.cfg, source))
        engine = await wait_built(self._building[1], self.cfg.engine)
        self._building = None
        return engine

    def _drop_versions(self) -> None:
        self.swapper.drop()
        self.fetcher.drop_versions()

    # --- reader --------------------------------------------------------------------------

    async def _read(self, conn: HubConnection) -> None:
        """Frames -> the protocol -> events -> the parts, until the hub goes (or breaks a rule:
        then we close with the protocol's code)."""
        while True:
            try:
                frame = await conn.ws.receive(timeout=self.cfg.hub_timeout_s)
            except TimeoutError:
                await conn.close(m.CLOSE_TIMEOUT, "hub silent")
                return
            if frame.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                              aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.ERROR):
                log.info("hub closed the connection (%s)", conn.ws.close_code)
                return
            try:
                if frame.type is not aiohttp.WSMsgType.BINARY:
                    raise RemoteProtocolError("non-binary frame", m.CLOSE_UNSUPPORTED_DATA)
                event = conn.protocol.receive(frame.data, loop_now())
                if isinstance(event, pp.HubLeft):
                    log.warning("hub said goodbye: %s (%d)", event.reason, event.code)
                    return
                self._on_event(conn, event)
                self.swapper.changed()  # a condition on the peer's state may hold now: `until`
            except (RemoteProtocolError, SnapshotError) as exc:
                reason = exc.reason if isinstance(exc, RemoteProtocolError) else "bad snapshot"
                log.error("closing: %s", exc)
                await conn.close(getattr(exc, "code", m.CLOSE_PROTOCOL_ERROR), reason)
                return

    def _on_event(self, conn: HubConnection, event: pp.Event | None) -> None:
        if isinstance(event, pp.LeaseGranted):
            self.worker.take(event.grant, event.deadline)
        elif isinstance(event, pp.RolloutAcked):
            self._acked += 1
            self.outbox.pop(event.lease_id)
        elif isinstance(event, pp.RolloutRejected):
            self._rejected[event.reason] += 1
            self.outbox.pop(event.lease_id)
            log.info("rollout %s rejected: %s", event.lease_id, event.reason)
        elif isinstance(event, pp.VersionAnnounced):
            self.fetcher.start(conn, event.manifest, event.plan)
        elif isinstance(event, pp.PlanRevised):
            self.fetcher.revise(event.plan)

    # --- what the parts call -------------------------------------------------------------

    async def send(self, msg: m.Message) -> None:
        """Send on the connection now, if there is one; else (or if it breaks) drop: what must
        not be lost is in the outbox, and a new connection asks for leases afresh."""
        if (conn := self._conn) is None:
            return
        try:
            await conn.send(msg)
        except (ConnectionError, aiohttp.ClientError, ProtocolError) as exc:
            log.debug("not sent (%s): %s", type(msg).__name__, exc)

    async def _keep_alive(self, conn: HubConnection) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)  # a timer, not a sync
            await conn.send(m.Heartbeat())
            now = loop_now()
            if now - self._summarized[0] >= SUMMARY_EVERY_S:
                log.info("%s", self._summary(now))

    def _summary(self, now: float) -> str:
        """The periodic INFO line: the version held, how many came since the last, the rollouts."""
        s, fetched = self.statistics(), self.fetcher.versions_fetched
        (since_s, before), self._summarized = self._summarized, (now, fetched)
        held = (f"holding v{s.version} ({fetched - before} versions fetched in the last "
                f"{now - since_s:.0f} s)" if s.version is not None
                else "starting the engine" if self._building is not None
                else "waiting for the first version")
        return (f"{held}; {s.submitted} rollout groups submitted, {s.acked} acked, "
                f"rejected: {s.rejected or 'none'}")


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first leaf exception of a (possibly nested) exception group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
