"""Waiting without polling in the overlay's real-socket tests: on the hub's own events
(`Hub.until`), or on the frames a hand-made peer receives (`Frames.until`), each under a
deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from echo2p2p import messages as m


async def until(hub, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Return once `condition()` holds, looked at again after each event the hub handles."""
    async with asyncio.timeout(timeout_s):
        await hub.until(condition)


class Frames(list):
    """The messages a hand-made peer received, in order; `until` wakes on each one."""

    def __init__(self) -> None:
        super().__init__()
        self._arrived = asyncio.Event()

    def add(self, msg: m.Message) -> None:
        self.append(msg)
        self._arrived.set()

    async def until(self, condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
        """Return once `condition()` holds, looked at again after each frame received."""
        async with asyncio.timeout(timeout_s):
            while not condition():
                self._arrived.clear()
                await self._arrived.wait()
