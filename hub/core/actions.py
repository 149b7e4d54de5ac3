"""What the hub's core asks its shell to do, and the outbox its parts put those requests in.

The core (`hub.core.core.HubCore`) never sends, sleeps, scores or writes: each part that
decides something the world must see emits an action into the one `Outbox` the core drains
at the end of every `handle`. The shell (`hub.serving.server`) carries them out in order and
feeds back what came of them as events (`hub.core.events`). As in h11 and the websockets
library's sans-IO `Protocol`, the actions are plain values: a test reads them as the record
of what the hub decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from echo2p2p import messages as m


@dataclass(frozen=True)
class Send:
    """Frame `message` to peer `peer_id` (dropped if it is gone), not before `not_before` on
    the hub's clock (an answer held back: `hub.core.admission`, code rewards)."""

    peer_id: str
    message: m.Message
    not_before: float = 0.0


@dataclass(frozen=True)
class Close:
    """Say goodbye to peer `peer_id` with `code` and `reason`, and close its connection;
    `fault`: it broke the protocol or flooded (stop reading first, cut sooner)."""

    peer_id: str
    code: int
    reason: str
    fault: bool = False


@dataclass(frozen=True)
class Journal:
    """Append `record` to the hub's journal (`hub.learning.durable`) before anything after it."""

    record: tuple[Any, ...]


@dataclass(frozen=True)
class Record:
    """One run log record (`hub.view.runlog`)."""

    record: dict[str, Any]


@dataclass
class Outbox:
    """The actions emitted since the last `drain`, in the order they were decided."""

    actions: list[Any] = field(default_factory=list)

    def emit(self, action: Any) -> None:
        self.actions.append(action)

    def drain(self) -> list[Any]:
        actions, self.actions = self.actions, []
        return actions
