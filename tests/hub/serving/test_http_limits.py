"""The hub's HTTP request budget on real sockets on 127.0.0.1 (`hub.serving.http_limits`): past
its burst an address's requests wait their turn, then are refused with 429 and Retry-After;
another address and the peers' websocket are not held back; past the open bound a request is
dropped with its connection; computed bodies are built once a moment."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
from aiohttp import web

from echo2p2p.join_limits import Rate
from echo2p2p.request_budget import PAGES, RequestBudget, RouteLimit
from echo2p2p.hub.overlay.model_files import ModelFiles, model_routes
from echo2p2p.hub.serving.app import ROUTE_CLASSES
from echo2p2p.hub.serving.http_limits import Recent, budget_middleware

from tests.conftest import serving, tracker

GUARD_S = 60.0  # a request that hangs fails the test here; nothing here is timed


def client(address: str = "127.0.0.1") -> aiohttp.ClientSession:
    """A client whose connections leave from `address` (any 127.x.y.z is this host)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0), limit=0),
                                 timeout=aiohttp.ClientTimeout(total=GUARD_S))


async def statuses(http: aiohttp.ClientSession, url: str, n: int) -> list[tuple[int, str | None]]:
    """`n` GETs of `url` at once: (status, Retry-After) of each, in order of sending."""

    async def one() -> tuple[int, str | None]:
        async with http.get(url) as r:
            await r.read()
            return r.status, r.headers.get("Retry-After")

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_an_address_over_its_burst_waits_then_is_refused_and_others_go_on():
    """Burst 2 at 1/s: of 8 requests at once, 2 are answered at once, 2 after their turn (the
    2 s wait), 4 refused with 429 and Retry-After; an address of its own and /ws are unaffected."""
    async with tracker(http_requests_per_min=60, http_burst=2) as (hub, _, ws_url, _), \
            client() as flooder, client("127.0.0.2") as other:
        base = ws_url.removeprefix("ws://").removesuffix("/ws")
        answers = await statuses(flooder, f"http://{base}/status", 8)  # no such route: pages
        codes = collections.Counter(code for code, _ in answers)
        assert codes == {404: 4, 429: 4}, answers
        assert {after for code, after in answers if code == 429} <= {"3", "4", "5", "6"}
        assert await statuses(other, f"http://{base}/status", 2) == [(404, None)] * 2
        upgrades = await statuses(flooder, f"http://{base}/ws", 10)  # the join limits' to hold
        assert 429 not in {code for code, _ in upgrades}, upgrades


async def test_past_the_open_bound_a_request_is_dropped_with_its_connection():
    """Two requests of an address held open; a third is answered 429 at once, its connection
    closed; once one is answered, the address may ask again."""
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="done")

    budget = RequestBudget({PAGES: RouteLimit(Rate(0, 1), 2.0, max_open=2)})
    app = web.Application(middlewares=[budget_middleware(budget, {})])
    app.router.add_get("/slow", slow)
    async with serving(app) as port, client() as http:
        url = f"http://127.0.0.1:{port}/slow"
        held = [asyncio.create_task(statuses(http, url, 1)) for _ in range(2)]
        async with asyncio.timeout(GUARD_S):
            while budget.open_requests(PAGES, "127.0.0.1") < 2:
                await asyncio.sleep(0.01)  # polling the server's count
        async with http.get(url) as r:
            assert r.status == 429 and r.headers["Connection"] == "close"
            assert r.headers["Retry-After"] == "1"
        release.set()
        assert [await t for t in held] == [[(200, None)]] * 2
        assert await statuses(http, url, 1) == [(200, None)]
    assert budget.statistics().limited == {(PAGES, "dropped"): 1}


async def test_a_request_whose_client_left_while_it_waited_is_not_answered():
    """A request waiting its turn whose client hangs up meanwhile never reaches the handler
    (what a flood leaves waiting as it stops costs no build)."""
    calls = []

    async def handler(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.Response(text="built")

    budget = RequestBudget({PAGES: RouteLimit(Rate(60, 1), 2.0, max_open=8)})
    app = web.Application(middlewares=[budget_middleware(budget, {})])
    app.router.add_get("/built", handler)
    async with serving(app) as port, client() as http:
        assert await statuses(http, f"http://127.0.0.1:{port}/built", 1) == [(200, None)]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /built HTTP/1.1\r\nHost: x\r\n\r\n")  # its turn is a second away
        await writer.drain()
        async with asyncio.timeout(GUARD_S):
            while budget.open_requests(PAGES, "127.0.0.1") == 0:
                await asyncio.sleep(0.01)  # until the server holds it
            writer.close()
            while budget.open_requests(PAGES, "127.0.0.1"):
                await asyncio.sleep(0.01)  # until its wait is over
    assert calls == ["/built"]
    assert budget.statistics().limited == {(PAGES, "delayed"): 1}


async def test_every_route_peers_use_has_its_class():
    """The websocket, the chunks and the model files are classed by the paths they are
    registered under: a renamed route would fall to the pages' budget, which peers outrun."""
    async with tracker() as (hub, _, _, _):
        peer_routes = {*hub.routes(), *model_routes(ModelFiles("m", {}))}
    assert peer_routes == set(ROUTE_CLASSES)


def test_recent_builds_a_value_at_most_once_a_moment():
    built = []
    recent = Recent(fresh_s=1.0)

    def build() -> int:
        built.append(1)
        return len(built)

    assert [recent.get("k", build, now=t) for t in (0.0, 0.5, 0.99, 1.0, 1.5)] == [1, 1, 1, 2, 2]
    assert recent.get("other", build, now=1.5) == 3  # keys apart
    assert recent.get("k", build, now=0.2) == 4  # a clock that went back: built again
