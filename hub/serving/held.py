"""A peer's connection whose answers leave no earlier than a set time after a rollout arrived.

The code task's reward runs the completion's program, whose run time the completion chooses:
an answer sent as soon as the rollout is judged would tell its sender how long its programs
ran (a program that sleeps on one bit of something it read leaks that bit per rollout).
`Held(conn, hold_s)` stands for `conn` while one rollout is judged (`hub.serving.admission`): what it
posts leaves at `hold_s` after it was made, or at once if that time has passed. Everything else
(admission, re-queued prompts, trust) happens when judged; only the frame waits.
"""

from __future__ import annotations

import asyncio
from typing import Any

from echo2p2p import messages as m

from .peers import PeerConn


class Held:
    """`conn`, its `post`s held until `hold_s` after this was made (the loop's clock)."""

    def __init__(self, conn: PeerConn, hold_s: float):
        self._conn, self._loop = conn, asyncio.get_running_loop()
        self.not_before = self._loop.time() + hold_s

    def post(self, msg: m.Message) -> None:
        if self._loop.time() >= self.not_before:
            self._conn.post(msg)
        else:  # a connection gone meanwhile drops it (`PeerConn.post`)
            self._loop.call_at(self.not_before, self._conn.post, msg)

    def __getattr__(self, name: str) -> Any:  # the peer's id, identity, hello, protocol...
        return getattr(self._conn, name)
