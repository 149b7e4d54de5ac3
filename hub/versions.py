"""What the hub publishes and how it spreads: a version as signed snapshots (full, and a delta
against the previous version), and the record of one version's propagation to the peers."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.relay import propagation
from echo2p2p.snapshot import auto_chunk_bytes, build_snapshot

MIN_MEASURED_BYTES = 256 << 10  # less from one source says nothing about its upload
MAX_RATE_BYTES_S = 12.5e9  # 100 Gbit/s: a reported transfer faster than this is not believed


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


@dataclass
class Propagation:
    """How one version spread: who was there at publication, and when each finished."""

    version: int
    started: float
    expected: set[str]
    done_after_s: dict[str, float] = field(default_factory=dict)
    bytes_from_hub: int = 0  # served by the hub's chunk route
    hub_sent_after_s: float = 0.0  # when the hub's last chunk of it went out
    bytes_from_peers: int = 0  # as the peers report
    on_delta: int = 0
    received: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # source -> (bytes, span)

    def count(self, reporter: str, report: m.TransferReport, size: int) -> None:
        """`reporter`'s transfer report of a manifest of `size` wire bytes, believed only as far
        as that manifest could carry: no source sent more than the whole of it, faster than any
        link, or twice, and nobody is its own source."""
        self.bytes_from_peers += min(report.bytes_from_peers, size)
        seen: set[str] = set()
        for src in report.sources:
            if (src.peer_id in self.expected and src.peer_id not in (reporter, *seen)
                    and 0 < src.nbytes <= size and src.span_s >= src.nbytes / MAX_RATE_BYTES_S):
                seen.add(src.peer_id)
                self.received.setdefault(src.peer_id, []).append((src.nbytes, src.span_s))

    def upload_rates(self) -> dict[str, float]:
        """Each source's upload, bits/s: what receivers got from it over their median span."""
        return {source: 8 * sum(n for n, _ in got) / statistics.median(span for _, span in got)
                for source, got in self.received.items()
                if sum(n for n, _ in got) >= MIN_MEASURED_BYTES}

    def record(self, pub: Published | None, complete: bool) -> dict[str, Any]:
        """The run log's "propagation" record (without the peers' upload rates)."""
        size = pub.full.wire_bytes if pub else 0
        return {
            "event": "propagation", "version": self.version, "peers": len(self.expected),
            **propagation(list(self.done_after_s.values()), len(self.expected)),
            "done_s": round(max(self.done_after_s.values(), default=0.0), 3),
            "hub_sent_s": round(self.hub_sent_after_s, 3),
            "complete": complete, "full_wire_bytes": size,
            "delta_wire_bytes": pub.delta.wire_bytes if pub and pub.delta else None,
            "peers_on_delta": self.on_delta,
            "bytes_from_hub": self.bytes_from_hub, "bytes_from_peers": self.bytes_from_peers,
            "hub_upload_copies": round(self.bytes_from_hub / size, 3) if size else None,
        }


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
