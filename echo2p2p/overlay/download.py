"""Downloads: fetch one manifest's chunks by the hub's relay plan, failing over from bad sources.

`Download` fetches each chunk from its owner in the plan (the hub for the chunks this peer
owns), at most `window` requests in flight per source, every request under a deadline. A
source that serves a corrupt chunk, stalls or cannot be reached is reported to the hub and
avoided; its chunks wait briefly for the hub's new plan, then come from the hub. The hub is the
last resort: a failed request to it (a busy hub queues requests) is retried.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from echo2p2p import messages as m
from echo2p2p.errors import SnapshotError
from echo2p2p.relay import owners_of

from .store import ChunkStore, Held, chunk_path
from .tickets import Credentials, server_base

log = logging.getLogger(__name__)

MIN_RATE_BYTES_S = 256 << 10  # a transfer slower than this counts as stalled
HUB_RETRY_S = 1.0  # after a failed request to the hub, ask it again this much later


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
        self._owners: list[str] = [HUB] * len(held.manifest.chunks)  # until `set_plan`
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
