"""The hub's own evidence about the peers' chunk servers: no report is believed without it.

A peer advertises a chunk server URL in its hello; the hub deals it chunks only once it has
asked that server itself (`probe`: any authorised answer within the deadline), and it times
that server's uplink itself (`uplink_bps`), which deals the first version's shares. Both are
the hub's openly (its own ticket, peer id `hub`; /probe opens to no other), once, at the join.
A peer that accuses a relay of a corrupt chunk, a stall or no answer names the chunk, and the
hub fetches that chunk from the accused (`fetch`): a chunk that arrives whole and matches the
signed manifest's digest clears the accused (and a "corrupt" accuser has lied); a wrong digest
convicts it; no answer in time keeps it out of relaying. Accused of "slow", it is asked for a
chunk of its share in the newest version it relays, timed, and judged by the receivers' own
rule (`echo2p2p.pace`): far slower than the rate its share was dealt for, it relays nothing
more on this connection and its upload estimate falls to what the hub measured.

A check must look like any receiver, or a relay serves checks at once and receivers slowly:
each fetch goes out as a receiver that joined now (`receiver_fetch`): an identity of its own
from the hub's peer-id sequence with a key pair of its own and a ticket of this run
(`mint`), on a connection of its own, with a receiver's query and headers, polling as
`echo2p2p.overlay.download` does. What a check cannot hide: it comes from the hub's address,
its id was never a source in any plan (as a leaf's), and it asks one chunk of a share.
Requests go to the scheme, host and port of the advertised URL only, never to a path someone
chose.

`RelayCheck` does the HTTP; `RelayJudge` keeps the verdicts (who relays, who lied) and runs
the checks as tasks that end with the hub; hub.server routes around a failed relay.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from echo2p2p import messages as m
from echo2p2p.snapshot import chunk_digest
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S, PENDING, ChunkAnswer, fetch_chunk
from echo2p2p.overlay.serving import PIECE_BYTES, PROBE_PATH
from echo2p2p.propagation import MAX_RATE_BYTES_S
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import Credentials
from echo2p2p.pace import DEFAULT_WINDOW, measured_bps, per_request_bps, too_slow
from echo2p2p.relay import Broadcast

from ..core.peer import Peer as PeerConn
from .versions import Snapshot

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # an advertised chunk server must answer the hub's probe within this
PROBE_ATTEMPTS = 3  # probes before a server that does not answer stays a leaf
PROBE_RETRY_S = 2.0  # between probe attempts
PROBE_BYTES = 512 << 10  # timed from a new chunk server: its uplink before any version spreads
MIN_PROBED_BYTES = 64 << 10  # less than this by the deadline says nothing about an uplink
RECEIVER_STALL_S = 10.0  # a check asks as a receiver of the peers' default relay_stall_s does:
# wait = half of it, asked again after a 503 until it has passed (then a "stall")
CHECKS_AT_ONCE = 8  # hub-side probes and fetches in flight; more wait their turn
MAX_PENDING = 256  # probes and checks waiting at most; accusations past that are not checked

# "pending": a pace check's chunk never came in (503 to the end): nothing is judged by it.
VERDICTS = ("intact", "corrupt", "stall", "unreachable", "slow", "pending")


@dataclass(frozen=True)
class Share:
    """The chunks a relay serves in one manifest, and the rate, bits/s, that each request a
    receiver sends it may expect (`echo2p2p.pace.per_request_bps`)."""

    manifest: m.Manifest
    chunks: list[int]
    rate_bps: float


def newest_share(peer_id: str, broadcasts: Mapping[tuple[int, int | None], Broadcast],
                 snapshot: Callable[[int, int | None], Snapshot | None]) -> Share | None:
    """What `peer_id` relays in the newest manifest (full before delta) in which it owns any
    chunk, as the plan a receiver joining now gets tells it (the owners' plan); None if none."""
    for key in sorted(broadcasts, key=lambda k: (k[0], k[1] is None), reverse=True):
        broadcast, snap = broadcasts[key], snapshot(*key)
        owned = [i for i in range(broadcast.n_chunks) if broadcast.owner(i) == peer_id]
        if owned and snap is not None:
            plan = broadcast.plan()
            rate_bps = next((s.rate_bps for s in plan.sources if s.peer_id == peer_id), 0.0)
            return Share(snap.manifest, owned,
                         per_request_bps(rate_bps, plan.window or DEFAULT_WINDOW))
    return None


async def receiver_fetch(url: str, wire_bytes: int, headers: dict[str, str],
                         stall_s: float) -> ChunkAnswer:
    """GET the chunk at `url` (`wire_bytes` long) as a receiver of `relay_stall_s` = `stall_s`
    that joined now asks for it (`echo2p2p.overlay.download.Download._fetch`): on a connection
    of its own, `wait` = `stall_s` / 2, the same deadline, and again after each 503 until
    `stall_s` has passed; the last answer."""
    poll_s = stall_s / 2
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=stall_s, sock_read=stall_s)
    async with aiohttp.ClientSession() as http:
        asked = time.monotonic()
        while True:
            answer = await fetch_chunk(
                http, url, wire_bytes, wait_s=poll_s, headers=headers, timeout=timeout,
                deadline_s=poll_s + stall_s + wire_bytes / MIN_RATE_BYTES_S)
            if answer.fault != PENDING or time.monotonic() - asked > stall_s:
                return answer


class RelayCheck:
    """Probes, made under the hub's own `credentials`, and chunk fetches, each made as a
    receiver of its own: `mint()` is a new identity of this run for each (None: the hub issues
    no tickets)."""

    def __init__(self, credentials: Credentials | None,
                 mint: Callable[[], Credentials | None] = lambda: None):
        self.credentials, self.mint = credentials, mint
        self._http: aiohttp.ClientSession | None = None  # the probes' only
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

    async def fetch(self, base_url: str, audience: str, manifest: m.Manifest,
                    index: int) -> tuple[str, float]:
        """Fetch chunk `index` of `manifest` from `audience`'s server as a receiver that joined
        now (`receiver_fetch`, under an identity `mint` makes for it alone) and judge it: one
        of VERDICTS but "slow", PENDING if it never held the chunk, and the seconds from the
        last request to its last byte or fault (the wait for one of our own slots not counted)."""
        entry = manifest.chunks[index]
        url = base_url + chunk_path(manifest.version, manifest.base_version, index)
        async with self._slots:
            credentials = self.mint()
            log.debug("asking %s for chunk %d of v%d as %s", audience, index, manifest.version,
                      credentials.peer_id if credentials is not None else "anyone")
            headers = credentials.header(audience) if credentials is not None else {}
            answer = await receiver_fetch(url, entry.wire_bytes, headers, RECEIVER_STALL_S)
        elapsed = answer.done - answer.sent
        if answer.fault is not None:
            return answer.fault, elapsed
        return ("intact" if chunk_digest(answer.data) == entry.digest else "corrupt"), elapsed

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None



class RelayJudge:
    """Who may relay, on the hub's own evidence. `newest(peer_id)` is the `Share` it relays in
    the newest manifest (`newest_share`), `distrust(conn, event)` counts a trust event,
    `failed(conn)` routes every plan around a relay that failed a check, `on_event(record)`
    writes the run log."""

    def __init__(self, check: RelayCheck, *, newest: Callable[[str], Share | None],
                 distrust: Callable[[PeerConn, str], None], failed: Callable[[PeerConn], None],
                 on_event: Callable[[dict[str, Any]], None]):
        self.check, self._newest = check, newest
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
        asked, chunk = Share(manifest, [index], rate_bps), index
        if reason == "slow":  # any chunk of its share tells its pace: one of the newest, as a
            asked = self._newest(accused.peer_id) or asked  # receiver asks now, at random, so
            chunk = random.choice(asked.chunks)  # that it cannot keep a few quick to pass
        verdict, elapsed_s = await self.check.fetch(accused.server_url, accused.peer_id,
                                                    asked.manifest, chunk)
        if reason == "slow":
            verdict = self._paced(accused, asked, chunk, verdict, elapsed_s)
        elif verdict == PENDING:  # alive, but it never got the chunk it should serve
            verdict = "stall"
        checked = (asked.manifest.version, asked.manifest.base_version)
        log.warning("checked %s's report of %s (%s, chunk %d of v%d) on chunk %d of v%d: %s",
                    accuser.peer_id, accused.peer_id, reason, index, manifest.version, chunk,
                    checked[0], verdict)
        self._on_event({"event": "relay_check", "accuser": accuser.peer_id,
                        "accused": accused.peer_id, "reason": reason,
                        "version": manifest.version, "chunk": index,
                        "checked": [*checked, chunk], "verdict": verdict})
        if verdict == "intact" and reason == "corrupt":  # whole: the accusation was a lie
            self._distrust(accuser, "false_report")
        if verdict == "corrupt" and (accused.identity, checked, chunk) not in self._convictions:
            self._convictions.add((accused.identity, checked, chunk))
            self._distrust(accused, "bad_chunk")
        failed = verdict == "corrupt" or (verdict in ("stall", "unreachable") and reason != "slow")
        if failed and accused.relay != "failed":
            accused.relay = "failed"
            self.bad.add(accused.identity)
            self._failed(accused)

    def _paced(self, accused: PeerConn, share: Share, index: int, verdict: str,
               elapsed_s: float) -> str:
        """What a pace check found, having fetched chunk `index` of `share` (`verdict`, its last
        request `elapsed_s` long): "slow", and so judged, past the receivers' own rule (a
        receiver that waited as long would report it), or cut off by their deadline; else the
        fetch's verdict. "pending" (it does not hold that chunk yet) and "unreachable" (a
        version it dropped, or gone) say nothing of its pace."""
        nbytes = share.manifest.chunks[index].wire_bytes
        rate_bps = max(share.rate_bps, 8 * MIN_RATE_BYTES_S)  # as a receiver's: never looser
        if verdict == "stall" or (verdict == "intact" and too_slow(  # than its stall deadline
                nbytes, elapsed_s, rate_bps, RECEIVER_STALL_S / 2)):
            self._slow(accused, measured_bps(nbytes, elapsed_s))
            return "slow"
        return verdict

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
