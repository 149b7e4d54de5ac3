"""The hub's chunk route, watched: who asked for which chunk, and whether it was sent.

The seed watch itself is the core's (`hub.core.seeding.Seeding`, kept by the tracker): it
expects each peer dealt a share to fetch it from the hub. What it hears of the chunk route
comes from here: `watched` wraps the route's handler and reports each request a ticket holder
makes (`asked`) and how it ended (`answered`: sent, a 200, or not). The ticket names the
asker, and is checked before anything counts; a request without a valid ticket counts for
nobody.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from echo2p2p.overlay.tickets import TICKET_HEADER, Tickets
from echo2p2p.seed_watch import Key

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def watched(handler: Handler, tickets: Tickets, *, asked: Callable[[str, Key, int], None],
            answered: Callable[[str, Key, int, bool], None]) -> Handler:
    """The hub's chunk route `handler`, telling `asked(peer_id, key, index)` who asked for
    which chunk and `answered(peer_id, key, index, fetched)` whether it was sent (200)."""
    async def handle(request: web.Request) -> web.StreamResponse:
        who = asker(request, tickets)
        if who is None:
            return await handler(request)
        peer_id, key, index = who
        asked(peer_id, key, index)
        fetched = False
        try:
            response = await handler(request)
            fetched = response.status == 200
            return response
        finally:
            answered(peer_id, key, index, fetched)

    return handle


def asker(request: web.Request, tickets: Tickets) -> tuple[str, Key, int] | None:
    """(peer id, manifest, chunk index) of a chunk request whose ticket verifies, else None."""
    holder = tickets.holder(request.headers.get(TICKET_HEADER, ""))
    if holder is None or not holder[0]:
        return None  # no valid ticket (or a hub that issues none: nobody can be told apart)
    info = request.match_info
    try:
        version, index = int(info["version"]), int(info["index"])
        base = None if info["base"] == "full" else int(info["base"])
    except (KeyError, ValueError):
        return None
    return holder[0], (version, base), index
