"""Attackers that run in a process of their own: `python -m tests.hostile.attacks KIND PARAMS`.

Issue 42's attacks are measured as rates (learner steps a minute with and without the attacker):
an attacker on the hub's own event loop would slow the hub by its own CPU, not by what the hub
does about it, so each runs here, on its own loop and interpreter. `harness.attacker_process`
starts one and reads what it prints: a JSON line of its counts every REPORT_S (and one as it
stops on SIGTERM). Every connection is made from the source address the attack names (127.N.0.1
for N = 1..128: distinct /24 networks on loopback), so address and neighbourhood limits see
what they would see of as many hosts.

Kinds (PARAMS is a JSON object; keys below, with defaults):
- idle: `connections` (1) peers that say hello and heartbeat and do nothing else; `engine`
  ("transformers"); `serve` (false): also advertise a chunk server that answers every request
  at once with 503 (alive, holding nothing) and never fetches a chunk.
- leaf: a peer written from the protocol docs without the optional parts: no chunk server,
  no gossip links; it fetches every chunk of each version announced to it from the hub's chunk
  route (with its ticket, 2 requests at a time, the newest announcement first) and reports
  each transfer; `engine` ("relay"). Counts: `versions`, `chunks`, `seeds_dealt` (chunk indices
  the announcements and re-deals named as its seeds).
- hoard: `sources` (8) connections, one per address, each asking for `n` (4096) leases and
  never answering one.
- flood: one connection sending frames of kind `frame` (version_held, relay_report, heartbeat,
  transfer_report, lease_request) as fast as the socket takes them, and once closed, a new one
  with a fresh key, as often as the hub lets it join; `accuse` names the peer id a
  relay_report accuses, `version` the version the frames name (0).
- http: `connections` (16) clients asking GET `target` (a full URL, or a list of them that
  each client asks in turn) as fast as answered; counts by status.
- churn: hello-then-leave from `sources` (32) addresses at once, each with `keys` (16) peer
  keys of its own, round robin, each asking again as soon as it is answered.
- discerning, rollouts: peers that do a peer's work on their own terms (tests/hostile/
  peer_attacks.py): a relay that serves the hub's checks at once and receivers slowly, and
  rollouts of chosen completions, one after the hub answered the last.

An attack that takes a `stop` event ends itself once SIGTERM sets it (within GRACE_S), as the
rollouts kind does after its last rollout is answered; the others are cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import Credentials

REPORT_S = 0.5
GRACE_S = 20.0  # an attack that ends itself on SIGTERM has this long (the harness waits 30 s)
Counts = collections.Counter


def source(n: int) -> str:
    """The n-th attacker address (n >= 1): one per /24 network, 127.n.0.1 (n <= 255)."""
    if not 1 <= n <= 255:
        raise ValueError(f"source {n} is outside 127.1.0.1 .. 127.255.0.1")
    return f"127.{n}.0.1"


def frame(t: str, **fields: Any) -> bytes:
    return msgpack.packb({"p": m.BASE_PROTOCOL, "t": t, **fields}, use_bin_type=True)


def hello(name: str, key: bytes, **fields: Any) -> bytes:
    return frame("hello", **{"name": name, "engine": "transformers", "device": "cpu",
                             "price_per_hour": 0.0, "listen_addr": None, "token": "",
                             "nonce": signing.new_private_key(),
                             "peer_key": signing.public_key(key), **fields})


def session(address: str) -> aiohttp.ClientSession:
    """An HTTP client whose connections leave from `address`."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0),
                                                                limit=0))


async def welcomed(http: aiohttp.ClientSession, url: str, counts: Counts, name: str,
                   key: bytes | None = None, **fields: Any
                   ) -> tuple[aiohttp.ClientWebSocketResponse, dict[str, Any]] | None:
    """A websocket to the hub that said hello, and its welcome; None if refused (counted by why)."""
    try:
        ws = await http.ws_connect(url, max_msg_size=0, compress=0)
    except aiohttp.WSServerHandshakeError as exc:
        counts[f"refused_http_{exc.status}"] += 1
        return None
    except (aiohttp.ClientError, OSError):
        counts["connect_failed"] += 1
        return None
    await ws.send_bytes(hello(name, key or signing.new_private_key(), **fields))
    msg = await ws.receive()
    if msg.type is aiohttp.WSMsgType.BINARY:
        welcome = msgpack.unpackb(msg.data)
        if welcome.get("t") == "welcome":
            counts["welcomed"] += 1
            return ws, welcome
    counts[f"refused_{ws.close_code}"] += 1
    await ws.close()
    return None


async def joined(http: aiohttp.ClientSession, url: str, counts: Counts, name: str,
                 key: bytes | None = None, **fields: Any) -> aiohttp.ClientWebSocketResponse | None:
    """A websocket to the hub that said hello and got its welcome, else None (counted by why)."""
    got = await welcomed(http, url, counts, name, key, **fields)
    return got[0] if got is not None else None


async def drain(ws: aiohttp.ClientWebSocketResponse, counts: Counts) -> None:
    """Read (and drop) what the hub sends until it closes; count the close."""
    async for msg in ws:
        if msg.type is aiohttp.WSMsgType.BINARY:
            counts["frames_in"] += 1
    counts[f"closed_{ws.close_code}"] += 1


async def heartbeats(ws: aiohttp.ClientWebSocketResponse) -> None:
    while not ws.closed:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_bytes(frame("heartbeat"))
        await asyncio.sleep(2.0)  # a timer, not a synchronisation


@contextlib.asynccontextmanager
async def listening(handle: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> AsyncIterator[str]:
    """An HTTP server on source(1), port 0, where `handle` answers every request; its URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, source(1), 0).start()
        yield f"http://{source(1)}:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def idle(url: str, counts: Counts, connections: int = 1, engine: str = "transformers",
               serve: bool = False) -> None:
    async def dead(request: web.Request) -> web.Response:
        """A chunk server's answer holding nothing: alive (503), and never fetches a chunk."""
        counts["served_503"] += 1
        return web.Response(status=503)

    async with contextlib.AsyncExitStack() as stack:
        listen = await stack.enter_async_context(listening(dead)) if serve else None
        async with session(source(1)) as http, asyncio.TaskGroup() as tg:
            for i in range(connections):
                ws = await joined(http, url, counts, f"idle-{i}", engine=engine,
                                  listen_addr=listen)
                if ws is not None:
                    tg.create_task(drain(ws, counts))
                    tg.create_task(heartbeats(ws))


async def leaf(url: str, counts: Counts, engine: str = "relay") -> None:
    key = signing.new_private_key()
    newest: list[m.Manifest] = []  # the last manifest announced, once
    announced = asyncio.Event()
    async with session(source(1)) as http:
        if (got := await welcomed(http, url, counts, "leaf", key, engine=engine)) is None:
            return
        ws, w = got
        credentials = Credentials(w["run_id"], w["peer_id"], key, w["ticket"])
        hub = url.replace("ws", "http", 1).removesuffix("/ws")

        async def read() -> None:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    continue
                got = m.decode(msg.data)
                plan = got.plan if isinstance(got, m.VersionAnnouncement) else got
                if isinstance(plan, m.RelayPlan) and plan.gossip is not None:
                    counts["seeds_dealt"] += len(m.unpack_ids(plan.gossip.seed))
                if isinstance(got, m.VersionAnnouncement):
                    newest[:] = [got.manifest]
                    announced.set()
            counts[f"closed_{ws.close_code}"] += 1

        async def one(manifest: m.Manifest, index: int) -> int:
            path = chunk_path(manifest.version, manifest.base_version, index)
            async with http.get(hub + path, params={"wait": "5"},
                                headers=credentials.header("hub")) as resp:
                return len(await resp.read()) if resp.status == 200 else 0

        async def download() -> None:
            while True:
                await announced.wait()
                announced.clear()
                manifest, start = newest[0], time.monotonic()
                got = 0
                for i in range(0, len(manifest.chunks), 2):  # 2 requests at a time
                    sizes = await asyncio.gather(*(one(manifest, k) for k in range(
                        i, min(i + 2, len(manifest.chunks)))))
                    got += sum(sizes)
                    counts["chunks"] += sum(n > 0 for n in sizes)
                await ws.send_bytes(frame(
                    "transfer_report", version=manifest.version,
                    base_version=manifest.base_version, download_s=time.monotonic() - start,
                    bytes_from_hub=got, bytes_from_peers=0, sources=[]))
                counts["versions"] += 1

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(heartbeats(ws)), tg.create_task(download())]
            await read()
            for task in tasks:  # the hub closed
                task.cancel()


async def hoard(url: str, counts: Counts, sources: int = 8, n: int = 4096) -> None:
    async def one(k: int) -> None:
        async with session(source(k)) as http:
            ws = await joined(http, url, counts, f"hoarder-{k}")
            if ws is None:
                return
            await ws.send_bytes(frame("lease_request", n=n))
            async with asyncio.TaskGroup() as tg:
                tg.create_task(heartbeats(ws))
                async for msg in ws:
                    if msg.type is aiohttp.WSMsgType.BINARY and msgpack.unpackb(msg.data)["t"] == "lease":
                        counts["leases_held"] += 1
            counts[f"closed_{ws.close_code}"] += 1

    async with asyncio.TaskGroup() as tg:
        for k in range(1, sources + 1):
            tg.create_task(one(k))


FLOOD_FRAMES: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "version_held": lambda p: frame("version_held", version=p.get("version", 0)),
    "heartbeat": lambda p: frame("heartbeat"),
    "lease_request": lambda p: frame("lease_request", n=1),
    "relay_report": lambda p: frame("relay_report", version=p.get("version", 0),
                                    peer_id=p.get("accuse", "p1"), reason="stall", index=0,
                                    base_version=None),
    "transfer_report": lambda p: frame("transfer_report", version=p.get("version", 0),
                                       base_version=None, download_s=1.0, bytes_from_hub=0,
                                       bytes_from_peers=0, sources=[]),
}


async def flood(url: str, counts: Counts, **params: Any) -> None:
    """Flood, and when closed, join again with a fresh key and flood again, as the hub lets it."""
    frame_kind = params.get("frame", "version_held")
    data = FLOOD_FRAMES[frame_kind](params)
    async with session(source(1)) as http:
        while True:
            ws = await joined(http, url, counts, f"flood-{frame_kind}")
            if ws is None:
                await asyncio.sleep(0.5)  # refused: try again soon, a retry timer
                continue
            async with asyncio.TaskGroup() as tg:
                tg.create_task(drain(ws, counts))
                with contextlib.suppress(ConnectionError, RuntimeError):
                    while not ws.closed:
                        await ws.send_bytes(data)
                        counts["sent"] += 1


async def http_flood(url: str, counts: Counts, target: str | list[str] = "",
                     connections: int = 16) -> None:
    targets = [target] if isinstance(target, str) else target

    async def one(first: int) -> None:
        for n in range(first, 10**12):
            try:
                async with http.get(targets[n % len(targets)]) as resp:
                    await resp.read()
                    counts[f"status_{resp.status}"] += 1
            except (aiohttp.ClientError, OSError):
                counts["failed"] += 1
                await asyncio.sleep(0.01)  # a retry timer, not a synchronisation

    async with session(source(1)) as http, asyncio.TaskGroup() as tg:
        for k in range(connections):
            tg.create_task(one(k))


async def churn(url: str, counts: Counts, sources: int = 32, keys: int = 16) -> None:
    """Every address at once, each saying hello and leaving as fast as the hub answers it,
    round robin over its own keys."""

    async def one(k: int) -> None:
        peer_keys = [signing.new_private_key() for _ in range(keys)]
        async with session(source(k)) as http:
            for turn in range(10**9):
                ws = await joined(http, url, counts, "churn", peer_keys[turn % keys])
                counts["hellos"] += 1
                if ws is not None:
                    await ws.close()

    async with asyncio.TaskGroup() as tg:
        for k in range(1, sources + 1):
            tg.create_task(one(k))


def kinds() -> dict[str, Callable[..., Awaitable[None]]]:
    """Every kind, by name. peer_attacks builds on this module's connections, so it is imported
    here, as an attack starts, not at the top (run as `-m`, this module is `__main__` and
    peer_attacks imports it again under its own name: a copy of functions, no state shared)."""
    from . import peer_attacks
    return {"idle": idle, "leaf": leaf, "hoard": hoard, "flood": flood, "http": http_flood,
            "churn": churn, **peer_attacks.KINDS}


async def main(kind: str, url: str, params: dict[str, Any]) -> None:
    counts: Counts = collections.Counter()
    start = time.monotonic()

    def report() -> None:
        print(json.dumps({"kind": kind, "elapsed_s": round(time.monotonic() - start, 3),
                          **counts}), flush=True)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    run = kinds()[kind]
    ends_itself = "stop" in inspect.signature(run).parameters
    if ends_itself:
        params = {**params, "stop": stop}
    attack = asyncio.create_task(run(url, counts, **params))
    while not stop.is_set() and not attack.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), REPORT_S)
        report()
    if ends_itself:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(attack), GRACE_S)
    attack.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await attack
    counts["done"] = 1
    report()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
