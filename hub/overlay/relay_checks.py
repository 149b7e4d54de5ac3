"""The hub's own evidence about the peers' chunk servers: no report is believed without it.

A peer advertises a chunk server URL in its hello; the hub deals it chunks only once it has
asked that server itself (`probe`: any authorised answer within the deadline), and it times
that server's uplink itself (`uplink_bps`), which deals the first version's shares. A peer that
accuses a relay of a corrupt chunk, a stall or no answer names the chunk, and the hub fetches
that chunk from the accused with its own ticket (`fetch`): a chunk that arrives whole and
matches the signed manifest's digest clears the accused (and a "corrupt" accuser has lied); a
wrong digest convicts it; no answer in time keeps it out of relaying. Accused of "slow", it
is asked for the chunk once more, now that it holds it, as a receiver asks, and timed: far
slower than the rate its share was dealt for (`echo2p2p.pace`), it relays nothing more on
this connection and its upload estimate falls to what the hub measured. Requests go to the
scheme, host and port of the advertised URL only, never to a path someone chose.

`RelayCheck` does the HTTP; `RelayJudge` keeps the verdicts (who relays, who lied) and runs
the checks as tasks that end with the hub; hub.server routes around a failed relay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from echo2p2p import messages as m
from echo2p2p.snapshot import chunk_digest
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S, PENDING, fetch_chunk
from echo2p2p.overlay.serving import PIECE_BYTES, PROBE_PATH
from echo2p2p.propagation import MAX_RATE_BYTES_S
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import Credentials
from echo2p2p.pace import DEFAULT_WINDOW, GRACE_S, measured_bps, per_request_bps, slow_after_s
from echo2p2p.relay import Broadcast

from ..serving.peers import PeerConn
from .versions import Snapshot

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # an advertised chunk server must answer the hub's probe within this
PROBE_ATTEMPTS = 3  # probes before a server that does not answer stays a leaf
PROBE_RETRY_S = 2.0  # between probe attempts
PROBE_BYTES = 512 << 10  # timed from a new chunk server: its uplink before any version spreads
MIN_PROBED_BYTES = 64 << 10  # less than this by the deadline says nothing about an uplink
FETCH_WAIT_S = 10.0  # how long the accused may long-poll for the contested chunk
PACE_WAIT_S = 5.0  # the timed fetch of a "slow" check asks as receivers do (relay_stall_s / 2),
# so the accused cannot tell it from theirs by its query; it holds the chunk by then: no wait
CHECKS_AT_ONCE = 8  # hub-side probes and fetches in flight; more wait their turn
MAX_PENDING = 256  # probes and checks waiting at most; accusations past that are not checked

VERDICTS = ("intact", "corrupt", "stall", "unreachable", "slow")


class RelayCheck:
    """Probes and contested-chunk fetches, made with the hub's own credentials."""

    def __init__(self, credentials: Credentials | None):
        self.credentials = credentials
        self._http: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(CHECKS_AT_ONCE)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    def _headers(self, audience: str) -> dict[str, str]:
        return self.credentials.header(audience) if self.credentials is not None else {}

    async def probe(self, base_url: str, audience: str, version: int) -> bool:
        """Whether the chunk server at `base_url` answers us, as `audience`'s server, in time:
        a chunk request for `version` with no wait; 200, 404 and 503 all prove it serves."""
        url = base_url + chunk_path(version, None, 0)
        for attempt in range(PROBE_ATTEMPTS):
            if attempt:
                await asyncio.sleep(PROBE_RETRY_S)  # a retry timer, not a synchronisation
            try:
                async with self._slots, asyncio.timeout(PROBE_TIMEOUT_S):
                    async with self._session().get(url, params={"wait": "0"},
                                                   headers=self._headers(audience)) as resp:
                        if resp.status in (200, 404, 503):
                            return True
                        log.debug("probe of %s answered %d", base_url, resp.status)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                log.debug("probe of %s failed: %s", base_url, type(exc).__name__)
        return False

    async def uplink_bps(self, base_url: str, audience: str) -> float | None:
        """`audience`'s uplink as the hub times it itself: PROBE_BYTES from its server's
        /probe, bits/s over what arrived by PROBE_TIMEOUT_S (a lower bound: TCP's slow start
        counts against it); None if too little came."""
        got, start = 0, time.monotonic()
        try:
            async with self._slots, asyncio.timeout(PROBE_TIMEOUT_S):
                start = time.monotonic()
                async with self._session().get(base_url + PROBE_PATH,
                                               params={"bytes": str(PROBE_BYTES)},
                                               headers=self._headers(audience)) as resp:
                    if resp.status != 200:
                        return None
                    async for data in resp.content.iter_chunked(PIECE_BYTES):
                        got += len(data)
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass  # what came by the deadline is the measure
        elapsed = time.monotonic() - start
        if got < MIN_PROBED_BYTES or elapsed <= 0:
            return None
        return min(8 * got / elapsed, MAX_RATE_BYTES_S * 8)

    async def fetch(self, base_url: str, audience: str, manifest: m.Manifest, index: int,
                    wait_s: float = FETCH_WAIT_S, deadline_s: float | None = None
                    ) -> tuple[str, float]:
        """Fetch chunk `index` of `manifest` from `audience`'s server, letting it wait `wait_s`
        for the chunk, within `deadline_s` (None: a receiver's, at least), and judge it: one of
        VERDICTS but "slow", and the seconds from the request to the last byte or the fault
        (the wait for one of our own slots not counted)."""
        entry = manifest.chunks[index]
        url = base_url + chunk_path(manifest.version, manifest.base_version, index)
        if deadline_s is None:
            deadline_s = wait_s + PROBE_TIMEOUT_S + entry.wire_bytes / MIN_RATE_BYTES_S
        async with self._slots:
            answer = await fetch_chunk(self._session(), url, entry.wire_bytes, wait_s=wait_s,
                                       deadline_s=deadline_s, headers=self._headers(audience))
        elapsed = answer.done - answer.sent
        if answer.fault == PENDING:  # alive, but it never got the chunk it should serve
            return "stall", elapsed
        if answer.fault is not None:
            return answer.fault, elapsed
        return ("intact" if chunk_digest(answer.data) == entry.digest else "corrupt"), elapsed

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None



class RelayJudge:
    """Who may relay, on the hub's own evidence. `distrust(conn, event)` counts a trust event,
    `failed(conn)` routes every plan around a relay that failed a check, `on_event(record)`
    writes the run log."""

    def __init__(self, check: RelayCheck, *, distrust: Callable[[PeerConn, str], None],
                 failed: Callable[[PeerConn], None], on_event: Callable[[dict[str, Any]], None]):
        self.check = check
        self._distrust, self._failed, self._on_event = distrust, failed, on_event
        self.bad: set[str] = set()  # identities whose chunk server failed a check: never again
        self._accusations: set[tuple[str, str, tuple]] = set()  # (accuser, accused, manifest)
        self._convictions: set[tuple[str, tuple, int]] = set()  # (identity, manifest, chunk)
        self._tasks: set[asyncio.Task] = set()

    def probe(self, conn: PeerConn, version: int) -> None:
        """Ask `conn`'s advertised chunk server before it is dealt any chunk."""
        if conn.server_url is not None and conn.identity not in self.bad:
            self._spawn(self._probe(conn, version))

    def accused(self, accuser: PeerConn, accused: PeerConn, reason: str, manifest: m.Manifest,
                index: int, rate_bps: float = 0.0) -> None:
        """`accuser` says `accused` served chunk `index` of `manifest` badly (`reason`);
        `rate_bps`: what each request the accuser sent it may take (judges "slow")."""
        key = (manifest.version, manifest.base_version)
        if accused.relay != "ok" or (accuser.identity, accused.peer_id, key) in self._accusations:
            return  # it relays nothing already, or this accuser was heard on this manifest
        if len(self._tasks) >= MAX_PENDING:
            log.warning("%d relay checks pending: not checking %s's report", MAX_PENDING,
                        accuser.peer_id)
            return
        self._accusations.add((accuser.identity, accused.peer_id, key))
        self._spawn(self._judge(accuser, accused, reason, manifest, index, rate_bps))

    def heard(self, accuser: PeerConn, accused: PeerConn, report: m.RelayReport,
              broadcast: Broadcast | None, snap: Snapshot | None) -> None:
        """`accuser` reports `accused` (`report`); `broadcast` and `snap` are the reported
        manifest's, if the hub still keeps them. Only a chunk the accuser was told to fetch from
        the accused is worth a look."""
        if (snap is not None and broadcast is not None and accuser.peer_id in broadcast.members
                and broadcast.source(accuser.peer_id, report.index) == accused.peer_id):
            told = broadcast.plan(accuser.peer_id)  # what its downloader judged by
            rate_bps = next((s.rate_bps for s in told.sources if s.peer_id == accused.peer_id), 0.0)
            rate_bps = per_request_bps(rate_bps, told.window or DEFAULT_WINDOW)
            self.accused(accuser, accused, report.reason, snap.manifest, report.index, rate_bps)

    async def _probe(self, conn: PeerConn, version: int) -> None:
        ok = await self.check.probe(conn.server_url, conn.peer_id, version)
        rate = ok and await self.check.uplink_bps(conn.server_url, conn.peer_id)
        if rate and not conn.upload_bps:  # the first version's shares; measured ones replace it
            conn.upload_bps = rate
        if conn.relay == "unprobed":  # not judged meanwhile
            conn.relay = "ok" if ok else "failed"
            log.info("chunk server of %s at %s: %s", conn.peer_id, conn.server_url,
                     "reachable" if ok else "no answer, so it only pulls")

    async def _judge(self, accuser: PeerConn, accused: PeerConn, reason: str,
                     manifest: m.Manifest, index: int, rate_bps: float) -> None:
        verdict, _ = await self.check.fetch(accused.server_url, accused.peer_id, manifest, index)
        if verdict == "intact" and reason == "slow":  # it holds the chunk now: time it
            nbytes = manifest.chunks[index].wire_bytes
            floor_bps = 8 * MIN_RATE_BYTES_S  # as the receiver's rule: never looser than a stall
            limit_s = slow_after_s(nbytes, max(rate_bps, floor_bps))
            timed, elapsed_s = await self.check.fetch(  # cut off once it is slow in any case
                accused.server_url, accused.peer_id, manifest, index, wait_s=PACE_WAIT_S,
                deadline_s=limit_s + GRACE_S)
            if timed in ("intact", "stall") and elapsed_s > limit_s:  # late, or cut off
                verdict = "slow"
                self._slow(accused, measured_bps(nbytes, elapsed_s))
            elif timed != "unreachable":  # gone meanwhile (a version it dropped): no evidence
                verdict = timed
        log.warning("checked %s's report of %s (%s, chunk %d of v%d): %s", accuser.peer_id,
                    accused.peer_id, reason, index, manifest.version, verdict)
        self._on_event({"event": "relay_check", "accuser": accuser.peer_id,
                        "accused": accused.peer_id, "reason": reason,
                        "version": manifest.version, "chunk": index, "verdict": verdict})
        if verdict in ("intact", "slow"):
            if reason == "corrupt":  # the chunk is whole: the accusation was a lie
                self._distrust(accuser, "false_report")
            return
        key = (accused.identity, (manifest.version, manifest.base_version), index)
        if verdict == "corrupt" and key not in self._convictions:
            self._convictions.add(key)
            self._distrust(accused, "bad_chunk")
        if accused.relay != "failed":
            accused.relay = "failed"
            self.bad.add(accused.identity)
            self._failed(accused)

    def _slow(self, accused: PeerConn, measured: float | None) -> None:
        """The hub itself saw `accused` deliver far below its dealt rate: it relays nothing more
        on this connection (a new one is probed afresh: slow is not malice), and its estimate
        is what the hub measured."""
        if measured is not None:
            accused.upload_bps = min(accused.upload_bps or measured, measured)
        if accused.relay == "ok":
            accused.relay = "slow"
            self._failed(accused)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("relay check failed", exc_info=task.exception())

    async def close(self) -> None:
        """Stop every check under way, and the HTTP client."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.check.close()
