"""Attacks on the overlay (issue 11, items 4 and 5): false accusations of an honest relay, a
relay address that never answers, and one whose path and query harvest the tickets of the peers
that fetch from it. The hub believes no report without its own evidence and deals chunks only to
relays it reached itself; peers build chunk URLs from scheme, host and port only; a ticket seen
by one server opens no other. On the tracker (`relay="pipelined"`), whose plans name relays;
gossip's liars are tests/hostile/test_gossip_liars.py.
"""

from __future__ import annotations

import contextlib
import struct

import aiohttp

from echo2p2p.overlay.serving import PROBE_PATH
from echo2p2p.overlay.tickets import TICKET_HEADER

from tests.conftest import until, wait_until
from .attackers import Request, dead_relay, raw_peer, recording_relay, sharing
from .peer_attacks import plan_in, sources
from .conftest import yes
from .harness import (HONEST, hub_alive, hub_and_honest_peer, mark, peer_id, small_cfg,
                      still_training, steps, until_finished_or)

ACCUSERS = 3  # the report's number: 3 x bad_chunk 0.2 took an honest peer below 0.5
RUN_STEPS = 40  # max_steps of the relay runs: they must get there, not only start


def owner_of_first_chunk(plan: dict) -> str | None:
    (first,) = struct.unpack_from("<I", plan["owners"])
    return None if first == 0xFFFFFFFF else plan["sources"][first]["peer_id"]


async def test_false_accusations_do_not_quarantine_an_honest_relay(tmp_path, row):
    """Three false 'corrupt' reports cost the accusers, not the honest relay: it keeps working."""
    r = row(f"4. {ACCUSERS} connections report the honest relay 'corrupt'")
    # Every version in full, so that the accusers (leaves) share its broadcast with the honest
    # relay and learn its id from the plan's sources, as an attacker would.
    cfg = small_cfg(tmp_path, relay="pipelined", anchor_every=1, publish_every=3)
    async with hub_and_honest_peer(cfg) as (run, honest), contextlib.AsyncExitStack() as stack:
        honest_id = peer_id(run, HONEST)
        honest_identity = run.hub.peer_views()[honest_id].identity
        accusers = [await stack.enter_async_context(raw_peer(run.url, keep_alive=True))
                    for _ in range(ACCUSERS)]
        since = mark(run, honest)
        for i, accuser in enumerate(accusers):
            assert await accuser.hello(name=f"accuser-{i}") is not None, accuser.reaction()
            plan = plan_in(await accuser.wait_frame(
                lambda f: (p := plan_in(f)) is not None and owner_of_first_chunk(p) == honest_id))
            await accuser.send("relay_report", version=plan["version"],
                               base_version=plan["base_version"], peer_id=honest_id,
                               reason="corrupt", index=0)
        def judged() -> bool:
            trust = run.hub.statistics()
            return honest_identity in trust.quarantined or all(
                trust.trust_events.get(a.peer_id, {}).get("false_report", 0) for a in accusers)

        await until(run.hub, judged)
        trust = run.hub.statistics()
        if honest_identity in trust.quarantined:
            r.reaction = f"honest relay QUARANTINED: {trust.trust_events[honest_identity]}"
            raise AssertionError(r.reaction)
        r.honest_training = await still_training(run, honest, since)
        # Still a relay: a plan made after the verdicts routes chunks through it.
        later = len(accusers[0].frames)
        relays_on = await accusers[0].wait_frame(
            lambda f: (p := plan_in(f)) is not None and honest_id in sources(p), since=later,
            allow_close=True)
        trust = run.hub.statistics()
        false_reports = [trust.trust_events.get(a.peer_id, {}).get("false_report", 0)
                         for a in accusers]
        r.reaction = (f"accusers: false_report {false_reports}, "
                      f"{sum(a.peer_id in trust.quarantined for a in accusers)} quarantined; "
                      f"honest: not quarantined (score {trust.trust_scores.get(honest_identity, 1.0):.2f}), "
                      + ("still a relay" if relays_on else "NO LONGER A RELAY"))
        r.hub_alive = yes(alive := await hub_alive(run))
    assert alive
    assert honest_identity not in trust.quarantined, trust.trust_events.get(honest_identity)
    assert all(false_reports), false_reports
    assert relays_on is not None, "the honest peer was dropped as a relay"


def ticket(request: Request) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == TICKET_HEADER.lower()), "")


def stalls_about(run, attacker_id: str) -> int:
    """Relay reports the hub received about `attacker_id` ("stall", "unreachable")."""
    return sum(n for (peer, _), n in run.hub.statistics().relay_reports_by.items() if peer == attacker_id)


async def test_dead_relay_is_never_dealt_chunks(tmp_path, row):
    """A relay that accepts and never answers is never dealt chunks; the run ends unstalled."""
    r = row("5a. listen_addr that accepts and never answers")
    cfg = small_cfg(tmp_path, relay="pipelined", max_steps=RUN_STEPS)
    async with dead_relay() as dead, hub_and_honest_peer(cfg) as (run, honest), \
            raw_peer(run.url, keep_alive=True) as attacker:
        honest_id = peer_id(run, HONEST)
        assert await attacker.hello(name="dead-relay", listen_addr=dead.url) is not None
        since = mark(run, honest)
        await until_finished_or(run, lambda: stalls_about(run, attacker.peer_id), 240)
        dealt = [f["version"] for f in attacker.frames
                 if (p := plan_in(f)) is not None and attacker.peer_id in sources(p)]
        asked_by_honest = [q for q in dead.requests if ticket(q).startswith(f"{honest_id}.")]
        probes = len(dead.requests) - len(asked_by_honest)
        r.reaction = (f"an owner in {len(dealt)} relay plans; {probes} requests from the hub "
                      f"(probes), {len(asked_by_honest)} from the honest peer; "
                      f"{stalls_about(run, attacker.peer_id)} stall reports")
        r.honest_training = (f"reached max_steps: {steps(run) - since.steps} steps after it joined"
                             if run.finished.is_set() else "NO")
        r.hub_alive = yes(alive := await hub_alive(run))
    assert alive
    assert not dealt, f"the dead relay owned chunks of v{dealt}"
    assert not asked_by_honest and not stalls_about(run, attacker.peer_id)
    assert run.finished.is_set() and steps(run) == RUN_STEPS


async def test_relay_urls_use_host_and_port_and_tickets_do_not_replay(tmp_path, row):
    """Relays are asked at host:port/chunk/... only; the tickets they see open no other server."""
    r = row("5b. listen_addr http://HOST:PORT/anything?x= ; a relay's tickets replayed")
    cfg = small_cfg(tmp_path, relay="pipelined", max_steps=RUN_STEPS)
    async with hub_and_honest_peer(cfg) as (run, honest), \
            recording_relay(run.hub.chunk_lookup) as odd_relay, \
            recording_relay(run.hub.chunk_lookup) as relay, \
            raw_peer(run.url, keep_alive=True) as odd, \
            raw_peer(run.url, keep_alive=True) as harvester, contextlib.AsyncExitStack() as stack:
        honest_id = peer_id(run, HONEST)
        odd_welcome = await odd.hello(name="path-and-query",
                                      listen_addr=odd_relay.url + "/anything?x=")
        # And one whose URL is plain, to be dealt chunks whatever the hub makes of the other
        # (it fetches them from the hub, as a relay must to keep a share).
        assert await harvester.hello(name="harvester", listen_addr=relay.url) is not None
        await stack.enter_async_context(sharing(harvester, run.url))
        since = mark(run, honest)

        def harvested() -> list[Request]:
            return [q for q in relay.requests + odd_relay.requests
                    if ticket(q).startswith(f"{honest_id}.")]

        await wait_until(lambda: run.finished.is_set() or harvested(), 240)
        attackers = [a.peer_id for a in (odd, harvester) if a.welcome is not None]
        await until_finished_or(run, lambda: any(stalls_about(run, a) for a in attackers), 240)
        from_honest = harvested()
        chosen = sorted({f"{q.path}?{q.query}" for q in odd_relay.requests + relay.requests
                         if not _our_route(q)})
        replays = []
        async with aiohttp.ClientSession() as http:
            for value in sorted({ticket(q) for q in from_honest})[:3]:
                for server in (f"http://127.0.0.1:{run.port}", honest.served_url):
                    async with http.get(server + "/chunk/0/full/0",
                                        headers={TICKET_HEADER: value}) as resp:
                        replays.append(resp.status)
        r.reaction = (f"path-and-query relay: {'welcomed' if odd_welcome else odd.reaction()}, "
                      f"{len(odd_relay.requests)} requests to it; {len(from_honest)} honest "
                      f"requests to the relays, {len(chosen)} to a path or query they chose"
                      f"{' ' + chosen[0] if chosen else ''}; harvested tickets replayed to the "
                      f"hub and the honest relay: {replays}")
        r.honest_training = (f"reached max_steps: {steps(run) - since.steps} steps after they "
                             f"joined" if run.finished.is_set() else "NO")
        r.hub_alive = yes(alive := await hub_alive(run))
        stalled = {a: stalls_about(run, a) for a in attackers}
    assert alive
    assert not chosen, f"requests to a path or query the attacker chose: {chosen[:3]}"
    assert odd_welcome is not None or (odd.close_code == 1002
                                       and "listen_addr" in odd.close_reason), odd.reaction()
    assert from_honest, "the honest peer never fetched from the relay: no ticket to replay"
    assert replays and all(status == 403 for status in replays), replays
    assert not any(stalled.values()), stalled
    assert run.finished.is_set() and steps(run) == RUN_STEPS


def _keys(query: str) -> list[str]:
    return [part.partition("=")[0] for part in query.split("&") if part]


def _our_route(q: Request) -> bool:
    """A request the protocol builds itself: a chunk (query `wait` at most) or the hub's uplink
    probe (query `bytes` only), never a path or query from the advertised URL."""
    if q.path.startswith("/chunk/"):
        return not set(_keys(q.query)) - {"wait"}
    return q.path == PROBE_PATH and set(_keys(q.query)) == {"bytes"}
