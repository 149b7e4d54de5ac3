"""Downloads: fetch one manifest's chunks by the hub's relay plan, failing over from bad sources.

`Download` fetches each chunk from its owner in the plan (the hub for the chunks this peer
owns), at most `window` requests in flight per source, every request under a deadline. A
source that serves a corrupt chunk, stalls, cannot be reached or serves a chunk far slower than
the plan's rate for it (`echo2p2p.pace`: the chunk is kept) is reported to the hub and avoided;
its chunks wait briefly for the hub's new plan, then come from the hub. The hub is the last
resort: a failed request to it (a busy hub queues requests) is retried, less often as it keeps
failing, and logged at the first failed round and once more when the hub looks gone
(`log_hub_fault`). Those decisions are the core's `echo2p2p.failover.Failover`; this shell runs
the requests (`fetch.fetch_chunk`), verifies each chunk into the store (`_keep`, which
`GossipDownload` shares) and reads the clock.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import aiohttp

from echo2p2p import messages as m
from echo2p2p.errors import SnapshotError
from echo2p2p.failover import (HUB, HUB_GONE_ROUNDS, HUB_RETRY_MAX_S, HUB_RETRY_S, Failover,
                               HubBackoff)
from echo2p2p.pace import DEFAULT_WINDOW, per_request_bps, too_slow
from echo2p2p.relay import MAX_WINDOW
from echo2p2p.runtime.progress import progress_bar

from .fetch import MIN_RATE_BYTES_S, PENDING, fetch_chunk
from .store import ChunkStore, Held, chunk_path
from .tickets import Credentials, server_base

log = logging.getLogger(__name__)


def log_hub_fault(hub: HubBackoff, index: int, version: int, fault: str) -> None:
    """Say that the hub failed a chunk request: at the first failed round, and once more when
    it has failed HUB_GONE_ROUNDS in a row (a hub that stopped); the rest at DEBUG."""
    if hub.fresh and hub.rounds == 1:
        log.warning("the hub did not serve chunk %d of v%d (%s); retrying", index, version, fault)
    elif hub.fresh and hub.rounds == HUB_GONE_ROUNDS:
        log.warning("the hub has failed %d tries in a row for chunks of v%d (%s): it may have "
                    "stopped; asking again at longer intervals (up to %.0f s), quietly",
                    hub.rounds, version, fault, HUB_RETRY_MAX_S)
    else:
        log.debug("the hub did not serve chunk %d of v%d (%s)", index, version, fault)


@dataclass(frozen=True)
class TransferStats:
    download_s: float
    bytes_from_hub: int
    bytes_from_peers: int
    sources: list[m.SourceRate]  # per peer we fetched from: bytes, first to last byte


class Download:
    """Fetch every chunk of one manifest by the hub's relay plan; `run` returns when all are in."""

    def __init__(self, store: ChunkStore, held: Held, *, http: aiohttp.ClientSession,
                 hub_base_url: str, me: str, report: Callable[[m.RelayReport], Awaitable[None]],
                 window: int = DEFAULT_WINDOW, stall_s: float = 10.0, replan_wait_s: float = 3.0,
                 credentials: Credentials | None = None, first: bool = False):
        """`first`: the first version this peer takes, which shows a progress bar on a terminal
        whatever its size (later ones only when large: `echo2p2p.runtime.progress`)."""
        self.store, self.held, self.http = store, held, http
        self.credentials = credentials  # None: a hub that issues no tickets
        self.first = first
        self.hub_base_url, self.me, self.report = hub_base_url, me, report
        self.window, self.stall_s, self.replan_wait_s = window, stall_s, replan_wait_s
        self.failover = Failover(len(held.manifest.chunks), me, replan_wait_s=replan_wait_s)
        self._urls: dict[str, str] = {HUB: hub_base_url}
        self._rates: dict[str, float] = {}  # source -> bits/s the plan says to expect of it
        self._changed = asyncio.Event()
        self._bytes: Counter[str] = Counter()
        self._span: dict[str, tuple[float, float]] = {}  # source -> (first byte, last byte)

    @property
    def revision(self) -> int:
        """The relay plan revision followed (0 until `set_plan`)."""
        return self.failover.revision

    def set_plan(self, plan: m.RelayPlan) -> None:
        """Take a newer revision of the plan; chunks not yet requested follow it."""
        if plan.revision <= self.failover.revision:
            return
        urls = {s.peer_id: base for s in plan.sources if (base := server_base(s.url)) is not None}
        # A source without a usable URL cannot be asked: its chunks come from the hub.
        ignored = self.failover.plan(plan, set(self._urls) | set(urls))
        if ignored is not None:
            log.warning("ignoring a relay plan for v%d: %s", plan.version, ignored)
            return
        self._urls.update(urls)
        self._rates.update({s.peer_id: s.rate_bps for s in plan.sources
                            if 0 < s.rate_bps < math.inf})
        if plan.window > 0:  # the hub's, within bounds (a frame may carry any int)
            self.window = min(plan.window, MAX_WINDOW)
        self._changed.set()

    async def run(self) -> TransferStats:
        manifest = self.held.manifest
        start = time.monotonic()
        self.failover.want(self.held.assembler.missing)
        in_flight: dict[asyncio.Task, tuple[int, str]] = {}
        # A delta as large as a big full version is as long a wait: the bar goes by size.
        bar = progress_bar(sum(c.wire_bytes for c in manifest.chunks), f"v{manifest.version}",
                           show=self.first or None)
        try:
            while not self.failover.complete:
                self._withdraw(in_flight)
                for i, source in self.failover.requests(time.monotonic(), self.window):
                    in_flight[asyncio.create_task(self._fetch(i, source))] = (i, source)
                for task in await self._finished(in_flight, HUB_RETRY_S):
                    i, source = in_flight.pop(task)
                    fault = task.result()
                    report = self.failover.finished(i, source, fault, time.monotonic())
                    if fault in (None, "slow"):  # a slow chunk is in, but its source is avoided
                        bar.update(manifest.chunks[i].wire_bytes)
                    if fault is not None and source == HUB:
                        log_hub_fault(self.failover.hub, i, manifest.version, fault)
                    elif report:
                        log.warning("source %s %s on v%d; reporting it", source, fault,
                                    manifest.version)
                        await self.report(m.RelayReport(manifest.version, source, fault, i,
                                                        manifest.base_version))
        finally:
            for task in in_flight:
                task.cancel()
            bar.close()
        return self.statistics(time.monotonic() - start)

    def _withdraw(self, in_flight: dict[asyncio.Task, tuple[int, str]]) -> None:
        """Cancel the requests out to a source the plan no longer routes their chunk through
        (`Failover.moved`): the hub dealt it elsewhere, so waiting out the stall deadline on
        the old source would only hold the chunk back."""
        moved = set(self.failover.moved())
        for task, entry in list(in_flight.items()):
            if entry in moved and not task.done():
                task.cancel()
                del in_flight[task]
                self.failover.release(*entry)

    def statistics(self, download_s: float) -> TransferStats:
        """What this download fetched, from whom, over `download_s` seconds."""
        return TransferStats(
            download_s, self._bytes[HUB], sum(n for s, n in self._bytes.items() if s != HUB),
            [m.SourceRate(s, n, round(self._span[s][1] - self._span[s][0], 4))
             for s, n in self._bytes.items() if s != HUB])

    async def _finished(self, in_flight: Iterable[asyncio.Task], timeout: float) -> set[asyncio.Task]:
        """The requests of `in_flight` that are done once one is, the plan changed
        (`_changed`) or `timeout` passed (then maybe none)."""
        self._changed.clear()
        waiter = asyncio.create_task(self._changed.wait())
        try:
            done, _ = await asyncio.wait([*in_flight, waiter], timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return done - {waiter}

    async def _fetch(self, index: int, source: str) -> str | None:
        """Fetch chunk `index` from `source` and verify it: None once it is in, "slow" once it is
        in but came far slower than the plan's rate for `source` allows, else the fault
        ("corrupt", "stall" or "unreachable")."""
        m_ = self.held.manifest
        entry = m_.chunks[index]
        url = self._urls[source] + chunk_path(m_.version, m_.base_version, index)
        headers = self.credentials.header(source) if self.credentials is not None else {}
        poll_s = self.stall_s / 2
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.stall_s, sock_read=self.stall_s)
        asked = time.monotonic()
        while True:
            answer = await fetch_chunk(
                self.http, url, entry.wire_bytes, wait_s=poll_s, headers=headers, timeout=timeout,
                deadline_s=poll_s + self.stall_s + entry.wire_bytes / MIN_RATE_BYTES_S)
            if answer.fault != PENDING:  # else the source is alive but does not have it yet
                break
            if time.monotonic() - asked > self.stall_s:
                return "stall"
        if answer.fault is not None:
            return answer.fault
        if (fault := await self._keep(index, source, answer.data, answer.first_byte)) is not None:
            return fault
        # The rate is at least the deadline's own floor, so that rule is never the looser.
        rate_bps = max(per_request_bps(self._rates.get(source, 0.0), self.window),
                       8 * MIN_RATE_BYTES_S)
        elapsed_s = answer.done - answer.sent  # its long poll is allowed for
        if source != HUB and too_slow(len(answer.data), elapsed_s, rate_bps, poll_s):
            return "slow"
        return None

    async def _keep(self, index: int, source: str, data: bytes, began: float) -> str | None:
        """Verify chunk `index` from `source` into the store and count its bytes, the transfer
        having begun at `began` (monotonic): None once it is in, "corrupt" if it fails."""
        try:
            await self.store.add(self.held, index, data)
        except SnapshotError as exc:
            log.warning("chunk %d of v%d from %s: %s", index, self.held.manifest.version, source,
                        exc)
            return "corrupt"
        self._bytes[source] += len(data)
        first, _ = self._span.get(source, (began, 0.0))
        self._span[source] = (min(first, began), time.monotonic())
        return None
