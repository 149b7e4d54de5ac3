"""The hub's door as the shell keeps it: the HTTP 429 that turns a connection away before its
websocket upgrade, held back a while (a tarpit). Whether to turn it away is the core's door's
decision (`hub.core.door.Door.knock`, asked through `HubCore.knock`); holding the answer and
writing it are I/O, and stay here.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

RETRY_AFTER_S = "5"  # what a connection the join limits turned away is told to wait, at least
REFUSAL_HOLD_S = 1.0  # a refused connection waits this long for its 429
HELD_REFUSALS = 1024  # refusals held back at once, all addresses (open sockets: bounded)


class Tarpit:
    """Refusals held back `REFUSAL_HOLD_S` before they are answered; one per hub."""

    def __init__(self) -> None:
        self.held = 0  # refusals being held back now

    async def turn_away(self, why: str) -> web.Response:
        """The HTTP 429 saying `why`, held back `REFUSAL_HOLD_S` first (as Tor and BitTorrent
        trackers answer a client that asks too often): a churner asking again at once made the
        hub answer 1,300 refusals a second, which cost training more than the joins it was
        refused; held, one asking in turn gets one answer a second. At most `HELD_REFUSALS`
        are held at once: past them, at once."""
        if self.held < HELD_REFUSALS:
            self.held += 1
            try:
                await asyncio.sleep(REFUSAL_HOLD_S)  # the tarpit itself, not a synchronisation
            finally:
                self.held -= 1
        return web.Response(status=429, text=why, headers={"Retry-After": RETRY_AFTER_S})
