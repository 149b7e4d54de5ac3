"""Joining as an attack (issue 28, items 7 and 10): one address reconnecting as fast as it can,
a new peer key each time and some hellos claiming catch-up bases; and /status on the hub's own
port, asked without the dashboard token.

Churn: two `RawPeer` loops beside one honest peer say hello, and leave, as fast as the hub lets
them. A welcomed fresh key reports the newest version whole (a claim nothing checks), so that a
later hello with the same key, once a newer version is out, makes the hub catch it up by a
delta from that base. The hub must hold the joins to its limits (`echo2p2p.join_limits`),
refusing the rest with HTTP 429 before the websocket upgrade (issue 42, item 4), and encode
catch-up deltas at most `catch_up_builds` at once, while the honest peer goes on training.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field

import aiohttp

from echo2p2p.hub.core.catchups import MAX_ENTRIES

from .attackers import raw_peer
from .conftest import yes
from .harness import (cell_rate, hub_alive, hub_and_honest_peer, mark, peer_id, small_cfg,
                      steps_per_min, still_training)

MAX_HELLOS = 20_000  # the attack's bound; the measurements below end it first
LOOPS = 2  # attacker loops at once, on the one address
MEASURED_STEPS = 30  # learner steps timed without, then with, the attacker (~10 s here)


@dataclass
class Churn:
    """What the attacker saw."""

    hellos: int = 0
    welcomed: int = 0
    claims: int = 0  # welcomed hellos with a key that had reported a version whole
    refusals: collections.Counter[tuple[int | None, str]] = field(
        default_factory=collections.Counter)
    sent_more: int = 0  # refused hellos the hub sent anything but its goodbye: must stay 0
    newest: int = -1  # the newest version a welcome named
    planted: collections.deque[tuple[bytes, int]] = field(default_factory=collections.deque)


async def churn(url: str, seen: Churn, stop: asyncio.Event) -> None:
    """Hello, then leave, until `stop` (or MAX_HELLOS): every other hello reuses a key that
    reported an older version whole, when there is one, so the hub may build a catch-up."""
    while not stop.is_set() and seen.hellos < MAX_HELLOS:
        claim = None
        if seen.hellos % 2 and seen.planted and seen.planted[0][1] < seen.newest:
            claim = seen.planted.popleft()
        seen.hellos += 1
        try:
            welcomed = await join_once(url, seen, claim)
        except aiohttp.WSServerHandshakeError as exc:  # turned away before the upgrade
            seen.refusals[(exc.status, "")] += 1
            welcomed = False
        if not welcomed and claim is not None:
            seen.planted.appendleft(claim)  # refused at the address: try it again


async def join_once(url: str, seen: Churn, claim: tuple[bytes, int] | None) -> bool:
    """One hello (with `claim`'s key, if any) and leave; whether it was welcomed."""
    async with raw_peer(url) as attacker:
        if claim is not None:
            attacker.key = claim[0]
        welcome = await attacker.hello(name="churn")
        if welcome is None:
            seen.refusals[(attacker.close_code, attacker.close_reason)] += 1
            seen.sent_more += [f["t"] for f in attacker.frames] != ["goodbye"]
            return False
        seen.welcomed += 1
        seen.newest = max(seen.newest, welcome["version"])
        if claim is not None:
            seen.claims += 1
        else:  # "I hold it whole": the hub remembers it for this key's next connection
            await attacker.send("transfer_report", version=welcome["version"],
                                base_version=None, download_s=1.0, bytes_from_hub=0,
                                bytes_from_peers=0, sources=[])
            seen.planted.append((attacker.key, welcome["version"]))
        return True


async def test_reconnect_churn_is_held_to_the_join_limits(tmp_path, row):
    """Joins from one address beyond its burst and rate are answered 429 before the websocket
    upgrade, never welcomed; catch-up encodes stay within their bound; the honest peer trains."""
    r = row("R3-7. reconnect churn: one address, new key per hello, claimed catch-up bases")
    cfg = small_cfg(tmp_path)
    async with hub_and_honest_peer(cfg) as (run, honest):
        hub = run.hub
        without = await steps_per_min(run, MEASURED_STEPS)
        since, first_version = mark(run, honest), hub.statistics().newest_version
        seen, stop = Churn(), asyncio.Event()
        start = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            for _ in range(LOOPS):
                tg.create_task(churn(run.url, seen, stop))
            try:
                with_ = await steps_per_min(run, MEASURED_STEPS)
                r.honest_training = await still_training(run, honest, since)
            finally:
                stop.set()
        elapsed_s = time.monotonic() - start
        stats = hub.statistics()
        versions = hub.statistics().newest_version - first_version
        r.hub_alive = yes(alive := await hub_alive(run))
        honest_still_there = peer_id(run, "test-0") in hub.peer_views()
    r.steps_per_min = cell_rate(without, with_)
    limit = cfg.limits.join_burst + cfg.limits.joins_per_min / 60 * elapsed_s + 1  # +1: the honest peer's
    r.reaction = (f"{seen.hellos} hellos in {elapsed_s:.0f} s: {seen.welcomed} welcomed "
                  f"({seen.claims} claiming a base), refused "
                  + "; ".join(f"{n} x {code} {why!r}" for (code, why), n in seen.refusals.items())
                  + f"; hub counted joins_too_often={stats.joins_too_often}, catch-up builds "
                  f"{stats.catch_up_builds}, shared {stats.catch_up_shared}")
    r.note = (f"{seen.hellos / elapsed_s:.0f} hellos/s from the hub's own process; limit "
              f"{cfg.limits.join_burst} at once + {cfg.limits.joins_per_min:.0f}/min; {versions} versions "
              f"published meanwhile")
    assert alive and honest_still_there
    assert set(seen.refusals) == {(429, "")}, seen.refusals  # the reason is the 429's body
    assert seen.sent_more == 0  # no welcome, no version announced: refused before any work
    assert seen.welcomed <= limit, (seen.welcomed, limit)
    assert stats.joins_too_often >= sum(seen.refusals.values())
    assert stats.catch_up_builds <= min(seen.claims, MAX_ENTRIES * (versions + 1))


PUBLIC = {"run_id", "step", "hub_key", "published_version", "max_lag", "kappa", "public"}


async def test_status_on_the_hubs_port_shows_no_peer_without_the_token(tmp_path, row):
    """With a dashboard token set, /status on the peers' port without it names no peer, relay
    address, trust or lease, however often it is asked; with the token, it names them all."""
    r = row("R3-10. GET /status on the hub's port without the dashboard token")
    cfg = small_cfg(tmp_path, dashboard_token="peek")
    async with hub_and_honest_peer(cfg) as (run, honest), \
            raw_peer(run.url, keep_alive=True) as spy:
        assert await spy.hello(name="spy-relay", listen_addr="http://127.0.0.1:9") is not None
        url = f"http://127.0.0.1:{run.port}/status"
        secrets = ["test-0", "spy-relay", "127.0.0.1:9",
                   run.hub.peer_views()[peer_id(run, "test-0")].server_url, '"trust"', "rollout/leases"]
        without = await steps_per_min(run, MEASURED_STEPS)
        since, answers, stop = mark(run, honest), [], asyncio.Event()
        start = time.monotonic()

        async def ask() -> None:  # as often as it answers, for the whole measurement
            async with aiohttp.ClientSession() as http:
                while not stop.is_set():
                    async with http.get(url) as resp:
                        answers.append((resp.status, await resp.text()))

        async with asyncio.TaskGroup() as tg:
            tg.create_task(ask())
            try:
                with_ = await steps_per_min(run, MEASURED_STEPS)
                r.honest_training = await still_training(run, honest, since)
            finally:
                stop.set()
        elapsed_s = time.monotonic() - start
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer peek"}) as http, \
                http.get(url) as resp:
            with_token = await resp.text()
        leases = [lease for rec in run.records for lease in rec.get("rollout/leases", [])]
        r.hub_alive = yes(alive := await hub_alive(run))
    r.steps_per_min = cell_rate(without, with_)
    secrets += [f'"{lease}"' for lease in leases[-50:]]  # "L12": as JSON quotes a lease id
    leaked = sorted({s for _, body in answers for s in secrets if s and s in body})
    keys = sorted({k for _, body in answers for k in json.loads(body)})
    named = sorted(p["name"] for p in json.loads(with_token).get("peers", {}).values())
    r.reaction = (f"{len(answers)} answers {sorted({code for code, _ in answers})} with keys "
                  f"{keys}; leaked {leaked or 'nothing'}; with the token it names {named}")
    r.note = f"{len(answers) / elapsed_s:.0f} requests/s from the hub's own process"
    assert alive and answers
    assert all(code == 200 for code, _ in answers)
    assert not leaked, leaked
    assert set(keys) <= PUBLIC, keys
    assert named == ["spy-relay", "test-0"]
