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

`RelayCheck` does the HTTP; the verdicts (who relays, who lied) are judged in the hub's core
(`hub.core.accusations`), which asks for each probe and check with an action that the shell
(`hub.serving.overlay_shell`) carries out here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from echo2p2p import messages as m
from echo2p2p.snapshot import chunk_digest
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S, PENDING, ChunkAnswer, fetch_chunk
from echo2p2p.overlay.serving import PIECE_BYTES, PROBE_PATH
from echo2p2p.propagation import MAX_RATE_BYTES_S
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import Credentials

from ..core.accusations import RECEIVER_STALL_S

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # an advertised chunk server must answer the hub's probe within this
PROBE_ATTEMPTS = 3  # probes before a server that does not answer stays a leaf
PROBE_RETRY_S = 2.0  # between probe attempts
PROBE_BYTES = 512 << 10  # timed from a new chunk server: its uplink before any version spreads
MIN_PROBED_BYTES = 64 << 10  # less than this by the deadline says nothing about an uplink
CHECKS_AT_ONCE = 8  # hub-side probes and fetches in flight; more wait their turn


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
        of `hub.core.accusations.VERDICTS` but "slow", PENDING if it never held the chunk, and
        the seconds from the last request to its last byte or fault (the wait for one of our own
        slots not counted)."""
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
