"""The uplink probe: a chunk server sends bounded zeros, paced like chunks; the hub times it."""

from __future__ import annotations

import contextlib

import aiohttp
from aiohttp import web

from echo2p2p.hub.overlay.relay_checks import PROBE_BYTES, RelayCheck
from echo2p2p.overlay.serving import MAX_PROBE_BYTES, PROBE_PATH, TokenBucket, probe_handler


@contextlib.asynccontextmanager
async def server(limiter=None, authorize=None):
    app = web.Application()
    app.router.add_get(PROBE_PATH, probe_handler(limiter, authorize=authorize))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_the_probe_sends_what_is_asked_within_its_bound():
    """N zero bytes for N up to MAX_PROBE_BYTES, no more past it; a bad N is a 400."""
    async with server() as base, aiohttp.ClientSession() as http:
        for asked, sent in ((1000, 1000), (0, 0), (10**12, MAX_PROBE_BYTES), (-5, 0)):
            async with http.get(base + PROBE_PATH, params={"bytes": str(asked)}) as resp:
                assert resp.status == 200 and await resp.read() == bytes(sent)
        async with http.get(base + PROBE_PATH, params={"bytes": "1e9"}) as resp:
            assert resp.status == 400


async def test_the_probe_asks_for_a_ticket():
    async with server(authorize=lambda request: False) as base, aiohttp.ClientSession() as http:
        async with http.get(base + PROBE_PATH, params={"bytes": "10"}) as resp:
            assert resp.status == 403


async def test_the_hub_times_a_capped_uplink_at_no_more_than_its_cap():
    """Behind an 8 Mbit/s token bucket the hub's own timing stays under the cap (plus the
    bucket's one-piece burst); without a route it measures nothing."""
    check = RelayCheck(None)
    try:
        async with server(TokenBucket(8e6)) as base:
            rate = await check.uplink_bps(base, "peer")
        assert rate is not None and 0 < rate <= 8e6 * PROBE_BYTES / (PROBE_BYTES - (64 << 10))
        async with server() as base:
            assert await check.uplink_bps(base + "/nothing", "peer") is None
    finally:
        await check.close()


def test_only_the_hubs_own_ticket_opens_the_probe():
    """Another peer's valid ticket opens this server's chunks but not its probe (which it
    could use to fill the uplink); the hub's own ticket opens both."""
    from types import SimpleNamespace

    from echo2p2p import signing
    from echo2p2p.overlay.tickets import Credentials, Tickets

    hub_key, peer_key = signing.new_private_key(), signing.new_private_key()
    hub_pub = signing.public_key(hub_key)
    tickets = Tickets(hub_pub, "run", "p1")
    hub = Credentials("run", "hub", hub_key,
                      signing.sign_ticket(hub_key, "run", "hub", hub_pub)).header("p1")
    peer = Credentials("run", "p2", peer_key, signing.sign_ticket(
        hub_key, "run", "p2", signing.public_key(peer_key))).header("p1")
    as_request = [SimpleNamespace(headers=h) for h in (hub, peer)]
    assert [tickets(r) for r in as_request] == [True, True]
    assert [tickets.hub_only(r) for r in as_request] == [True, False]
    assert Tickets(b"").hub_only(SimpleNamespace(headers={}))  # a hub that issues none
