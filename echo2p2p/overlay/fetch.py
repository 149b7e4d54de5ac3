"""One chunk request to a chunk server, and what its answer means: the chunk's bytes or a fault.

Both who fetch chunks over HTTP use it: a peer's download (`download.Download`, every chunk of a
version from the hub or a relay) and the hub checking an accused relay (`hub.overlay.relay_checks`). An answer
maps to the faults a `RelayReport` names: a length other than the manifest's is "corrupt", no
answer by the deadline "stall", an error or a refusal "unreachable". A 503 (the server is alive
but does not hold the chunk yet) is PENDING, which each caller weighs its own way: a download
asks again until its stall deadline, the hub's check calls it a stall. Nothing here checks a
digest (the download verifies into its store, the hub against the signed manifest) or retries.

The body is read with the socket's receive low-water mark (SO_RCVLOWAT) raised to the bytes
still to come, at most RCVLOWAT_BYTES: over a paced uplink packets arrive one or two at a time,
and without it the event loop woke for each (measured with `bench/relay_cpu.py`). The mark is
back at 1 before the connection can return to the pool (the next response's headers must wake
it). A server that sends less than it announced stalls the read as before, until the deadline.
16 KiB, not more: a mark near the receive window (64 KiB or so on a fresh connection) would stop
the sender until the window closed. Measured (`bench/relay_cpu.py --mbytes 64 --strategies
pipelined --shaping tbf`, 8 peers at 20 Mbit/s): a peer's CPU per MiB received 0.042 s
without the mark, 0.025-0.026 with 16 KiB, 0.022-0.024 with 64 KiB; wall times alike.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from echo2p2p.runtime.tcp import set_rcvlowat

MIN_RATE_BYTES_S = 256 << 10  # a transfer slower than this counts as stalled
PENDING = "pending"  # the server answered 503: it does not hold the chunk yet
RCVLOWAT_BYTES = 16 << 10  # the loop wakes for a chunk's body once per this many bytes


@dataclass(frozen=True)
class ChunkAnswer:
    """The outcome of one chunk request; times are `time.monotonic()` readings."""

    fault: str | None
    """None: `data` is the chunk (its length checked); else PENDING, "corrupt", "stall" or
    "unreachable"."""
    sent: float
    """When the request went out."""
    done: float
    """When the last byte came, or the fault was seen."""
    first_byte: float = 0.0
    """When the body began to arrive (0 without one)."""
    data: bytes = b""


async def fetch_chunk(http: aiohttp.ClientSession, url: str, wire_bytes: int, *, wait_s: float,
                      deadline_s: float, headers: dict[str, str],
                      timeout: aiohttp.ClientTimeout | None = None) -> ChunkAnswer:
    """GET the chunk at `url` (`wire_bytes` long), letting the server wait up to `wait_s` for it,
    all of it within `deadline_s`; `timeout`: aiohttp's per-socket limits, if any."""
    options: dict[str, Any] = {"params": {"wait": str(wait_s)}, "headers": headers}
    if timeout is not None:
        options["timeout"] = timeout
    sent = time.monotonic()
    try:
        async with asyncio.timeout(deadline_s):
            async with http.get(url, **options) as resp:
                if resp.status == 503:
                    return ChunkAnswer(PENDING, sent, time.monotonic())
                if resp.status != 200:
                    return ChunkAnswer("unreachable", sent, time.monotonic())
                if resp.content_length != wire_bytes:
                    return ChunkAnswer("corrupt", sent, time.monotonic())
                first_byte = time.monotonic()
                data = await read_body(resp, wire_bytes)
                return ChunkAnswer(None, sent, time.monotonic(), first_byte, data)
    except TimeoutError:
        return ChunkAnswer("stall", sent, time.monotonic())
    except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError):
        return ChunkAnswer("unreachable", sent, time.monotonic())


async def read_body(resp: aiohttp.ClientResponse, nbytes: int) -> bytes:
    """The next `nbytes` of `resp`'s body, waking once per RCVLOWAT_BYTES received (see the
    module docstring); IncompleteReadError if it ends first."""
    transport = resp.connection.transport if resp.connection is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    parts: list[bytes] = []
    remaining = nbytes
    try:
        while remaining:
            set_rcvlowat(sock, min(remaining, RCVLOWAT_BYTES))
            block = await resp.content.read(remaining)
            if not block:
                raise asyncio.IncompleteReadError(b"".join(parts), nbytes)
            parts.append(block)
            remaining -= len(block)
    finally:
        set_rcvlowat(sock, 1)
    return parts[0] if len(parts) == 1 else b"".join(parts)
