"""Rollout submissions the hub has not acknowledged yet.

A submission stays here from the moment it is made until the hub answers it (ack or reject), and
every one still here is sent again after a reconnect: a dropped connection or a hub killed and
resumed costs no finished work (a resumed hub answers a second copy of an admitted one as a
duplicate; a hub that kept running tells a new connection only of its own leases, so it answers
`unknown_lease`, and the first copy's verdict stands).
Up to `memory_bytes` of them are kept in memory, more spill to files in a spool directory; past
`max_entries` the oldest is dropped with a warning (its lease expires at the hub and the prompt is
granted again: work is lost, no prompt group).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from echo2p2p import messages as m

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, memory_bytes: int, max_entries: int, spool_dir: str = ""):
        self.memory_bytes = memory_bytes
        self.max_entries = max_entries
        self._spool_parent = spool_dir or None
        self._spool: Path | None = None
        self._entries: OrderedDict[str, bytes | Path] = OrderedDict()
        self._in_memory = 0
        self.spilled_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, sub: m.RolloutSubmission) -> None:
        frame = m.encode(sub)
        self.pop(sub.lease_id)
        if self._in_memory + len(frame) <= self.memory_bytes:
            self._entries[sub.lease_id] = frame
            self._in_memory += len(frame)
        else:
            if self._spool is None:
                self._spool = Path(tempfile.mkdtemp(prefix="echo2-outbox-", dir=self._spool_parent))
            path = self._spool / f"{len(self._entries)}-{sub.lease_id}.msgpack"
            path.write_bytes(frame)
            self._entries[sub.lease_id] = path
            self.spilled_total += 1
        while len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            log.warning("outbox full (%d): dropping the rollout of lease %s", self.max_entries, oldest)
            self.pop(oldest)

    def pop(self, lease_id: str) -> None:
        """The hub answered `lease_id`: forget it."""
        entry = self._entries.pop(lease_id, None)
        if isinstance(entry, Path):
            entry.unlink(missing_ok=True)
        elif entry is not None:
            self._in_memory -= len(entry)

    def pending(self) -> list[m.RolloutSubmission]:
        """Every unanswered submission, oldest first."""
        return [m.decode(e.read_bytes() if isinstance(e, Path) else e)
                for e in list(self._entries.values())]

    def clear(self) -> None:
        """Forget everything (the hub now runs another run)."""
        for lease_id in list(self._entries):
            self.pop(lease_id)

    def drop_newer_than(self, version: int) -> int:
        """Forget submissions made with versions after `version` (a hub that resumed from an
        older checkpoint will never train on them); how many went."""
        gone = [s.lease_id for s in self.pending() if s.version > version]
        for lease_id in gone:
            self.pop(lease_id)
        return len(gone)

    def close(self) -> None:
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
