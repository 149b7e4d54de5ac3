"""The hub's check of a relay looks like any receiver (issue 42, item 6).

A relay that can tell the hub's check from a receiver's request serves the check at once and
everyone else as slowly as their deadline allows, so the hub, which believes no report without
its own measurement, keeps dealing it chunks. This attacker looks at everything one request
and its connection show: the ticket's peer id (`hub`), its key (the hub's own, from the
welcome), the request's headers and query against those of the receivers it knows (ids its
own relay plans named), the connection and the peer id of any request it already took for the
hub's, and the version asked (a chunk of a version older than the newest it was announced: a
check that came after a report). On the tracker (`relay="pipelined"`), where plans name relays.

What it does not use, since no identity the hub makes up can pass it: whether the requester was
ever named as a source in one of its plans (a check is a receiver that never relayed, as a leaf
is), and the source address (the hub's; on loopback every address is the same).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from echo2p2p.hub.serving.counters import PeerView
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S
from echo2p2p.overlay.serving import MAX_PROBE_BYTES, PROBE_PATH
from echo2p2p.overlay.tickets import TICKET_HEADER

from tests.conftest import serving, wait_until
from .attackers import CHUNK_IN_URL, RawPeer, raw_peer
from .conftest import yes
from .harness import (HONEST, cell_rate, hub_alive, hub_and_honest_peer, mark, peer_id,
                      run_events, small_cfg, steps_per_min, still_training)
from .test_relays import plan_in, sources

CHECKS_ON_MAIN = 2  # checks that cleared it: the hub did not see the attack


@dataclass
class DiscerningRelay:
    """A relay slow to receivers and quick to anything that gives the hub away. `fast` counts
    the requests it took for the hub's, by the first tell it found and the `wait` asked; `slow`
    the chunks it served slowly, by who asked (the ticket's peer id)."""

    peer: RawPeer  # its connection to the hub: the welcome, announcements and plans it got
    url: str = ""
    fast: Counter[str] = field(default_factory=Counter)
    slow: Counter[str] = field(default_factory=Counter)
    hub_ids: set[str] = field(default_factory=set)  # peer ids it caught checking
    hub_connections: set[Any] = field(default_factory=set)  # (host, port) of their connections
    receiver_shapes: set[tuple] = field(default_factory=set)  # as the receivers it knows ask

    def newest(self) -> int:
        return max((f["manifest"]["version"] for f in self.peer.frames if f["t"] == "version"),
                   default=-1)

    def named(self) -> set[str]:
        """Peer ids that its relay plans named as sources."""
        return {s for f in self.peer.frames if (p := plan_in(f)) is not None for s in sources(p)}

    def tell(self, request: web.Request, version: int) -> str | None:
        """What gives this request away as the hub's, if anything."""
        asker, _, rest = request.headers.get(TICKET_HEADER, "").partition(".")
        key = rest.partition(".")[0]
        connection = request.transport.get_extra_info("peername") if request.transport else None
        shape = (tuple((k, v) for k, v in request.headers.items() if k != TICKET_HEADER),
                 tuple(request.query.items()))
        hub_key = self.peer.welcome["hub_key"].hex() if self.peer.welcome else None
        if asker == "hub":
            return "peer id hub"
        if key == hub_key:
            return "the hub's key"
        if asker in self.hub_ids:
            return "a peer id seen checking"
        if connection in self.hub_connections:
            return "a connection seen checking"
        if version < self.newest():
            return "an older version"
        if asker in self.named():  # a receiver it knows: how they ask
            self.receiver_shapes.add(shape)
            return None
        if shape not in self.receiver_shapes:
            return "headers or query"
        return None


@contextlib.asynccontextmanager
async def discerning_relay(lookup: Callable[..., Any], stall_s: float, peer: RawPeer
                           ) -> AsyncIterator[DiscerningRelay]:
    """A `DiscerningRelay` holding every chunk (`lookup`: the hub's own bytes) against receivers
    whose `relay_stall_s` is `stall_s`: to them, headers at 0.9 x `stall_s` and the second half
    of the body half-way through what is left of their deadline, as tests/hostile/
    test_slow_relay.py's; the hub's uplink probe (/probe, the hub's alone) is answered at once."""
    relay = DiscerningRelay(peer)

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == PROBE_PATH:  # only the hub's ticket may open it: quick, and a lie
            nbytes = min(int(request.query.get("bytes", "0")), MAX_PROBE_BYTES)
            return web.Response(body=bytes(nbytes), content_type="application/octet-stream")
        found = CHUNK_IN_URL.search(request.path)
        if found is None:
            return web.Response(status=404)
        version, base, index = found.groups()
        data = await lookup(int(version), None if base == "full" else int(base), int(index), 0.0)
        if not data:
            return web.Response(status=404)
        if (tell := relay.tell(request, int(version))) is not None:
            relay.fast[f"{tell} (wait={request.query.get('wait')})"] += 1
            relay.hub_ids.add(request.headers.get(TICKET_HEADER, "").partition(".")[0])
            relay.hub_connections.add(request.transport.get_extra_info("peername"))
            return web.Response(body=data, content_type="application/octet-stream")
        deadline_s = stall_s / 2 + stall_s + len(data) / MIN_RATE_BYTES_S
        header_s = 0.9 * stall_s
        gap_s = min(0.9 * stall_s, (deadline_s - header_s) / 2)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = len(data)
        with contextlib.suppress(ConnectionError):
            await asyncio.sleep(header_s)  # the attack itself (a pace), not a synchronisation
            await resp.prepare(request)
            await resp.write(data[:len(data) // 2])
            await asyncio.sleep(gap_s)
            await resp.write(data[len(data) // 2:])
            await resp.write_eof()
            relay.slow[request.headers.get(TICKET_HEADER, "").partition(".")[0]] += 1
        return resp

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    async with serving(app) as port:
        relay.url = f"http://127.0.0.1:{port}"
        yield relay


async def test_a_relay_cannot_tell_the_hubs_check_from_a_receiver(tmp_path, row):
    """A relay that serves whatever looks like the hub at once and every receiver slowly is
    timed by the hub under an identity of a receiver's, found slow, and dealt no more chunks;
    the honest peer keeps training."""
    r = row("42-6. the hub's check: a relay slow to receivers, quick to whatever looks like "
            "the hub (peer id, key, headers, query, connection, an older version)")
    cfg = small_cfg(tmp_path, relay="pipelined", anchor_every=1)  # one broadcast per version
    async with hub_and_honest_peer(cfg) as (run, honest), \
            raw_peer(run.url, keep_alive=True) as attacker, \
            discerning_relay(run.hub.chunk_lookup, honest.cfg.relay_stall_s, attacker) as relay:
        honest_id = peer_id(run, HONEST)
        without = await steps_per_min(run)
        assert await attacker.hello(name="discerning-relay", listen_addr=relay.url) is not None

        def conn() -> PeerView:  # the hub's view of the attacker now
            return run.hub.peer_views()[attacker.peer_id]

        def checks() -> list[tuple[str, str]]:
            return [(e["reason"], e["verdict"]) for e in run_events(run, "relay_check")
                    if e["accused"] == attacker.peer_id]

        await wait_until(lambda: conn().relay != "unprobed", 60)
        assert conn().relay == "ok", f"the relay was not admitted as one: {conn().relay}"
        since = mark(run, honest)
        await wait_until(lambda: relay.slow.get(honest_id), 120)  # the attack is under way
        with_ = await steps_per_min(run)
        r.steps_per_min = cell_rate(without, with_)
        await wait_until(lambda: conn().relay != "ok" or len(checks()) >= CHECKS_ON_MAIN, 180)
        last = conn()  # as the hub saw it when the verdict was in (or the checks cleared it)
        r.reaction = (f"hub's checks (reason, verdict) {checks()}; status {last.relay}; "
                      f"requests it took for the hub's {dict(relay.fast)}; slow chunks served "
                      f"{dict(relay.slow)}")
        if last.relay != "ok":
            judged_at, loaded = len(attacker.frames), honest.statistics().versions_loaded
            r.honest_training = await still_training(run, honest, since)
            # Once a version wholly fetched after the verdict is in, the rate without its share.
            await wait_until(lambda: honest.statistics().versions_loaded >= loaded + 2, 120)
            r.note = f"after the verdict: {await steps_per_min(run):.1f} steps/min"
            later = await attacker.wait_frame(lambda f: f["t"] == "version", since=judged_at)
            dealt_after = attacker.peer_id in sources(plan_in(later))
            r.reaction += f"; in the next version's plan: {'YES' if dealt_after else 'no'}"
        r.hub_alive = yes(alive := await hub_alive(run))
    assert alive
    assert last.relay == "slow" and ("slow", "slow") in checks(), r.reaction
    assert not dealt_after, "the slow relay still owns chunks of a version after the verdict"
    # The hub's reachability probe at its join (a chunk with no wait, under the hub's ticket)
    # may give itself away, and nothing else: no check.
    assert all(tell.endswith("(wait=0)") for tell in relay.fast), dict(relay.fast)
