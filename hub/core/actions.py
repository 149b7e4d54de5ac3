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
from collections.abc import Callable
from typing import Any

from echo2p2p import messages as m
from echo2p2p.buffer import ScoredGroup


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
    """One run log record (`hub.view.runlog`); `dated`: the core adds the learner's step."""

    record: dict[str, Any]
    dated: bool = False


@dataclass(frozen=True)
class Joined:
    """Connection `conn_id` joined as peer `peer_id` (its Welcome follows as a `Send`)."""

    conn_id: str
    peer_id: str


@dataclass(frozen=True)
class Refused:
    """Connection `conn_id`'s hello is refused: say `reason` and close it with `code`."""

    conn_id: str
    code: int
    reason: str


@dataclass(frozen=True)
class Score:
    """Score submission `lease_id`'s samples from their token ids with the task's verifier, in
    `owner`'s queue at the scorer; its result comes back as `ScoringFinished`. `problem`: the
    task's problem (the verifier's key); `turns`: the episodes' turns (None: not episodes)."""

    lease_id: str
    owner: str
    problem: object
    token_ids: tuple[bytes, ...]
    texts: tuple[str, ...]
    turns: tuple[object, ...] | None


@dataclass(frozen=True)
class SpotCheck:
    """Recompute `group`'s behaviour logprobs under its claimed version (the weights taken
    now); its result comes back as `SpotCheckFinished` (`hub.learning.spotcheck`)."""

    lease_id: str
    group: ScoredGroup


@dataclass(frozen=True)
class SpotCheckDropped:
    """The spot-check of `lease_id` is no longer wanted (its submission was refused first)."""

    lease_id: str


@dataclass(frozen=True)
class BatchReady:
    """The learner's batch for step `step` (the one queue the learner loop reads)."""

    step: int
    groups: tuple[ScoredGroup, ...]


@dataclass(frozen=True)
class EndTurn:
    """Feed `TurnEnded` at the end of this event loop turn (a lease pass is due): every
    frame of one turn asks, one pass serves them all (`bench/ingest.py`)."""


@dataclass
class Outbox:
    """The actions emitted since the last `drain`, in the order they were decided."""

    actions: list[Any] = field(default_factory=list)

    def emit(self, action: Any) -> None:
        self.actions.append(action)

    def drain(self) -> list[Any]:
        actions, self.actions = self.actions, []
        return actions
