"""Encoding a catch-up delta: the IO half of `hub.core.catchups`.

The core decides which peer gets which delta and caches them (`hub.core.catchups.CatchUps`);
when it needs one encoded it emits `BuildDelta`, and the shell (`hub.serving.overlay_shell`)
runs `build_catch_up` in the event loop's default executor (never on the loop) and hands the
outcome back. The encode reads the two raw streams the publisher keeps (`versions.Bases`;
mapped files) and codes the chunks on a pool of threads: zstd releases the GIL.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from echo2p2p.errors import LocalProtocolError

from .versions import Published, Snapshot, signed_snapshot


def build_catch_up(target: Published, base: int) -> Snapshot | None:
    """The signed delta from `base` to `target` (both streams kept in `target.bases`), or None
    when it would not be smaller than `target` in full. Blocking: run it in a thread."""
    bases = target.bases
    assert bases is not None, "only a version with kept bases has catch-up deltas"
    full = target.full.manifest
    stream = memoryview(bases.streams[target.version]).cast("B")
    tensors = [(t.name, t.dtype, t.shape, stream[t.offset:t.offset + t.nbytes]) for t in full.tensors]
    with ThreadPoolExecutor(os.cpu_count()) as coder:  # zstd releases the GIL
        snap = signed_snapshot(target.version, tensors, chunk_bytes=full.chunk_bytes,
                               zstd_level=bases.zstd_level, sign=bases.sign,
                               base=(base, bases.streams[base]), map_chunks=coder.map)
    if snap.manifest.digest != full.digest:
        raise LocalProtocolError(f"the kept stream of v{target.version} is not the one published")
    return snap if snap.wire_bytes < target.full.wire_bytes else None
