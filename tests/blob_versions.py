"""Versions made of bytes, not a model: what the overlay's tests and benchmarks publish.

`blob_version(key, version, data)` is `data` as one uint8 tensor, signed with `key` exactly as
the hub's publisher signs a model's weights (`hub.overlay.versions.signed_snapshot`), with a delta and
catch-up bases when asked. Benchmarks import it as `tests.blob_versions` (bench/broadcast.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from echo2p2p import signing
from echo2p2p.hub.overlay.versions import Bases, Published, signed_snapshot
from echo2p2p.snapshot import auto_chunk_bytes


def blob_version(key: bytes, version: int, data: bytes, base: tuple[int, bytes] | None = None,
                 *, chunk_bytes: int = 0, zstd_level: int = 3,
                 kept: Mapping[int, bytes] | None = None) -> Published:
    """`data` as a signed version (one uint8 tensor), with a delta against `base` if given. Its
    catch-up bases are `data`, `base` and the older streams in `kept` (version -> bytes)."""
    sign = partial(signing.sign_manifest, key)
    snapshot = partial(signed_snapshot, version, [("blob", "uint8", [len(data)], data)],
                       chunk_bytes=chunk_bytes or auto_chunk_bytes(len(data)),
                       zstd_level=zstd_level, sign=sign)
    streams = {**(kept or {}), **dict([base] if base is not None else []), version: data}
    return Published(snapshot(), snapshot(base=base) if base is not None else None,
                     Bases(streams, sign, zstd_level))
