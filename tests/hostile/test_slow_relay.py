"""A slow relay (issue 28, item 5): a chunk server that answers the hub's probes at once but
serves every chunk a receiver asks for just inside the download deadline (headers late, the body
in two halves), so no request ever stalls. The receiver times each chunk against the rate the
plan gave it (`echo2p2p.pace`), takes the rest from the hub and reports the relay "slow"; the
hub times the chunk from the relay itself and, on its own measurement, re-deals its share. On
the tracker (`relay="pipelined"`): gossip has no plan rates and no re-deals.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from echo2p2p.hub.serving.counters import PeerView
from echo2p2p.overlay.serving import MAX_PROBE_BYTES, PROBE_PATH

from tests.conftest import peer_until, serving, until, wait_until
from .attacks import Counts
from .attackers import CHUNK_IN_URL, raw_peer, sharing
from .conftest import yes
from .harness import (HONEST, cell_rate, family, hub_alive, hub_and_honest_peer, mark, peer_id,
                      run_events, small_cfg, steps_per_min, still_training)
from .peer_attacks import plan_in, slowly, sources
from .test_relays import ACCUSERS, owner_of_first_chunk


@dataclass
class SlowRelay:
    """A relay that holds every chunk (the hub's own bytes) and serves it as slowly as a
    receiver's deadline allows; a request with `wait=0` (the hub's reachability probe) and
    GET /probe (the hub's uplink probe) are answered at once. `slow` counts the chunks it
    served slowly, by who asked (the ticket's peer id)."""

    url: str = ""
    served: Counts = field(default_factory=collections.Counter)

    @property
    def slow(self) -> dict[str, int]:
        return family(self.served, "slow")


@contextlib.asynccontextmanager
async def slow_relay(lookup: Callable[..., Any], stall_s: float) -> AsyncIterator[SlowRelay]:
    """A slow relay against receivers whose `relay_stall_s` is `stall_s`: a request of theirs
    may be silent for `stall_s` and last `stall_s / 2 + stall_s + bytes / MIN_RATE_BYTES_S`
    (echo2p2p.overlay.download), so headers come at 0.9 x `stall_s` and the second half of the
    body half-way through what is left."""
    relay = SlowRelay()
    held: dict[tuple[str, str, str], bytes | None] = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == PROBE_PATH:
            nbytes = min(int(request.query.get("bytes", "0")), MAX_PROBE_BYTES)
            return web.Response(body=bytes(nbytes), content_type="application/octet-stream")
        found = CHUNK_IN_URL.search(request.path)
        if found is None:
            return web.Response(status=404)
        key = found.groups()  # (version, base, index); kept, as a relay keeps what it got
        if key not in held:
            version, base, index = key
            held[key] = await lookup(int(version), None if base == "full" else int(base),
                                     int(index), 0.0)
        data = held[key]
        if not data:
            return web.Response(status=404)
        if request.query.get("wait") in ("0", "0.0"):  # the hub's reachability probe: be quick
            return web.Response(body=data, content_type="application/octet-stream")
        return await slowly(request, data, stall_s, relay.served)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    async with serving(app) as port:
        relay.url = f"http://127.0.0.1:{port}"
        yield relay


async def test_slow_relay_loses_its_share(tmp_path, row):
    """A relay serving every chunk just inside the deadline is reported, timed by the hub
    itself, and dealt no more chunks; its estimate falls; the honest peer keeps training."""
    r = row("R3-5. slow relay: chunks just inside the download deadline, probes answered fast")
    # Every version in full: one broadcast for both.
    cfg = small_cfg(tmp_path, relay="pipelined", anchor_every=1)
    async with hub_and_honest_peer(cfg) as (run, honest), \
            slow_relay(run.hub.chunk_lookup, honest.cfg.relay_stall_s) as relay, \
            raw_peer(run.url, keep_alive=True) as attacker, contextlib.AsyncExitStack() as stack:
        honest_id = peer_id(run, HONEST)
        without = await steps_per_min(run)
        assert await attacker.hello(name="slow-relay", listen_addr=relay.url) is not None
        await stack.enter_async_context(sharing(attacker, run.url))  # keeps its share dealt

        def conn() -> PeerView:  # the hub's view of the attacker now
            return run.hub.peer_views()[attacker.peer_id]

        await until(run.hub, lambda: conn().relay != "unprobed", 60)
        probed_mbps = conn().upload_bps / 1e6
        assert conn().relay == "ok", f"the slow relay was not admitted as one: {conn().relay}"
        since = mark(run, honest)
        await wait_until(lambda: relay.slow.get(honest_id), 120)  # the attack is under way
        r.steps_per_min = cell_rate(without, with_ := await steps_per_min(run))
        r.reaction = f"NO VERDICT: status {conn().relay}, estimate {probed_mbps:.0f} Mbit/s"
        await until(run.hub, lambda: conn().relay != "ok", 120)
        judged_at, loaded = len(attacker.frames), honest.statistics().versions_loaded
        r.honest_training = await still_training(run, honest, since)
        # Once a version wholly fetched after the verdict is in (one under way may still wait
        # on the relay's chunks it asked for before), the rate without its share.
        await peer_until(honest, lambda: honest.statistics().versions_loaded >= loaded + 2, 120)
        r.note = f"after the verdict: {await steps_per_min(run):.1f} steps/min"
        # Every plan made after the verdict routes around it: the next version's first plan.
        later = await attacker.wait_frame(lambda f: f["t"] == "version", since=judged_at)
        checks = [(e["reason"], e["verdict"]) for e in run_events(run, "relay_check")
                  if e["accused"] == attacker.peer_id]
        reports = {reason: n for (peer, reason), n in run.hub.statistics().relay_reports_by.items()
                   if peer == attacker.peer_id}
        r.reaction = (f"relay reports {reports}; hub's checks (reason, verdict) {checks}; "
                      f"status {conn().relay}; estimate {probed_mbps:.0f} -> "
                      f"{conn().upload_bps / 1e6:.2f} Mbit/s; in the next version's plan: "
                      f"{'YES' if attacker.peer_id in sources(plan_in(later)) else 'no'}; "
                      f"slow chunks served {dict(relay.slow)}")
        last = conn()  # as the hub saw it when the verdict was in
        r.hub_alive = yes(alive := await hub_alive(run))
    assert alive
    assert last.relay == "slow" and ("slow", "slow") in checks, checks
    assert reports.get("slow"), reports
    assert last.upload_bps / 1e6 < probed_mbps / 10
    assert attacker.peer_id not in sources(plan_in(later))


async def test_false_slow_reports_cost_an_honest_relay_nothing(tmp_path, row):
    """Three connections report the honest relay "slow": the hub times it itself, finds it
    fast, and it stays a relay."""
    r = row(f"R3-5b. {ACCUSERS} connections report the honest relay 'slow'")
    # As test_relays' accusers.
    cfg = small_cfg(tmp_path, relay="pipelined", anchor_every=1, publish_every=3)
    async with hub_and_honest_peer(cfg) as (run, honest), contextlib.AsyncExitStack() as stack:
        honest_id = peer_id(run, HONEST)

        def honest_conn() -> PeerView:  # the hub's view of the honest relay now
            return run.hub.peer_views()[honest_id]

        accusers = [await stack.enter_async_context(raw_peer(run.url, keep_alive=True))
                    for _ in range(ACCUSERS)]
        since = mark(run, honest)
        without = await steps_per_min(run)
        for i, accuser in enumerate(accusers):
            assert await accuser.hello(name=f"slow-accuser-{i}") is not None, accuser.reaction()
            plan = plan_in(await accuser.wait_frame(
                lambda f: (p := plan_in(f)) is not None and owner_of_first_chunk(p) == honest_id))
            await accuser.send("relay_report", version=plan["version"],
                               base_version=plan["base_version"], peer_id=honest_id,
                               reason="slow", index=0)

        def checks() -> list[str]:
            return [e["verdict"] for e in run_events(run, "relay_check")
                    if e["accused"] == honest_id and e["reason"] == "slow"]

        with_ = await steps_per_min(run)
        await until(run.hub, lambda: len(checks()) == ACCUSERS or honest_conn().relay != "ok", 120)
        r.honest_training = await still_training(run, honest, since)
        later = len(accusers[0].frames)
        relays_on = await accusers[0].wait_frame(
            lambda f: (p := plan_in(f)) is not None and honest_id in sources(p), since=later,
            allow_close=True)
        r.steps_per_min = cell_rate(without, with_)
        r.reaction = (f"hub's checks of the honest relay: {checks()}; its status "
                      f"{honest_conn().relay}, estimate {honest_conn().upload_bps / 1e6:.0f} Mbit/s; "
                      + ("still a relay" if relays_on else "NO LONGER A RELAY")
                      + f"; accusers {[a.reaction() for a in accusers]}")
        last = honest_conn()
        r.hub_alive = yes(alive := await hub_alive(run))
    assert alive
    assert last.relay == "ok" and "slow" not in checks(), (last.relay, checks())
    assert relays_on is not None, "the honest peer was dropped as a relay"
