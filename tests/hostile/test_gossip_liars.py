"""Liars on the gossip overlay (issue 28, item 8): a peer that serves corrupt pieces over its
links, one that advertises chunks and serves none, and one that fills honest peers' link slots
with peer ids the hub never admitted.

The first must end quarantined by the hub on the hub's own evidence (it fetches the contested
piece over a gossip link itself, `hub.overlay.gossip_check`), not only banned by each peer it hurt; the
second must be announced to nobody more; the third must take no slot at all: a `peers` entry
needs the hub's ticket for its id, and a dialled end proves its id before its link counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import aiohttp
import msgpack
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p.overlay.link import LINK_PATH
from echo2p2p.overlay.tickets import Credentials

from tests.conftest import running_peers, serving, until
from .attackers import raw_peer
from .conftest import yes
from .harness import (HONEST, cell_rate, hub_alive, hub_and_honest_peer, mark, peer_id,
                      run_events, small_cfg, steps_per_min, still_training)

MADE_UP = 16  # ids in one peers frame (the frame's cap)


def corrupt_links(client) -> None:
    """Make `client`'s gossip links serve every piece with its first byte flipped (its chunk
    server's HTTP route stays honest: only its link neighbours see the lie)."""
    links = client.fetcher.links
    honest = links.upload

    async def upload(link, piece, slots):
        await honest(link, replace(piece, data=bytes([piece.data[0] ^ 1]) + piece.data[1:]), slots)

    links.upload = upload


def silent_links(client) -> None:
    """Make `client`'s gossip links answer no want (it still advertises what it holds)."""

    async def upload(link, piece, slots):
        await asyncio.Event().wait()  # cancelled when the link closes

    client.fetcher.links.upload = upload


async def test_a_peer_serving_corrupt_pieces_over_links_is_quarantined(tmp_path, row):
    """A relay-only peer corrupts every piece it serves over its gossip links: the honest peer
    drops it and reports it; the hub fetches the piece over a link of its own, finds it corrupt,
    quarantines the liar and stops announcing it; the honest peer keeps training."""
    r = row("R3-8a. gossip liar: every piece it serves over its links corrupt")
    cfg = small_cfg(tmp_path, relay="gossip", chunk_bytes=16 << 10)
    async with hub_and_honest_peer(cfg) as (run, honest):
        without = await steps_per_min(run)
        since = mark(run, honest)
        async with running_peers(run.url, 1, torch_threads=1, engine="relay",
                                 name="liar") as [liar]:
            await asyncio.wait_for(liar.wait_welcomed(), 60)
            corrupt_links(liar)
            liar_id = liar.welcome.peer_id
            identity = run.hub.peer_views()[liar_id].identity
            await asyncio.wait_for(run.hub.until(lambda: identity in run.hub.statistics().quarantined), 240)
            checks = run_events(run, "relay_check")
            with_ = await steps_per_min(run)
            r.honest_training = await still_training(run, honest, since)
            r.steps_per_min = cell_rate(without, with_)
            verdicts = sorted({c["verdict"] for c in checks if c["accused"] == liar_id})
            events = {e: n for e, n in run.hub.statistics().trust_events[identity].items() if n}
            reports = {k: n for k, n in run.hub.statistics().relay_reports_by.items() if k[0] == liar_id}
            r.reaction = (f"honest peer banned it ({liar_id in honest.fetcher.links.banned}), "
                          f"reported {sum(reports.values())}x; hub's own link fetch: "
                          f"{verdicts}; trust {events} -> quarantined; "
                          f"relay {run.hub.peer_views()[liar_id].relay}")
            assert "corrupt" in verdicts
            assert run.hub.peer_views()[liar_id].relays_for is None  # announced to nobody now
        r.hub_alive = yes(await hub_alive(run))
        assert r.hub_alive == "yes"


async def test_a_peer_that_never_serves_what_it_advertises_is_taken_out_of_relaying(tmp_path,
                                                                                     row):
    """A relay-only peer advertises its chunks over its links and answers no want: the honest
    peer drops it and reports a stall; the hub's own want of it goes unanswered too, so the hub
    announces it to nobody more (no trust event: slowness proves no lie); training goes on."""
    r = row("R3-8c. gossip liar: advertises its chunks over links, answers no want")
    # Versions a few steps apart and a short stall deadline: on this rig a version lasts seconds,
    # and a download superseded before its want times out withdraws it unreported.
    cfg = small_cfg(tmp_path, relay="gossip", chunk_bytes=16 << 10, max_lag=3, publish_every=4)
    async with hub_and_honest_peer(cfg, relay_stall_s=1.0) as (run, honest):
        without = await steps_per_min(run)
        since = mark(run, honest)
        async with running_peers(run.url, 1, torch_threads=1, engine="relay",
                                 name="liar") as [liar]:
            await asyncio.wait_for(liar.wait_welcomed(), 60)
            silent_links(liar)
            liar_id = liar.welcome.peer_id
            await until(run.hub, lambda: run.hub.peer_views()[liar_id].relay == "failed", 240)
            conn = run.hub.peer_views()[liar_id]
            checks = run_events(run, "relay_check")
            with_ = await steps_per_min(run)
            r.honest_training = await still_training(run, honest, since)
            r.steps_per_min = cell_rate(without, with_)
            verdicts = sorted({c["verdict"] for c in checks if c["accused"] == liar_id})
            reports = {k[1]: n for k, n in run.hub.statistics().relay_reports_by.items()
                       if k[0] == liar_id}
            events = {e: n for e, n in run.hub.statistics().trust_events.get(conn.identity, {}).items() if n}
            r.reaction = (f"honest peer banned it ({liar_id in honest.fetcher.links.banned}), "
                          f"reported {reports}; hub's own link want: {verdicts}; relay "
                          f"{conn.relay}, in no neighbour sample; trust events {events or 'none'}")
            assert "stall" in verdicts and conn.relays_for is None
            assert conn.identity not in run.hub.statistics().quarantined
        r.hub_alive = yes(await hub_alive(run))
        assert r.hub_alive == "yes"


@dataclass
class SybilServer:
    """A gossip endpoint that accepts a link under any id and holds it open, saying nothing:
    where an attacker points the made-up ids it spreads. `dialled` holds the ids asked for."""

    url: str = ""
    dialled: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def sybil_server() -> AsyncIterator[SybilServer]:
    server = SybilServer()

    async def accept(request: web.Request) -> web.WebSocketResponse:
        server.dialled.append(request.query.get("id", ""))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:
            pass
        return ws

    app = web.Application()
    app.router.add_get(LINK_PATH, accept)
    async with serving(app) as port:
        server.url = f"http://127.0.0.1:{port}"
        yield server


async def test_made_up_ids_in_a_peers_frame_take_no_link_slot(tmp_path, row):
    """An admitted peer links to the honest one and sends a `peers` frame of 16 made-up ids
    (forged tickets), all at its own server, which accepts any link: the honest peer dials none
    of them, and none takes a link slot, while it keeps training."""
    r = row(f"R3-8b. peers frame of {MADE_UP} made-up ids, all at the attacker's own /gossip")
    cfg = small_cfg(tmp_path, relay="gossip")
    async with hub_and_honest_peer(cfg) as (run, honest), \
            raw_peer(run.url, keep_alive=True) as raw, sybil_server() as sybil, \
            aiohttp.ClientSession() as http:
        without = await steps_per_min(run)
        welcome = await raw.hello(name="pex-liar")
        assert welcome is not None, raw.reaction()
        target = peer_id(run, HONEST)
        creds = Credentials(run.hub.core.run_id, raw.peer_id, raw.key, welcome["ticket"])
        fakes = [f"p{9000 + i}" for i in range(MADE_UP)]
        since = mark(run, honest)
        async with http.ws_connect(honest.served_url + LINK_PATH,
                                   params={"id": raw.peer_id, "nat": "1"},
                                   headers=creds.header(target)) as ws:
            entries = [{"peer_id": f, "url": sybil.url, "key": os.urandom(32),
                        "ticket": os.urandom(64)} for f in fakes]
            await ws.send_bytes(msgpack.packb({"p": m.BASE_PROTOCOL, "t": "peers",
                                               "sources": entries}, use_bin_type=True))
            # A want of a manifest it does not hold is answered (`cancel`) after the peers frame
            # was taken in: from then on any dial it caused is under way.
            await ws.send_bytes(msgpack.packb({"p": m.BASE_PROTOCOL, "t": "want",
                                               "version": 10_000, "base": None, "index": 0},
                                              use_bin_type=True))
            while (msg := await ws.receive()).type is aiohttp.WSMsgType.BINARY:
                if msgpack.unpackb(msg.data).get("t") == "cancel":
                    break
            assert msg.type is aiohttp.WSMsgType.BINARY, f"link closed: {ws.close_code}"
            with_ = await steps_per_min(run)
            r.honest_training = await still_training(run, honest, since)
            links = honest.fetcher.links
            taken = sorted(set(fakes) & set(links.links))
            r.reaction = (f"made-up ids dialled {len(sybil.dialled)}, linked {len(taken)}, "
                          f"remembered {len(set(fakes) & set(links.known))}; the liar's own "
                          f"link kept: {raw.peer_id in links.links}")
            r.steps_per_min = cell_rate(without, with_)
            assert not sybil.dialled and not taken, r.reaction
        r.hub_alive = yes(await hub_alive(run))
        assert r.hub_alive == "yes"
