"""Chunk serving over HTTP: GET /chunk/{version}/{base}/{index}?wait=S, by peers and the hub.

A chunk not here yet is waited for up to `wait` seconds (a long poll), so it is forwarded the
moment it is verified, while the next one is still arriving; then "503 not yet". A version no
longer kept answers 404. Uploads go through an optional token bucket (an in-process uplink
cap) and are counted by an `UploadMeter`; at most `slots` responses send at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from .store import GONE

log = logging.getLogger(__name__)

MAX_WAIT_S = 30.0  # longest long poll a server grants
PIECE_BYTES = 64 << 10  # uploads are written (and rate-limited) in pieces of this size
WRITE_DEADLINE_S = 10.0  # a chunk receiver that takes no piece for this long is cut off
UPLOAD_SLOTS = 2  # responses a chunk server sends at once (see chunk_handler)
PROBE_PATH = "/probe"  # GET /probe?bytes=N: N zero bytes through the uplink, for the hub to time
MAX_PROBE_BYTES = 1 << 20


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


class RankedSlots:
    """At most `n` holders at once, like a semaphore, but the waiter of lowest rank enters
    first (FIFO among equal ranks): the gossip links' uplink, in `Links.serve_rank` order."""

    def __init__(self, n: int):
        self.free = n
        self._waiting: list[tuple[tuple, int, asyncio.Future]] = []  # heap
        self._order = 0  # arrival order: FIFO among equal ranks

    @contextlib.asynccontextmanager
    async def hold(self, rank: tuple) -> AsyncIterator[None]:
        if self.free and not self._waiting:
            self.free -= 1
        else:
            fut = asyncio.get_running_loop().create_future()
            self._order += 1
            heapq.heappush(self._waiting, (rank, self._order, fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release()  # handed a slot as we were cancelled: pass it on
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():  # a cancelled waiter's future is done: skip it
                fut.set_result(None)
                return
        self.free += 1


Lookup = Callable[[int, int | None, int, float], Awaitable[bytes | None]]


def chunk_handler(lookup: Lookup, meter: UploadMeter, limiter: TokenBucket | None = None,
                  on_served: Callable[[int, int], None] | None = None, *, slots: int = UPLOAD_SLOTS,
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



def probe_handler(limiter: TokenBucket | None = None,
                  authorize: Callable[[web.Request], bool] | None = None):
    """The aiohttp handler for GET /probe?bytes=N: N (at most MAX_PROBE_BYTES) zero bytes,
    paced like chunks, so that the hub can time this peer's uplink itself before dealing it
    any chunk."""
    async def handle(request: web.Request) -> web.StreamResponse:
        if authorize is not None and not authorize(request):
            return web.Response(status=403, text="a ticket from this run's hub is required")
        try:
            nbytes = min(max(int(request.query.get("bytes", "0")), 0), MAX_PROBE_BYTES)
        except ValueError:
            return web.Response(status=400, text="expected /probe?bytes=N")
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = nbytes
        piece = bytes(min(PIECE_BYTES, nbytes))
        try:
            await response.prepare(request)
            for pos in range(0, nbytes, PIECE_BYTES):
                size = min(PIECE_BYTES, nbytes - pos)
                if limiter is not None:
                    await limiter.take(size)
                async with asyncio.timeout(WRITE_DEADLINE_S):
                    await response.write(piece[:size])
            await response.write_eof()
        except (ConnectionError, TimeoutError):
            pass  # the hub stopped timing: nothing to tell it
        return response

    return handle
