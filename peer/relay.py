"""The overlay's moving parts: keep versions, serve their chunks, fetch chunks by the hub's plan.

- `ChunkStore`: the manifests being assembled or held (the newest `keep` versions), their
  verified wire chunks, and the raw streams of complete versions (the bases of deltas).
- `chunk_handler`: GET /chunk/{version}/{base}/{index}?wait=S, served by peers and by the hub.
  A chunk not here yet is waited for up to `wait` seconds (a long poll), so it is forwarded the
  moment it is verified, while the next one is still arriving; then "503 not yet". A version no
  longer kept answers 404. Uploads go through an optional token bucket (an in-process uplink
  cap) and are counted by an `UploadMeter`.
- `Download`: fetches one manifest's chunks: each from its owner in the plan (the hub for the
  chunks this peer owns), at most `window` requests in flight per source, every request under a
  deadline. A source that serves a corrupt chunk, stalls or cannot be reached is reported to the
  hub and avoided; its chunks wait briefly for the hub's new plan, then come from the hub. The
  hub is the last resort: a failed request to it (a busy hub queues requests) is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from tqdm import tqdm

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.errors import SnapshotError
from echo2p2p.relay import owners_of
from echo2p2p.snapshot import ChunkAssembler

log = logging.getLogger(__name__)

Key = tuple[int, int | None]  # (version, base version or None for a full snapshot)
GONE = b""  # what a lookup answers for a version this host no longer keeps
MAX_WAIT_S = 30.0  # longest long poll a server grants
PIECE_BYTES = 64 << 10  # uploads are written (and rate-limited) in pieces of this size
MIN_RATE_BYTES_S = 256 << 10  # a transfer slower than this counts as stalled
WRITE_DEADLINE_S = 10.0  # a chunk receiver that takes no piece for this long is cut off
HUB_RETRY_S = 1.0  # after a failed request to the hub, ask it again this much later
TICKET_HEADER = "X-Echo2-Ticket"  # "<peer id>.<hex peer key>.<hex ticket>.<hex auth>"
UPLOAD_SLOTS = 2  # responses a chunk server sends at once (see chunk_handler)


def chunk_path(version: int, base: int | None, index: int) -> str:
    return f"/chunk/{version}/{'full' if base is None else base}/{index}"


@dataclass
class Held:
    """One manifest this peer assembles or holds."""

    manifest: m.Manifest
    assembler: ChunkAssembler
    wires: list[bytes | None]

    @property
    def key(self) -> Key:
        return self.manifest.version, self.manifest.base_version


class ChunkStore:
    """The versions this peer holds or is assembling; owned by one event loop."""

    def __init__(self, keep: int = 3):
        self.keep = keep
        self._held: dict[Key, Held] = {}
        self._streams: dict[int, memoryview] = {}  # version -> verified raw stream
        self._pulse = asyncio.Event()  # set and replaced whenever anything arrives

    def begin(self, manifest: m.Manifest) -> Held | None:
        """Start (or resume) assembling `manifest`; None for a delta whose base is not here."""
        key = (manifest.version, manifest.base_version)
        if key in self._held:
            return self._held[key]
        base = None
        if manifest.base_version is not None:
            base = self._streams.get(manifest.base_version)
            if base is None:
                return None
        held = Held(manifest, ChunkAssembler(manifest, base=base), [None] * len(manifest.chunks))
        self._held[key] = held
        for old in sorted({v for v, _ in self._held})[:-self.keep]:
            for k in [k for k in self._held if k[0] == old]:
                del self._held[k]
        self._notify()
        return held

    async def add(self, held: Held, index: int, data: bytes) -> bool:
        """Verify chunk `index` (in a thread) and keep it to serve; True once all are in.
        Raises SnapshotError if it fails verification."""
        complete = await asyncio.to_thread(held.assembler.add, index, data)
        if held.wires[index] is None:
            held.wires[index] = data
            self._notify()
        return complete

    def finish(self, held: Held) -> memoryview:
        """The complete, digest-checked stream of `held`, kept as a base for later deltas.
        Blocking (hashes the stream): call it in a thread. Raises SnapshotError."""
        stream = held.assembler.stream()
        self._streams[held.manifest.version] = stream
        for old in sorted(self._streams)[:-self.keep]:
            del self._streams[old]
        return stream

    def newest_stream(self) -> int | None:
        """The newest version whose whole stream is here."""
        return max(self._streams, default=None)

    async def chunk(self, version: int, base: int | None, index: int, wait_s: float) -> bytes | None:
        """Chunk `index` of manifest (version, base): its bytes, None if it did not arrive within
        `wait_s`, GONE if this peer no longer keeps that version."""
        deadline = time.monotonic() + wait_s
        while True:
            pulse = self._pulse
            held = self._held.get((version, base))
            if held is not None and 0 <= index < len(held.wires) and held.wires[index] is not None:
                return held.wires[index]
            if held is None and self._held and version < min(v for v, _ in self._held):
                return GONE
            if held is not None and not 0 <= index < len(held.wires):
                return GONE
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pulse.wait(), remaining)

    def _notify(self) -> None:
        self._pulse.set()
        self._pulse = asyncio.Event()


@dataclass
class UploadMeter:
    """What a chunk server has sent. (Its upload *bandwidth* cannot be read here: the kernel
    buffers megabytes past the last write; receivers measure it instead, see TransferReport.)"""

    served_bytes: int = 0


class TokenBucket:
    """An in-process uplink cap of `rate_bps` bits/s, shared by every upload of this process."""

    def __init__(self, rate_bps: float):
        self.rate = rate_bps / 8  # bytes/s
        self._free_at = time.monotonic()  # when the bytes already granted will have gone out

    async def take(self, nbytes: int) -> None:
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + nbytes / self.rate
        if self._free_at - now > PIECE_BYTES / self.rate:  # keep at most one piece in flight
            await asyncio.sleep(self._free_at - now - PIECE_BYTES / self.rate)  # pacing timer


Lookup = Callable[[int, int | None, int, float], Awaitable[bytes | None]]


class Tickets:
    """Who may fetch chunks from this server, `audience` (our peer id, or "hub"): holders of a
    ticket the hub signed for this run whose request also carries their own signature naming
    this server (`signing.chunk_auth`), so a header seen by one server opens no other. Until
    `admit` names the hub's key, the run and who we are (a peer learns them in its welcome)
    nobody may; a hub without a signing key (a bench rig) issues no tickets, and then anyone may.
    """

    def __init__(self, hub_key: bytes | None = None, run_id: str = "", audience: str = "") -> None:
        self.hub_key, self.run_id, self.audience = hub_key, run_id, audience
        self._valid: set[str] = set()  # header values already verified

    def admit(self, hub_key: bytes, run_id: str, audience: str) -> None:
        if (hub_key, run_id, audience) != (self.hub_key, self.run_id, self.audience):
            self.hub_key, self.run_id, self.audience, self._valid = hub_key, run_id, audience, set()

    def __call__(self, request: web.Request) -> bool:
        if self.hub_key == b"":
            return True
        value = request.headers.get(TICKET_HEADER, "")
        if value in self._valid:
            return True
        ok = self.hub_key is not None and len(value) <= 512 and self._verify(value)
        if ok and len(self._valid) < 100_000:
            self._valid.add(value)
        return ok

    def _verify(self, value: str) -> bool:
        parts = value.split(".")
        if len(parts) != 4:
            return False
        peer_id = parts[0]
        try:
            peer_key, ticket, auth = (bytes.fromhex(p) for p in parts[1:])
        except ValueError:
            return False
        return (signing.verify_ticket(self.hub_key, self.run_id, peer_id, peer_key, ticket)
                and signing.verify_chunk_auth(peer_key, self.run_id, self.audience, auth))


class Credentials:
    """What this side shows chunk servers: its peer id, its key pair, the hub's ticket for
    them, and a signature per server asked (made once, kept)."""

    def __init__(self, run_id: str, peer_id: str, private_key: bytes, ticket: bytes) -> None:
        self.run_id, self.peer_id, self.ticket = run_id, peer_id, ticket
        self._key = private_key
        self._prefix = f"{peer_id}.{signing.public_key(private_key).hex()}.{ticket.hex()}."
        self._headers: dict[str, dict[str, str]] = {}

    def header(self, audience: str) -> dict[str, str]:
        """The ticket header for a request to the server of `audience` (a peer id or "hub")."""
        if not self.ticket:
            return {}
        if audience not in self._headers:
            if len(self._headers) > 10_000:  # peer ids come and go over a long run
                self._headers.clear()
            auth = signing.chunk_auth(self._key, self.run_id, audience)
            self._headers[audience] = {TICKET_HEADER: self._prefix + auth.hex()}
        return self._headers[audience]


def server_base(url: str) -> str | None:
    """scheme://host:port of an advertised chunk server URL, or None if it has no such form.
    Requests are built from these parts only: a path, query, fragment or user name someone
    else put in the URL never reaches a request (nor does our ticket go to a URL they chose)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host or port is None or len(url) > 256:
        return None
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def chunk_handler(lookup: Lookup, meter: UploadMeter, limiter: TokenBucket | None = None,
                  on_served: Callable[[int, int], None] | None = None, slots: int = UPLOAD_SLOTS,
                  authorize: Callable[[web.Request], bool] | None = None,
                  write_deadline_s: float = WRITE_DEADLINE_S):
    """The aiohttp handler for GET /chunk/{version}/{base}/{index}?wait=S.

    With `authorize` (a `Tickets`), requests without a valid ticket get 403.

    At most `slots` responses send at once; the others queue (FIFO). Many flows bursting into
    one uplink at once overflow its queue and lose packets (measured with tbf: 10-25 % dropped
    with 8 receivers at once), while one or two flows at a time keep it full without loss.
    """
    sending = asyncio.Semaphore(slots)

    async def handle(request: web.Request) -> web.StreamResponse:
        if authorize is not None and not authorize(request):
            return web.Response(status=403, text="a ticket from this run's hub is required")
        info = request.match_info
        try:
            version, index = int(info["version"]), int(info["index"])
            base = None if info["base"] == "full" else int(info["base"])
            wait_s = float(request.query.get("wait", "0"))
            if not math.isfinite(wait_s):
                raise ValueError("wait must be finite")
            wait_s = min(max(wait_s, 0.0), MAX_WAIT_S)
        except ValueError:
            return web.Response(status=400, text="expected /chunk/VERSION/BASE|full/INDEX?wait=S")
        data = await lookup(version, base, index, wait_s)
        if data is None:
            return web.Response(status=503, text="not yet")
        if data is GONE:
            return web.Response(status=404, text="not kept here")
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = len(data)
        view = memoryview(data)
        try:
            async with sending:
                await response.prepare(request)
                for pos in range(0, len(view), PIECE_BYTES):
                    piece = view[pos:pos + PIECE_BYTES]
                    if limiter is not None:
                        await limiter.take(len(piece))
                    async with asyncio.timeout(write_deadline_s):  # else one idle reader holds a slot
                        await response.write(piece)
                    meter.served_bytes += len(piece)
                await response.write_eof()
        except ConnectionError:
            return response  # the receiver went away (or gave up): nothing to tell it
        except TimeoutError:
            log.info("cut off a chunk receiver that stopped reading (%s)", request.remote)
            if request.transport is not None:
                request.transport.abort()
            return response
        if on_served is not None:
            on_served(version, len(data))
        return response

    return handle


@dataclass(frozen=True)
class TransferStats:
    download_s: float
    bytes_from_hub: int
    bytes_from_peers: int
    sources: list[m.SourceRate]  # per peer we fetched from: bytes, first to last byte


HUB = "hub"  # the source name of the hub in a Download


class Download:
    """Fetch every chunk of one manifest by the hub's relay plan; `run` returns when all are in."""

    def __init__(self, store: ChunkStore, held: Held, *, http: aiohttp.ClientSession,
                 hub_base_url: str, me: str, report: Callable[[m.RelayReport], Awaitable[None]],
                 window: int = 2, stall_s: float = 10.0, replan_wait_s: float = 3.0,
                 credentials: Credentials | None = None):
        self.store, self.held, self.http = store, held, http
        self.credentials = credentials  # None: a hub that issues no tickets
        self.hub_base_url, self.me, self.report = hub_base_url, me, report
        self.window, self.stall_s, self.replan_wait_s = window, stall_s, replan_wait_s
        self.revision = 0
        self._owners: list[str] = [HUB] * len(held.manifest.chunks)  # until a plan arrives
        self._urls: dict[str, str] = {HUB: hub_base_url}
        self._failed: dict[str, float] = {}  # source -> when it failed
        self._hub_retry_at = 0.0
        self._changed = asyncio.Event()
        self._bytes: Counter[str] = Counter()
        self._span: dict[str, tuple[float, float]] = {}  # source -> (first byte, last byte)

    def set_plan(self, plan: m.RelayPlan) -> None:
        """Take a newer revision of the plan; chunks not yet requested follow it."""
        if plan.revision <= self.revision:
            return
        try:
            owners = owners_of(plan)
        except ValueError as exc:
            log.warning("ignoring a relay plan for v%d: %s", plan.version, exc)
            return
        if len(owners) != len(self._owners):
            log.warning("ignoring a relay plan for v%d: wrong chunk count", plan.version)
            return
        self.revision = plan.revision
        ids = [HUB if o == m.HUB_OWNER or plan.sources[o].peer_id == self.me
               else plan.sources[o].peer_id for o in owners]
        for source in plan.sources:
            if (base := server_base(source.url)) is not None:
                self._urls[source.peer_id] = base
        # A source without a usable URL cannot be asked: its chunks come from the hub.
        ids = [HUB if i not in self._urls else i for i in ids]
        self._owners = ids
        self._changed.set()

    async def run(self) -> TransferStats:
        manifest = self.held.manifest
        start = time.monotonic()
        if not self.revision:  # the plan follows the announcement; without one, all from the hub
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.replan_wait_s)
        missing = set(self.held.assembler.missing)
        in_flight: dict[asyncio.Task, tuple[int, str]] = {}
        load: Counter[str] = Counter()
        bar = tqdm(total=sum(c.wire_bytes for c in manifest.chunks), unit="B", unit_scale=True,
                   desc=f"v{manifest.version}", leave=False, disable=not sys.stderr.isatty())
        try:
            while missing:
                now = time.monotonic()
                for i in sorted(missing - {i for i, _ in in_flight.values()}):
                    source = self._route(i, now)
                    if source is not None and load[source] < self.window:
                        load[source] += 1
                        in_flight[asyncio.create_task(self._fetch(i, source))] = (i, source)
                self._changed.clear()
                waiter = asyncio.create_task(self._changed.wait())
                try:
                    done, _ = await asyncio.wait([*in_flight, waiter], timeout=HUB_RETRY_S,
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                for task in done - {waiter}:
                    i, source = in_flight.pop(task)
                    load[source] -= 1
                    fault = task.result()
                    if fault is None:
                        missing.discard(i)
                        bar.update(manifest.chunks[i].wire_bytes)
                    elif source == HUB:
                        log.warning("the hub did not serve chunk %d of v%d (%s); retrying", i,
                                    manifest.version, fault)
                        self._hub_retry_at = time.monotonic() + HUB_RETRY_S
                    elif source not in self._failed:
                        self._failed[source] = time.monotonic()
                        log.warning("source %s %s on v%d; reporting it", source, fault,
                                    manifest.version)
                        await self.report(m.RelayReport(manifest.version, source, fault, i,
                                                        manifest.base_version))
        finally:
            for task in in_flight:
                task.cancel()
            bar.close()
        return TransferStats(
            time.monotonic() - start, self._bytes[HUB],
            sum(n for s, n in self._bytes.items() if s != HUB),
            [m.SourceRate(s, n, round(self._span[s][1] - self._span[s][0], 4))
             for s, n in self._bytes.items() if s != HUB])

    def _route(self, index: int, now: float) -> str | None:
        """Whom to ask for chunk `index` now; None to wait for the hub's next plan."""
        owner = self._owners[index]
        failed_at = self._failed.get(owner)
        if failed_at is not None:
            owner = HUB if now - failed_at > self.replan_wait_s else None
        if owner == HUB and now < self._hub_retry_at:
            return None
        return owner

    async def _fetch(self, index: int, source: str) -> str | None:
        """Fetch chunk `index` from `source` and verify it: None once it is in, else the fault
        ("corrupt", "stall" or "unreachable")."""
        m_ = self.held.manifest
        entry = m_.chunks[index]
        url = self._urls[source] + chunk_path(m_.version, m_.base_version, index)
        headers = self.credentials.header(source) if self.credentials is not None else {}
        poll_s = self.stall_s / 2
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.stall_s, sock_read=self.stall_s)
        asked = time.monotonic()
        while True:
            try:
                async with asyncio.timeout(poll_s + self.stall_s + entry.wire_bytes / MIN_RATE_BYTES_S):
                    async with self.http.get(url, params={"wait": str(poll_s)}, timeout=timeout,
                                             headers=headers) as resp:
                        if resp.status == 503:  # the source is alive but does not have it yet
                            if time.monotonic() - asked > self.stall_s:
                                return "stall"
                            continue
                        if resp.status != 200:
                            return "unreachable"
                        if resp.content_length != entry.wire_bytes:
                            return "corrupt"
                        first_byte = time.monotonic()
                        data = await resp.content.readexactly(entry.wire_bytes)
            except TimeoutError:
                return "stall"
            except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError):
                return "unreachable"
            try:
                await self.store.add(self.held, index, data)
            except SnapshotError as exc:
                log.warning("chunk %d of v%d from %s: %s", index, m_.version, source, exc)
                return "corrupt"
            self._bytes[source] += len(data)
            began, _ = self._span.get(source, (first_byte, 0.0))
            self._span[source] = (min(began, first_byte), time.monotonic())
            return None
