"""How one published version spread to the peers: the hub's propagation record, pure.

A `Propagation` is opened when a version is published, with the peers expected to fetch it.
It notes when each one finished the transfer and when it said it serves the version (or a newer
one: a peer may skip a version) — its engine reloaded, so T_bcast as the paper defines it, the
time until 90 % of peers can generate with the version, is `t_bcast_s`.
Each peer's transfer report is believed only as far as the manifest could carry (`count`); the
sources' upload rates follow from what receivers got over their median span; `record` is the
run log's "propagation" record (with its CDF in deciles, `deciles`, and the T_bcast the hub
predicted at publication). No clock (times come in as arguments), no I/O, no peers' sockets.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from . import messages as m
from .relay import propagation

MIN_MEASURED_BYTES = 256 << 10  # less from one source says nothing about its upload
MAX_RATE_BYTES_S = 12.5e9  # 100 Gbit/s: a reported transfer faster than this is not believed


@dataclass
class Propagation:
    """How one version spread: who was there at publication, and when each finished."""

    version: int
    started: float
    expected: set[str]
    done_after_s: dict[str, float] = field(default_factory=dict)  # transfer finished
    serving_after_s: dict[str, float] = field(default_factory=dict)  # engine reloaded
    bytes_from_hub: int = 0  # served by the hub's chunk route
    hub_sent_after_s: float = 0.0  # when the hub's last chunk of it went out
    bytes_from_peers: int = 0  # as the peers report
    on_delta: int = 0
    received: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # source -> (bytes, span)
    predicted_bcast_s: float | None = None  # the capacity model's, made at publication
    dealt: dict[str, int] = field(default_factory=dict)  # chunks each peer relays or seeds
    idle: int = 0  # peers announced it but not expected: announced an earlier one, none held

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
        """Each source's upload, bits/s: what receivers got from it over their median span (of
        an even count, the shorter middle one: one liar of two receivers cannot slow an honest
        relay on paper, and of more it moves the median by one place at most)."""
        return {source: 8 * sum(n for n, _ in got) / _lower_median(span for _, span in got)
                for source, got in self.received.items()
                if sum(n for n, _ in got) >= MIN_MEASURED_BYTES}

    def hub_send_bps(self) -> float | None:
        """The hub's send rate, bits/s: what it served of this version until its last chunk
        went out (None: too little to say)."""
        if self.bytes_from_hub < MIN_MEASURED_BYTES or self.hub_sent_after_s <= 0:
            return None
        return 8 * self.bytes_from_hub / self.hub_sent_after_s

    def record(self, full_wire_bytes: int, delta_wire_bytes: int | None, complete: bool
               ) -> dict[str, Any]:
        """The run log's "propagation" record (without the peers' upload rates), for a version
        of `full_wire_bytes` in full (0: no longer kept) and `delta_wire_bytes` as a delta."""
        size = full_wire_bytes
        serving = propagation(list(self.serving_after_s.values()), len(self.expected))
        return {
            "event": "propagation", "version": self.version, "peers": len(self.expected),
            **propagation(list(self.done_after_s.values()), len(self.expected)),
            "cdf_s": deciles(list(self.done_after_s.values()), len(self.expected)),
            "done_s": round(max(self.done_after_s.values(), default=0.0), 3),
            "done_by_peer_s": {p: round(t, 3) for p, t in self.done_after_s.items()},
            "chunks_dealt": dict(self.dealt),
            "serving": serving, "t_bcast_s": serving["t90_s"],
            "predicted_bcast_s": self.predicted_bcast_s,
            "hub_sent_s": round(self.hub_sent_after_s, 3),
            "complete": complete, "full_wire_bytes": size,
            "delta_wire_bytes": delta_wire_bytes,
            "peers_on_delta": self.on_delta, "peers_idle": self.idle,
            "bytes_from_hub": self.bytes_from_hub, "bytes_from_peers": self.bytes_from_peers,
            "hub_upload_copies": round(self.bytes_from_hub / size, 3) if size else None,
        }


def deciles(done_after_s: list[float], n_peers: int) -> list[float | None]:
    """Seconds until 0, 10, ..., 100 % of `n_peers` held the version (0 % at 0 s; None: not
    reached), counted as `echo2p2p.relay.propagation` counts its 50/90/100 %."""
    times = sorted(done_after_s)
    cdf: list[float | None] = [0.0]
    for pct in range(10, 101, 10):
        need = max(1, -(-n_peers * pct // 100))  # ceil, in integers
        cdf.append(round(times[need - 1], 3) if len(times) >= need else None)
    return cdf


def _lower_median(values: Iterable[float]) -> float:
    """The median of an odd count; of an even count, the lower of the middle two."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]
