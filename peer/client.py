"""The peer's network shell: join a hub, hold the newest version, turn leases into rollouts.

Two tasks live as long as the peer: the worker (lease -> generate with the engine's current
version -> score -> submit, tagged with the version actually used) and the swapper (loads a
complete version into the engine between two generations: the swap is atomic, generation goes
on with the old weights while a download is under way). Each connection adds the reader (frames
through the core `Session`), the heartbeat, and one download per announced version, which pulls
its chunks over HTTP by the hub's relay plan (`echo2p2p.overlay`). The peer's own chunk server,
started once, serves what it holds to the other peers.

When the hub goes away the peer keeps generating the leases it holds, keeps every rollout the
hub has not answered in its `Outbox`, reconnects with capped exponential backoff, and sends
them again: a hub killed and resumed from its checkpoint (`echo2-hub serve --resume`) admits
them within S of its resumed step. The "relay" engine holds and serves versions but generates
nothing: a pure relay node.

The engine is only ever touched under `_engine_lock` (a thread lock: generation and loading
run in worker threads so the event loop keeps reading the socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import socket
import ssl
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p.errors import JoinRefused, ProtocolError, RemoteProtocolError, SnapshotError
from echo2p2p.session import Session, Side
from echo2p2p import signing
from echo2p2p.bounds import check_from_peer
from echo2p2p.signing import verify_manifest
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.tasks import reward_fn

from echo2p2p.runtime import http_deadlines
from .config import PeerConfig, normalize_url
from .outbox import Outbox
from echo2p2p.overlay.download import Download
from echo2p2p.overlay.serving import TokenBucket, UploadMeter, chunk_handler
from echo2p2p.overlay.store import ChunkStore
from echo2p2p.overlay.tickets import Credentials, Tickets

log = logging.getLogger(__name__)


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
    """A rollout worker. `engine` may be given (tests, wrappers); else it is built on welcome."""

    def __init__(self, cfg: PeerConfig, engine: Any = None):
        self.cfg = cfg
        self.url = normalize_url(cfg.hub_url)
        self.engine = engine
        self.version: int | None = None  # what the engine holds now
        self.welcome: m.Welcome | None = None
        self._engine_lock = threading.Lock()
        self._staged: tuple[int, dict] | None = None
        self._staged_event = asyncio.Event()
        self._loaded_event = asyncio.Event()
        self._connections = self._loaded = self._submitted = self._acked = self._downloaded = 0
        self._rejected: Counter[str] = Counter()
        self._draw = 0
        self.store = ChunkStore(cfg.keep_versions)
        self.meter = UploadMeter()
        self.tickets = Tickets()  # who may fetch from our chunk server: set at welcome
        self._key = signing.new_private_key()  # signs our chunk requests; the hub's ticket binds it
        self.credentials: Credentials | None = None  # what we show chunk servers: set at welcome
        self.served_url: str | None = None  # where other peers reach our chunk server
        self._download: tuple[Download, asyncio.Task] | None = None
        self._building: tuple[str, asyncio.Future] | None = None  # (model, engine on its way)
        self._conn: _Conn | None = None  # the connection now, if any
        self._leases: asyncio.Queue[tuple[m.LeaseGrant, float]] = asyncio.Queue()
        self._generating = 0
        self._scorer: Scorer | None = None  # claimed rewards (`_scorer_for`)
        self.outbox = Outbox(int(cfg.outbox_memory_mb * (1 << 20)), cfg.outbox_max, cfg.spool_dir)

    def statistics(self) -> PeerStats:
        return PeerStats(self._connections, self._loaded, self.version, self._submitted,
                         self._acked, dict(self._rejected), self._downloaded)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Stay joined until `stop` is set: connect, serve, and reconnect with backoff. Raises
        JoinRefused if the hub refuses our join token: retrying would not help."""
        stop = stop or asyncio.Event()
        refused: JoinRefused | None = None
        backoff = 0.5
        tls = ssl.create_default_context(cafile=self.cfg.ca_cert or None)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as http, \
                self._chunk_server(), self._workers():
            while not stop.is_set():
                try:
                    async with asyncio.TaskGroup() as tg:
                        conn = tg.create_task(self._connection(http))
                        stopper = tg.create_task(stop.wait())
                        done, _ = await asyncio.wait({conn, stopper},
                                                     return_when=asyncio.FIRST_COMPLETED)
                        conn.cancel()
                        stopper.cancel()
                    if conn.done() and not conn.cancelled() and conn.result():
                        backoff = 0.5  # we were welcomed: the next failure starts over
                except* JoinRefused as group:
                    refused = _first(group)
                except* (aiohttp.ClientError, OSError, TimeoutError, ProtocolError) as group:
                    log.warning("hub %s unreachable or broke off: %s", self.url, _first(group))
                if refused is not None or stop.is_set():
                    break
                delay = backoff * random.uniform(0.5, 1.0)
                log.info("reconnecting in %.1f s", delay)
                try:
                    await asyncio.wait_for(stop.wait(), delay)  # a timer that stop cuts short
                except TimeoutError:
                    pass
                backoff = min(backoff * 2, self.cfg.reconnect_max_s)
        if refused is not None:  # raised out here: inside, `_workers`' TaskGroup would wrap it
            raise refused

    @contextlib.asynccontextmanager
    async def _workers(self):
        """The worker and the swapper, across connections (a bug in either stops the peer)."""
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._swap_versions())]
            if self.cfg.engine != "relay":
                tasks.append(tg.create_task(self._work()))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                self.outbox.close()
                if self._scorer is not None:
                    self._scorer.close()
                    self._scorer = None

    @contextlib.asynccontextmanager
    async def _chunk_server(self):
        """Serve our chunks at `cfg.listen` for as long as the peer runs (nothing if '')."""
        if not self.cfg.listen:
            yield
            return
        limiter = TokenBucket(self.cfg.upload_limit_mbps * 1e6) if self.cfg.upload_limit_mbps else None
        app = web.Application()
        app.router.add_get("/chunk/{version}/{base}/{index}",
                           chunk_handler(lambda *a: self.store.chunk(*a), self.meter, limiter,
                                         authorize=self.tickets))
        runner = http_deadlines.runner(app)  # idle and request-head deadlines
        await runner.setup()
        host, port = self.cfg.listen_host_port
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        self.served_url = self.cfg.advertise or \
            f"http://{_reachable_host(host, self.url)}:{bound_port}"
        log.info("serving chunks on %s:%d as %s", host, bound_port, self.served_url)
        try:
            yield
        finally:
            await runner.cleanup()

    async def _connection(self, http: aiohttp.ClientSession) -> bool:
        """One connection's life; returns True if the hub welcomed us."""
        cfg = self.cfg
        async with asyncio.timeout(cfg.connect_timeout_s) as deadline:
            ws = await http.ws_connect(self.url, max_msg_size=cfg.max_frame_bytes, compress=0)
            try:
                session, welcome = await self._handshake(ws)
            except BaseException as exc:  # timeout included: never leave the socket open
                code = exc.code if isinstance(exc, ProtocolError) else m.CLOSE_GOING_AWAY
                await ws.close(code=code, message=b"handshake failed")
                raise
            deadline.reschedule(None)
        self._connections += 1
        log.info("joined %s as %s (run %s, model %s, v%d)", self.url, welcome.peer_id,
                 welcome.run_id, welcome.model, welcome.version)
        conn = _Conn(ws, session, http, cfg.hub_timeout_s, asyncio.current_task())
        async with ws, asyncio.TaskGroup() as tg:
            conn.tg = tg
            helpers = [tg.create_task(self._keep_alive(conn))]
            # Past the connect deadline and heartbeating: building an engine may take minutes
            # (a first torch import on a loaded machine, a vLLM model), and the hub drops a
            # peer silent for its peer_timeout_s.
            await self._adopt(welcome)
            self._conn = conn
            try:
                if self.version is not None:
                    await conn.send(m.VersionHeld(self.version))
                for sub in self.outbox.pending():  # unanswered: the hub may never have seen them
                    await conn.send(sub)
                if cfg.engine != "relay":
                    held = self._leases.qsize() + self._generating
                    await conn.send(m.LeaseRequest(max(cfg.leases_in_flight - held, 0)))
                await self._read(conn)
            finally:
                self._conn = None
                if self._download is not None:
                    self._download[1].cancel()
                    self._download = None
                for task in helpers:
                    task.cancel()
        return True

    async def _handshake(self, ws: aiohttp.ClientWebSocketResponse) -> tuple[Session, m.Welcome]:
        """Hello -> Welcome, and the pinned key checked (the caller adopts the welcome)."""
        cfg = self.cfg
        session = Session(Side.PEER, _now())
        nonce = secrets.token_bytes(32)
        peer_key = signing.public_key(self._key)
        await ws.send_bytes(session.send(m.Hello(
            cfg.display_name, cfg.engine, cfg.device, cfg.price_per_hour, self.served_url,
            cfg.token, nonce, peer_key)))
        frame = await ws.receive()
        if frame.type is not aiohttp.WSMsgType.BINARY:
            raise RemoteProtocolError(f"hub closed before welcome ({ws.close_code})")
        welcome = session.receive(frame.data, _now())
        if not isinstance(welcome, m.Welcome):  # a Goodbye
            if welcome.code == m.CLOSE_UNAUTHORIZED:
                raise JoinRefused(f"hub {self.url} refused us: {welcome.reason}")
            raise RemoteProtocolError(f"hub refused us: {welcome.reason}")
        pinned = cfg.pinned_hub_key
        if pinned is not None and welcome.hub_key != pinned:
            raise RemoteProtocolError(f"hub {self.url} signs with key "
                                      f"{welcome.hub_key.hex() or '(none)'}, not the pinned --hub-key")
        # Echoing a public key proves nothing: the hub signs our fresh nonce with its key.
        if (pinned is not None or welcome.hub_key) and not signing.verify_welcome(
                welcome.hub_key, nonce, welcome.run_id, welcome.peer_id, peer_key, welcome.proof):
            raise RemoteProtocolError(f"hub {self.url} cannot prove it holds key "
                              f"{welcome.hub_key.hex()[:16]}...: its welcome is not signed by it")
        return session, welcome

    async def _adopt(self, welcome: m.Welcome) -> None:
        # First, so that our chunk server answers the hub's probe while an engine is built.
        self.tickets.admit(welcome.hub_key, welcome.run_id, welcome.peer_id)
        self.credentials = Credentials(welcome.run_id, welcome.peer_id, self._key, welcome.ticket)
        new_model = self.engine is None or (self.welcome and self.welcome.model != welcome.model)
        if new_model and self.cfg.engine != "relay":
            if self._building is None or self._building[0] != welcome.model:
                self._building = (welcome.model, asyncio.get_running_loop().run_in_executor(
                    None, _build_engine, self.cfg, welcome.model))
            # Shielded: a thread cannot be cancelled, so a connection lost meanwhile leaves the
            # build running, and the next connection waits for it instead of starting another.
            self.engine = await asyncio.shield(self._building[1])
            self._building = None
            self.version = None
        if self.welcome and self.welcome.run_id != welcome.run_id:
            self.version = None  # a different run: our weights say nothing about its versions
            self._staged = None
            self.store = ChunkStore(self.cfg.keep_versions)
            while not self._leases.empty():  # another run's leases
                self._leases.get_nowait()
            self.outbox.clear()
        elif self.version is not None and welcome.version < self.version:
            # The hub resumed from a checkpoint older than what we hold: our newer versions
            # will never be trained on, and it will publish different ones under their numbers.
            dropped = self.outbox.drop_newer_than(welcome.version)
            log.warning("hub resumed at v%d, behind our v%d: dropping it and %d rollouts made "
                        "with it", welcome.version, self.version, dropped)
            self.version = None
            self._staged = None
            self.store = ChunkStore(self.cfg.keep_versions)
        self.welcome = welcome
        self.reward = reward_fn(welcome.task)

    # --- reader --------------------------------------------------------------------------

    async def _read(self, conn: _Conn) -> None:
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
                msg = conn.session.receive(frame.data, _now())
                if isinstance(msg, m.Goodbye):
                    if msg.code == m.CLOSE_UNAUTHORIZED:
                        raise JoinRefused(f"hub {self.url} sent us away: {msg.reason}")
                    log.warning("hub said goodbye: %s (%d)", msg.reason, msg.code)
                    return
                if isinstance(msg, m.LeaseGrant):
                    self._leases.put_nowait((msg, _now() + msg.deadline_s))
                elif isinstance(msg, m.Ack):
                    self._acked += 1
                    self.outbox.pop(msg.lease_id)
                elif isinstance(msg, m.Reject):
                    self._rejected[msg.reason] += 1
                    self.outbox.pop(msg.lease_id)
                    log.info("rollout %s rejected: %s", msg.lease_id, msg.reason)
                elif isinstance(msg, m.VersionAnnouncement):
                    if self.welcome.hub_key:  # a manifest we cannot trust is never assembled
                        verify_manifest(self.welcome.hub_key, msg.manifest, msg.signature)
                    if (msg.plan.version, msg.plan.base_version) != (
                            msg.manifest.version, msg.manifest.base_version):
                        raise RemoteProtocolError("a version announced with another's relay plan")
                    self._start_download(conn, msg.manifest, msg.plan)
                elif isinstance(msg, m.RelayPlan):
                    if self._download is not None:
                        held = self._download[0].held
                        if held.key == (msg.version, msg.base_version):
                            self._download[0].set_plan(msg)
            except (RemoteProtocolError, SnapshotError) as exc:
                reason = exc.reason if isinstance(exc, RemoteProtocolError) else "bad snapshot"
                log.error("closing: %s", exc)
                await conn.close(getattr(exc, "code", m.CLOSE_PROTOCOL_ERROR), reason)
                return

    def _start_download(self, conn: _Conn, manifest: m.Manifest, plan: m.RelayPlan) -> None:
        """Fetch the announced version, dropping an older download still under way."""
        if self._download is not None:
            if self._download[0].held.manifest.version >= manifest.version:
                return
            self._download[1].cancel()
            self._download = None
        held = self.store.begin(manifest)
        if held is None:
            log.warning("v%d is a delta against v%s, which we no longer hold; waiting for a full "
                        "version", manifest.version, manifest.base_version)
            return
        cfg = self.cfg
        download = Download(self.store, held, http=conn.http, hub_base_url=_http_base(self.url),
                            me=self.welcome.peer_id, report=conn.send, stall_s=cfg.relay_stall_s,
                            credentials=self.credentials)
        download.set_plan(plan)
        self._download = (download, conn.tg.create_task(self._fetch_version(conn, download)))

    async def _fetch_version(self, conn: _Conn, download: Download) -> None:
        held = download.held
        version = held.manifest.version
        try:
            stats = await download.run()
            self._downloaded += stats.bytes_from_hub + stats.bytes_from_peers
            await asyncio.to_thread(self.store.finish, held)
        except SnapshotError as exc:
            log.error("giving up on v%d: %s", version, exc)
            return
        finally:
            if self._download is not None and self._download[0] is download:
                self._download = None
        log.info("v%d complete in %.2f s (%d bytes from the hub, %d from peers)", version,
                 stats.download_s, stats.bytes_from_hub, stats.bytes_from_peers)
        await conn.send(m.TransferReport(
            version, held.manifest.base_version, stats.download_s, stats.bytes_from_hub,
            stats.bytes_from_peers, stats.sources))
        if self.version == version:
            return  # announced again after a reconnect: the engine has it already
        if self.cfg.engine == "relay":
            self.version = version
            await conn.send(m.VersionHeld(version))
            return
        from echo2p2p.policy.weights import tensors_to_state

        state = await asyncio.to_thread(lambda: tensors_to_state(held.assembler.tensors()))
        self._staged = (version, state)
        self._staged_event.set()

    # --- swapper and worker --------------------------------------------------------------

    async def _swap_versions(self) -> None:
        while True:
            await self._staged_event.wait()
            self._staged_event.clear()
            staged, self._staged = self._staged, None
            if staged is None:
                continue
            await asyncio.to_thread(self._load, *staged)
            self._loaded_event.set()
            await self._send(m.VersionHeld(staged[0]))

    def _load(self, version: int, state: dict) -> None:
        with self._engine_lock:
            self.engine.load_weights(state)
            self.version = version
        self._loaded += 1
        log.debug("now generating with v%d", version)

    def _generate(self, lease: m.LeaseGrant, seed: int) -> tuple[int | None, list]:
        w = self.welcome
        with self._engine_lock:
            version = self.version
            out = self.engine.generate(lease.prompt_ids, lease.group_size, temperature=w.temperature,
                                       top_p=w.top_p, max_new_tokens=w.max_new_tokens, seed=seed)
        return version, out

    async def _work(self) -> None:
        """Leases to rollouts, connected or not: a rollout made while the hub is away waits in
        the outbox, which the next connection sends first. The claimed rewards are scored in a
        worker process under a deadline (`echo2p2p.scoring.scorer`), never on the event loop."""
        while True:
            lease, deadline = await self._leases.get()
            self._generating = 1
            try:
                if not await self._wait_version(lease.min_version, deadline):
                    await self._send(m.LeaseRequest(1))  # too late; the hub re-issues it
                    continue
                self._draw += 1
                version, completions = await asyncio.to_thread(
                    self._generate, lease, self.welcome.seed * 1_000_003 + self._draw)
                if version is None or version < lease.min_version:
                    await self._send(m.LeaseRequest(1))
                    continue
                scored = await self._scorer_for(self.reward).score(
                    [(lease.answer, c.text) for c in completions])
                samples = [m.Sample(m.pack_ids(c.token_ids), m.pack_logprobs(c.logprobs),
                                    c.text, r, c.finish_reason)
                           for c, r in zip(completions, scored.rewards)]
                sub = m.RolloutSubmission(lease.lease_id, version, samples)
                try:  # what the hub would refuse by closing us (and again at every resend)
                    check_from_peer(sub, self.welcome)
                except RemoteProtocolError as exc:
                    log.warning("dropping rollout %s: %s", lease.lease_id, exc.reason)
                    await self._send(m.LeaseRequest(1))
                    continue
                self.outbox.put(sub)
                self._submitted += 1
                await self._send(sub)
                await self._send(m.LeaseRequest(1))
            finally:
                self._generating = 0

    def _scorer_for(self, reward: Any) -> Scorer:
        """The scorer of `reward`: made on first use, and again when a welcome brings another
        task's reward function (the old one's workers are stopped)."""
        if self._scorer is None or self._scorer.reward is not reward:
            if self._scorer is not None:
                self._scorer.close()
            self._scorer = Scorer(reward, timeout_s=self.cfg.score_timeout_s, name="peer-scorer")
        return self._scorer

    async def _send(self, msg: m.Message) -> None:
        """Send on the connection now, if there is one; else (or if it breaks) drop: what must
        not be lost is in the outbox, and a new connection asks for leases afresh."""
        if (conn := self._conn) is None:
            return
        try:
            await conn.send(msg)
        except (ConnectionError, aiohttp.ClientError, ProtocolError) as exc:
            log.debug("not sent (%s): %s", type(msg).__name__, exc)

    async def _wait_version(self, min_version: int, deadline: float) -> bool:
        """Wait until the engine holds a version >= min_version; False if the deadline passes."""
        while self.version is None or self.version < min_version:
            self._loaded_event.clear()
            try:
                await asyncio.wait_for(self._loaded_event.wait(), deadline - _now())
            except TimeoutError:
                return False
        return True

    async def _keep_alive(self, conn: _Conn) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)  # a timer, not a sync
            await conn.send(m.Heartbeat())
            s = self.statistics()
            log.info("holding v%s; %d rollout groups submitted, %d acked, rejected: %s",
                     s.version, s.submitted, s.acked, s.rejected or "none")


@dataclass
class _Conn:
    ws: aiohttp.ClientWebSocketResponse
    session: Session
    http: aiohttp.ClientSession
    send_deadline_s: float
    task: asyncio.Task | None  # the connection's own task, cancelled if the hub stops reading
    tg: asyncio.TaskGroup | None = None
    lock: asyncio.Lock | None = None

    async def send(self, msg: m.Message) -> None:
        if self.lock is None:
            self.lock = asyncio.Lock()
        frame = self.session.send(msg)
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


def _build_engine(cfg: PeerConfig, model: str) -> Any:
    """Import torch and the engine, then build it: for a worker thread, since the first import
    alone takes seconds (tens of them on a loaded machine) and would stall the event loop."""
    from echo2p2p.policy.engines import make_engine

    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    return make_engine(cfg.engine, model, cfg.device)


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first leaf exception of a (possibly nested) exception group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _now() -> float:
    return asyncio.get_running_loop().time()


def _http_base(ws_url: str) -> str:
    """http://HOST:PORT of the hub, whose chunk route sits beside its websocket."""
    scheme, rest = ws_url.split("://", 1)
    return f"{'https' if scheme == 'wss' else 'http'}://{rest.split('/', 1)[0]}"


def _reachable_host(listen_host: str, hub_url: str) -> str:
    """The address other peers should use: the listen host, or for a wildcard, the address of
    the interface that routes to the hub (a connected UDP socket sends nothing)."""
    if listen_host not in ("", "0.0.0.0", "::"):
        return listen_host
    hub_host = hub_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((hub_host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
