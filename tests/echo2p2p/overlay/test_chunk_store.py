"""A peer's chunk store and chunk server: keep versions, long-poll for chunks, serve exact bytes."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from echo2p2p.errors import SnapshotError
from echo2p2p.snapshot import build_snapshot
from echo2p2p.overlay.serving import PIECE_BYTES, UploadMeter, chunk_handler
from echo2p2p.overlay.store import GONE, ChunkStore, chunk_path


def _blob(seed: int, nbytes: int = 5000) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def _version(version: int, data: bytes, *, base: tuple[int, bytes] | None = None,
             chunk_bytes: int = 1024):
    """`data` as one uint8 tensor: (manifest, chunks), a delta when `base` is given."""
    return build_snapshot(version, [("blob", "uint8", [len(data)], data)],
                          chunk_bytes=chunk_bytes, base=base)


def _changed(data: bytes, every: int = 97) -> bytes:
    out = bytearray(data)
    out[::every] = bytes(b ^ 0x5A for b in out[::every])
    return bytes(out)


async def _complete(store: ChunkStore, version: int, data: bytes, **kw):
    """Begin, fill and finish one version in `store`; its chunks."""
    manifest, chunks = _version(version, data, **kw)
    held = store.begin(manifest)
    for i, chunk in enumerate(chunks):
        assert await store.add(held, i, chunk) == (i == len(chunks) - 1)
    assert bytes(store.finish(held)) == data
    return chunks


def test_chunk_path():
    """chunk_path names full snapshots "full" and deltas by their base version."""
    assert chunk_path(3, None, 7) == "/chunk/3/full/7"
    assert chunk_path(3, 2, 0) == "/chunk/3/2/0"


# --- ChunkStore ----------------------------------------------------------------------------


async def test_full_then_delta_assemble_and_serve():
    """A full version, then a delta on it (rebuilt from the kept stream), both served by key."""
    store = ChunkStore(keep=3)
    v1 = _blob(1)
    v2 = _changed(v1)
    m1, c1 = _version(1, v1)
    held = store.begin(m1)
    assert held.key == (1, None) and store.begin(m1) is held
    for k, i in enumerate(reversed(range(len(c1)))):
        assert await store.add(held, i, c1[i]) == (k == len(c1) - 1)
    assert await store.add(held, 0, c1[0]) is True  # a repeat changes nothing
    assert bytes(store.finish(held)) == v1 and store.newest_stream() == 1

    m2, c2 = _version(2, v2, base=(1, v1))
    assert m2.codec == "delta"
    held2 = store.begin(m2)
    assert held2 is not None and held2.key == (2, 1)
    for i, chunk in enumerate(c2):
        await store.add(held2, i, chunk)
    assert bytes(store.finish(held2)) == v2 and store.newest_stream() == 2
    assert [await store.chunk(1, None, i, 0) for i in range(len(c1))] == c1
    assert [await store.chunk(2, 1, i, 0) for i in range(len(c2))] == c2


async def test_a_manifest_redone_under_the_same_number_replaces_the_one_assembling():
    """A resumed hub publishes different weights under a number we were assembling: begin()
    starts the new manifest afresh (its chunks verify, the old one's do not), and the same
    manifest again resumes it."""
    store = ChunkStore()
    old, _ = _version(1, _blob(1))
    new, chunks = _version(1, _blob(2))
    first = store.begin(old)
    held = store.begin(new)
    assert held is not first and held.manifest == new and store.begin(new) is held
    for i, chunk in enumerate(chunks):
        await store.add(held, i, chunk)
    assert bytes(store.finish(held)) == _blob(2)
    assert await store.chunk(1, None, 0, 0) == chunks[0]


async def test_delta_without_its_base_is_not_begun():
    """begin() answers None for a delta whose base stream is not here (nor yet complete)."""
    store = ChunkStore()
    v1 = _blob(2)
    m2, _ = _version(2, _changed(v1), base=(1, v1))
    assert store.begin(m2) is None
    store.begin(_version(1, v1)[0])  # begun, not finished: still no base stream
    assert store.begin(m2) is None and store.newest_stream() is None


async def test_long_poll_returns_the_chunk_once_it_arrives():
    """A waiter that asked before the manifest and chunk arrived gets the bytes once added."""
    store = ChunkStore()
    manifest, chunks = _version(1, _blob(3))
    asked = asyncio.Event()

    async def ask() -> bytes | None:
        asked.set()
        return await store.chunk(1, None, 2, 30.0)

    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        waiter = tg.create_task(ask())
        await asked.wait()  # the waiter now sits in chunk(), on the store's pulse
        held = store.begin(manifest)
        for i in (0, 1, 3):
            await store.add(held, i, chunks[i])
        assert not waiter.done()
        await store.add(held, 2, chunks[2])
    assert waiter.result() == chunks[2]


async def test_long_poll_gives_up_after_wait_s():
    """With nothing arriving, chunk() answers None once wait_s has passed."""
    store = ChunkStore()
    store.begin(_version(1, _blob(4))[0])
    for version, base in ((1, None), (2, None), (1, 0)):  # missing chunk, unknown version, key
        start = time.monotonic()
        assert await store.chunk(version, base, 0, 0.05) is None
        assert time.monotonic() - start >= 0.05


async def test_gone_for_evicted_versions_and_bad_indices():
    """A version older than all kept, or an index outside the manifest, is GONE at once."""
    store = ChunkStore(keep=2)
    n_chunks = len(_version(1, _blob(1))[1])
    for v in (1, 2, 3):
        store.begin(_version(v, _blob(v))[0])
    async with asyncio.timeout(5):  # each answer comes at once, not after wait_s
        assert await store.chunk(1, None, 0, 30.0) == GONE
        assert await store.chunk(3, None, n_chunks, 30.0) == GONE
        assert await store.chunk(3, None, -1, 30.0) == GONE


async def test_eviction_keeps_the_newest_versions_and_streams():
    """With keep=2, only the two newest versions are served and kept as bases for deltas."""
    store = ChunkStore(keep=2)
    blobs = {v: _blob(v) for v in (1, 2, 3, 4)}
    served = {v: await _complete(store, v, blobs[v]) for v in blobs}
    assert store.newest_stream() == 4
    for v in (1, 2):
        assert await store.chunk(v, None, 0, 0) == GONE
    for v in (3, 4):
        assert await store.chunk(v, None, 1, 0) == served[v][1]
    new = _changed(blobs[4])
    assert store.begin(_version(5, new, base=(2, blobs[2]))[0]) is None
    assert store.begin(_version(5, new, base=(3, blobs[3]))[0]) is not None


async def test_corrupt_chunk_is_refused_and_not_served():
    """add() raises SnapshotError for a corrupt or truncated chunk, which is then not served."""
    store = ChunkStore()
    manifest, chunks = _version(1, _blob(5))
    held = store.begin(manifest)
    bad = bytearray(chunks[0])
    bad[len(bad) // 2] ^= 1
    for wrong in (bytes(bad), chunks[0][:-1]):
        with pytest.raises(SnapshotError):
            await store.add(held, 0, wrong)
    assert await store.chunk(1, None, 0, 0.05) is None
    await store.add(held, 0, chunks[0])
    assert await store.chunk(1, None, 0, 0) == chunks[0]


# --- chunk_handler over a real socket ------------------------------------------------------


@contextlib.asynccontextmanager
async def chunk_server(lookup, meter: UploadMeter, served: list[tuple[int, int]]
                       ) -> AsyncIterator[aiohttp.ClientSession]:
    """`lookup` (a ChunkStore's chunk) served on 127.0.0.1 port 0 as a peer serves it; a client
    session bound to it."""
    app = web.Application()
    app.router.add_get("/chunk/{version}/{base}/{index}",
                       chunk_handler(lookup, meter, on_served=lambda *a: served.append(a)))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield http
    finally:
        await runner.cleanup()


async def test_server_answers_200_503_404():
    """200 with the exact bytes and length (over several pieces), 503 while not here, 404 once
    gone; the meter counts exactly the bytes sent with 200."""
    store, meter, served = ChunkStore(keep=1), UploadMeter(), []
    v1 = _blob(6, 3 * PIECE_BYTES)  # random: chunks do not compress, so they span pieces
    manifest, chunks = _version(1, v1, chunk_bytes=2 * PIECE_BYTES + 123)
    held = store.begin(manifest)
    async with chunk_server(store.chunk, meter, served) as http:
        async with http.get(chunk_path(1, None, 0), params={"wait": "0.05"}) as resp:
            assert resp.status == 503
        for i, chunk in enumerate(chunks):
            await store.add(held, i, chunk)
        for i, chunk in enumerate(chunks):
            async with http.get(chunk_path(1, None, i)) as resp:
                assert resp.status == 200 and resp.content_length == len(chunk)
                assert resp.headers["Content-Type"] == "application/octet-stream"
                assert await resp.read() == chunk
        assert len(chunks[0]) > PIECE_BYTES
        store.begin(_version(2, _blob(7))[0])  # keep=1: version 1 is dropped
        async with http.get(chunk_path(1, None, 0), params={"wait": "5"}) as resp:
            assert resp.status == 404
        async with http.get(chunk_path(2, None, 99)) as resp:
            assert resp.status == 404
    assert meter.served_bytes == sum(map(len, chunks))
    assert served == [(1, len(c)) for c in chunks]


async def test_server_long_poll_answers_when_the_chunk_arrives():
    """A request with wait=S made before the chunk is here gets 200 as soon as it is added."""
    store, meter = ChunkStore(), UploadMeter()
    manifest, chunks = _version(1, _blob(8))
    held = store.begin(manifest)
    looked_up = asyncio.Event()

    async def lookup(*key_and_wait):
        looked_up.set()
        return await store.chunk(*key_and_wait)

    async def fetch() -> tuple[int, bytes]:
        async with http.get(chunk_path(1, None, 0), params={"wait": "20"}) as resp:
            return resp.status, await resp.read()

    async with chunk_server(lookup, meter, []) as http, asyncio.timeout(10):
        async with asyncio.TaskGroup() as tg:
            request = tg.create_task(fetch())
            await looked_up.wait()  # the handler now sits in chunk(), on the store's pulse
            await store.add(held, 0, chunks[0])
        assert request.result() == (200, chunks[0])
    assert meter.served_bytes == len(chunks[0])


@pytest.mark.parametrize("path, query", [
    ("/chunk/x/full/0", {}), ("/chunk/1/zz/0", {}), ("/chunk/1/full/y", {}),
    ("/chunk/1.5/full/0", {}), ("/chunk/1/full/0", {"wait": "soon"}),
    ("/chunk/1/full/0", {"wait": ""}),
])
async def test_server_rejects_malformed_requests(path, query):
    """A path or wait value that does not parse answers 400 and sends no chunk."""
    store, meter = ChunkStore(), UploadMeter()
    manifest, chunks = _version(1, _blob(9))
    held = store.begin(manifest)
    await store.add(held, 0, chunks[0])
    async with chunk_server(store.chunk, meter, []) as http:
        async with http.get(path, params=query) as resp:
            assert resp.status == 400
    assert meter.served_bytes == 0


async def test_server_clamps_negative_wait():
    """A negative wait is taken as 0: an immediate 503, not an error."""
    store = ChunkStore()
    store.begin(_version(1, _blob(10))[0])
    async with chunk_server(store.chunk, UploadMeter(), []) as http:
        async with http.get(chunk_path(1, None, 0), params={"wait": "-3"}) as resp:
            assert resp.status == 503


async def test_server_refuses_nan_wait():
    """wait=nan is a malformed request (400), not a long poll that never ends."""
    store = ChunkStore()
    store.begin(_version(1, _blob(11))[0])
    async with chunk_server(store.chunk, UploadMeter(), []) as http:
        async with http.get(chunk_path(1, None, 0), params={"wait": "nan"},
                            timeout=aiohttp.ClientTimeout(total=0.5)) as resp:
            assert resp.status == 400
