"""What the hub publishes: a version as signed snapshots (full, and a delta against the previous
version), and `blob_version` for benchmarks and tests that need bytes, not a model. How a version
spreads is recorded by `echo2p2p.propagation`."""

from __future__ import annotations

from dataclasses import dataclass

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.snapshot import auto_chunk_bytes, build_snapshot


@dataclass(frozen=True)
class Snapshot:
    manifest: m.Manifest
    chunks: list[bytes]
    signature: bytes = b""

    @property
    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.manifest.chunks)


@dataclass(frozen=True)
class Published:
    """One version: always in full, and as a delta against the previous version unless an anchor."""

    full: Snapshot
    delta: Snapshot | None = None

    @property
    def version(self) -> int:
        return self.full.manifest.version


def blob_version(key: bytes, version: int, data: bytes, base: tuple[int, bytes] | None = None,
                 *, chunk_bytes: int = 0, zstd_level: int = 3) -> Published:
    """`data` as a signed version (one uint8 tensor), with a delta against `base` if given: for
    benchmarks and tests of the overlay, which need bytes, not a model."""
    chunk_bytes = chunk_bytes or auto_chunk_bytes(len(data))

    def signed(base_: tuple[int, bytes] | None) -> Snapshot:
        manifest, chunks = build_snapshot(version, [("blob", "uint8", [len(data)], data)],
                                          chunk_bytes=chunk_bytes, zstd_level=zstd_level, base=base_)
        return Snapshot(manifest, chunks, signing.sign_manifest(key, manifest))

    return Published(signed(None), signed(base) if base is not None else None)
