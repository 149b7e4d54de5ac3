"""Values and frames the protocol allows on the wire but no honest peer sends (issue 11,
items 2, 3 and 6): a transfer report of 2**63-1 bytes in 5e-324 s, a NaN or negative price, maps
of 590,000 unknown keys and a flood of tiny frames. Each comes from a `RawPeer` (frames built by
hand) beside one honest peer; the hub must live and the honest peer go on training.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time

import aiohttp
import msgpack
import pytest

from echo2p2p import messages as m
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig

from tests.conftest import until, wait_first
from .attackers import raw_peer
from .conftest import yes
from .harness import (HONEST, hub_alive, hub_and_honest_peer, mark, peer_id, small_cfg,
                      still_training)

BOMBS = 40  # heartbeats of ~4 MB, as in the report
BOMB_KEYS = 590_000
FLOOD_FRAMES = 12_000  # tiny valid frames: past the hub's read burst at ~4 KiB of cost each


@pytest.mark.parametrize("relay", ["gossip", "pipelined"])
async def test_transfer_report_bomb_leaves_versions_flowing(tmp_path, row, relay):
    """A 2**63-1 byte, 5e-324 s transfer report leaves the hub up and versions flowing (the
    honest peer loads new ones), its upload estimate finite; on the tracker, the honest relay
    is still in the plans of the versions after it."""
    r = row("2. transfer_report {nbytes: 2**63-1, span_s: 5e-324}"
            + ("" if relay == "gossip" else f" ({relay})"))
    async with hub_and_honest_peer(small_cfg(tmp_path, relay=relay)) as (run, honest), \
            raw_peer(run.url, keep_alive=True) as bomber:
        honest_id = peer_id(run, HONEST)
        welcome = await bomber.hello(name="bomber")
        assert welcome is not None, bomber.reaction()
        # A version published while it is connected: it is one of that version's expected peers.
        announced = await bomber.wait_frame(
            lambda f: f["t"] == "version" and f["manifest"]["version"] > welcome["version"])
        version, base = announced["manifest"]["version"], announced["manifest"]["base_version"]
        since = mark(run, honest)
        bomb = {"nbytes": 2**63 - 1, "span_s": 5e-324}
        await bomber.send("transfer_report", version=version, base_version=base, download_s=1.0,
                          bytes_from_hub=0, bytes_from_peers=0,
                          sources=[{"peer_id": honest_id, **bomb},
                                   {"peer_id": bomber.peer_id, **bomb}])
        r.honest_training = await still_training(run, honest, since)
        upload_bps = run.hub.peer_views()[honest_id].upload_bps
        planned = sorted(v for (v, _), b in run.hub.core.tracker.broadcasts.items()
                         if v > version and honest_id in b.members)
        r.reaction = (f"bomber {bomber.reaction()}; honest relay's upload estimate "
                      f"{upload_bps / 1e6:.1f} Mbit/s")
        r.hub_alive = yes(alive := await hub_alive(run))
        r.note = f"relay plans for v{planned[0]}..v{planned[-1]} after the bomb" if planned else ""
    assert alive
    assert math.isfinite(upload_bps), upload_bps
    assert planned or relay == "gossip", "no relay plan for the honest peer after the bomb"


async def test_nan_and_negative_prices_are_refused_at_hello(tmp_path, row):
    """Hellos priced NaN or -5 $/h are closed with 1002 naming price_per_hour; training goes on."""
    r = row("3. hello.price_per_hour NaN / -5 (cost-aware activation)")
    cfg = small_cfg(tmp_path)
    assert cfg.staleness.activation == "cost"
    async with hub_and_honest_peer(cfg) as (run, honest):
        since = mark(run, honest)
        refused = []
        for price in (float("nan"), -5.0):
            async with raw_peer(run.url) as bomber:
                welcome = await bomber.hello(name="bomber", engine="transformers",
                                             price_per_hour=price)
                refused.append((price, welcome, bomber.close_code, bomber.close_reason))
        # One that generates too, its price forced past the peer's own config check as a
        # modified client would: activation builds a worker from a measured peer's price.
        cheat_cfg = PeerConfig(hub_url=run.url, name="cheat", torch_threads=1)
        object.__setattr__(cheat_cfg, "price_per_hour", -5.0)
        cheat, stop = PeerClient(cheat_cfg), asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(cheat.run(stop))
            try:
                r.honest_training = await still_training(run, honest, since)
            finally:
                stop.set()
        prices = [v.account["price_per_hour"] for v in run.hub.peer_views().values()]
        meter = run.hub.statistics().cost
        r.reaction = "; ".join(f"{p}: " + ("WELCOMED" if w else f"closed {code} {why!r}")
                               for p, w, code, why in refused)
        r.reaction += f"; the generating cheat joined {cheat.statistics().connections} times"
        r.hub_alive = yes(alive := await hub_alive(run))
        r.note = f"cost meter ${meter['cost/usd_total']}"
    assert alive
    for price, welcome, code, why in refused:
        assert welcome is None, f"price {price} was welcomed"
        assert code == 1002 and "price_per_hour" in why, (price, code, why)
    assert cheat.statistics().connections == 0 and cheat.statistics().submitted == 0
    assert all(math.isfinite(p) and p >= 0 for p in prices), prices
    assert meter["cost/usd_total"] >= 0


@functools.cache
def bomb_heartbeat() -> bytes:
    """A heartbeat with 590,000 unknown keys, each 0: hex keys keep it just under 4 MiB."""
    return msgpack.packb({"p": m.BASE_PROTOCOL, "t": "heartbeat",
                          **{format(i, "x"): 0 for i in range(BOMB_KEYS)}}, use_bin_type=True)


class StatusLatency:
    """/status round trips, sampled while an attack runs: a figure for the table, never an
    assertion."""

    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/status"
        self.samples: list[float] = []

    async def sample(self, every_s: float = 0.1) -> None:
        async with aiohttp.ClientSession() as http:
            while True:
                start = time.perf_counter()
                async with http.get(self.url) as resp:
                    await resp.read()
                self.samples.append(time.perf_counter() - start)
                await asyncio.sleep(every_s)  # the sampling period, not a sync

    def worst(self) -> str:
        return f"{max(self.samples) * 1e3:.0f} ms" if self.samples else "-"


async def test_decoding_bombs_and_floods_are_bounded(tmp_path, row):
    """590,000-key heartbeats are closed as protocol errors, floods throttled; training goes on."""
    r = row("6. 40 heartbeats of 590,000 keys (~4 MB); a flood of tiny frames")
    bomb = bomb_heartbeat()
    cfg = small_cfg(tmp_path)
    assert len(bomb) <= cfg.limits.max_frame_bytes, "the bomb must reach the decoder, not the size cap"
    async with hub_and_honest_peer(cfg) as (run, honest):
        closed_before = run.hub.statistics().closed_for_protocol
        latency = StatusLatency(run.port)
        async with asyncio.TaskGroup() as tg:
            sampler = tg.create_task(latency.sample())
            async with raw_peer(run.url, keep_alive=True) as bomber:  # never silent: not a timeout
                assert await bomber.hello(name="bomber") is not None, bomber.reaction()
                since = mark(run, honest)
                sent = 0
                for _ in range(BOMBS):
                    if bomber.closed.is_set():
                        break
                    with contextlib.suppress(ConnectionError):
                        await bomber.send_bytes(bomb)
                        sent += 1
                await bomber.wait_closed(60)
                bombed = bomber.reaction()
            bomb_latency = latency.worst()
            r.honest_training = await still_training(run, honest, since)

            latency.samples.clear()
            async with raw_peer(run.url) as flooder:
                assert await flooder.hello(name="flooder") is not None, flooder.reaction()
                flooder_id = flooder.peer_id
                flood_since = mark(run, honest)
                flood = Flood(flooder)
                flooding = tg.create_task(flood.run())
                flood_training = await still_training(run, honest, flood_since)
                flood_training += "" if flooding.done() else " (the flood still going on)"
                # The read budget (echo2p2p.read_budget) throttles a flood, and the heartbeat's
                # rate (echo2p2p.frame_budget) closes it: whichever comes first.
                views = run.hub.peer_views
                await wait_first(flooding, until(run.hub, lambda: flooder_id not in views()
                                                 or views()[flooder_id].read_budget.pauses))
                budget = views()[flooder_id].read_budget if flooder_id in views() else None
                await flooder.wait_closed(60) if budget is None else None
                flooding.cancel()
                flooded = f"{flooder.reaction()} after {flood.sent} frames"
            sampler.cancel()
        closes = run.hub.statistics().closed_for_protocol - closed_before
        throttled = ("closed first" if budget is None else
                     f"read paused {budget.pauses} times ({budget.paused_s:.1f} s)")
        r.reaction = (f"bomber {bombed} after {sent} of {BOMBS} bombs sent; flooder {flooded}, "
                      f"{throttled}; closed_for_protocol +{closes}")
        r.honest_training += f"; since the flood began: {flood_training}"
        r.hub_alive = yes(alive := await hub_alive(run))
        r.note = (f"bombs of {len(bomb) / 1e6:.2f} MB; worst /status: {bomb_latency} under "
                  f"bombs, {latency.worst()} under the flood")
    assert alive
    assert bomber.close_code in (1002, 1009), f"closed by a protocol error, not {bombed}"
    assert closes >= 1
    assert (budget is not None and budget.pauses > 0) or flooder.close_code == m.CLOSE_FLOODING, \
        f"the flood was never throttled nor closed: {flooded}"


class Flood:
    """Tiny valid frames as fast as the hub takes them, yielding to the loop now and then (the
    flooder shares it with the hub); `sent` counts them."""

    def __init__(self, peer):
        self.peer = peer
        self.sent = 0

    async def run(self) -> None:
        frame = msgpack.packb({"p": m.BASE_PROTOCOL, "t": "heartbeat"})
        with contextlib.suppress(ConnectionError):
            for _ in range(FLOOD_FRAMES):
                if self.peer.closed.is_set():
                    return
                await self.peer.send_bytes(frame)
                self.sent += 1
                if self.sent % 64 == 0:
                    await asyncio.sleep(0)  # a yield, not a sync
