"""Attackers that do a peer's work on their own terms, each in a process of its own (kinds of
`tests.hostile.attacks`, which starts them and prints their counts).

- discerning: a relay slow to receivers and quick to whatever gives the hub's check away
  (tests/hostile/test_hub_checks.py, 42-6). It joins as a relay, advertising a chunk server of
  its own, and holds the chunks it is asked for as a relay that fetched them would: from the
  hub's chunk route, under its own ticket. `stall_s`: the receivers' relay_stall_s, which
  paces them; `name` ("discerning-relay").
- rollouts: leases one prompt at a time and submits `samples` ([text, token ids] each, the
  first group_size of them) as its group, the next once the hub answered the last; with
  `stop` it ends after its last rollout is answered (tests/hostile/test_sandbox.py, 42-5).

Counts that name something are keyed "<family>: <name>" (`harness.family` reads them back):
`fast: <tell> (wait=W)`, requests the relay took for the hub's; `slow: <peer id>`, chunks it
served slowly, by who asked; `caught: <peer id>`, ids it caught checking; `announced: <v>`,
1 if v's announcement plan named it a source, else 0; `answer: <ack | reject reason>`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
from aiohttp import web

from echo2p2p import signing
from echo2p2p.messages import pack_ids, pack_logprobs, unpack_ids
from echo2p2p.overlay.fetch import MIN_RATE_BYTES_S
from echo2p2p.overlay.serving import MAX_PROBE_BYTES, PROBE_PATH
from echo2p2p.overlay.store import chunk_path
from echo2p2p.overlay.tickets import TICKET_HEADER, Credentials

from .attacks import Counts, frame, heartbeats, listening, session, source, welcomed

KEEP_VERSIONS = 4  # chunks of older versions than the newest few are dropped from the cache


def plan_in(f: dict[str, Any]) -> dict[str, Any] | None:
    """The relay plan a frame carries: a re-deal, or the first plan inside an announcement."""
    return f if f["t"] == "relay_plan" else f.get("plan") if f["t"] == "version" else None


def sources(plan: dict[str, Any]) -> set[str]:
    """The peers a relay plan routes chunks through (a source always owns some)."""
    return {s["peer_id"] for s in plan["sources"]}


def owned(peer_id: str, frame: dict[str, Any]) -> tuple[tuple[int, int | None], list[int]] | None:
    """The manifest a frame's plan is of and the chunks it deals `peer_id` (an owner's, or
    gossip seeds); None for a frame without a plan."""
    plan = plan_in(frame)
    if plan is None:
        return None
    key = (plan["version"], plan["base_version"])
    if plan.get("gossip"):
        return key, list(unpack_ids(plan["gossip"]["seed"]))
    mine = [k for k, s in enumerate(plan["sources"]) if s["peer_id"] == peer_id]
    owners = unpack_ids(plan["owners"])
    return key, [i for i, o in enumerate(owners) if o in mine]

def asker(request: web.Request) -> str:
    """The peer id a request's ticket names ('' without one)."""
    return request.headers.get(TICKET_HEADER, "").partition(".")[0]


@dataclass
class Discerning:
    """What the relay knows: its welcome, what the hub announced it and who checked it."""

    welcome: dict[str, Any]
    counts: Counts
    newest: int = -1  # the newest version announced to it
    named: set[str] = field(default_factory=set)  # peer ids its relay plans named as sources
    hub_ids: set[str] = field(default_factory=set)  # peer ids it caught checking
    hub_connections: set[Any] = field(default_factory=set)  # (host, port) of their connections
    receiver_shapes: set[tuple] = field(default_factory=set)  # as the receivers it knows ask

    def heard(self, f: dict[str, Any]) -> None:
        """A frame from the hub: announcements and plans."""
        if f["t"] == "version":
            version = f["manifest"]["version"]
            self.newest = max(self.newest, version)
            self.counts[f"announced: {version}"] = int(
                self.welcome["peer_id"] in sources(f["plan"]))
        if (plan := plan_in(f)) is not None:
            self.named |= sources(plan)

    def tell(self, request: web.Request, version: int) -> str | None:
        """What gives this request away as the hub's, if anything."""
        who, _, rest = request.headers.get(TICKET_HEADER, "").partition(".")
        key = rest.partition(".")[0]
        connection = request.transport.get_extra_info("peername") if request.transport else None
        shape = (tuple((k, v) for k, v in request.headers.items() if k != TICKET_HEADER),
                 tuple(request.query.items()))
        if who == "hub":
            return "peer id hub"
        if key == self.welcome["hub_key"].hex():
            return "the hub's key"
        if who in self.hub_ids:
            return "a peer id seen checking"
        if connection in self.hub_connections:
            return "a connection seen checking"
        if version < self.newest:
            return "an older version"
        if who in self.named:  # a receiver it knows: how they ask
            self.receiver_shapes.add(shape)
            return None
        if shape not in self.receiver_shapes:
            return "headers or query"
        return None

    def caught(self, request: web.Request, tell: str) -> None:
        self.counts[f"fast: {tell} (wait={request.query.get('wait')})"] += 1
        self.hub_ids.add(who := asker(request))
        self.counts[f"caught: {who}"] = 1
        self.hub_connections.add(request.transport.get_extra_info("peername")
                                 if request.transport else None)


class HubChunks:
    """The hub's chunks, as this relay fetched them from the hub's chunk route under its own
    ticket (the request a peer's download makes of the hub: `echo2p2p.overlay.fetch`), kept
    for the newest KEEP_VERSIONS versions."""

    def __init__(self, http: aiohttp.ClientSession, hub_url: str, credentials: Credentials,
                 counts: Counts):
        self.http, self.credentials, self.counts = http, credentials, counts
        self.base_url = "http://" + hub_url.split("://", 1)[1].split("/", 1)[0]
        self._kept: dict[tuple[int, int | None, int], bytes] = {}

    async def fetch(self, version: int, base: int | None, index: int) -> None:
        """`get`, for its side effect (kept), whatever the hub answers."""
        with contextlib.suppress(aiohttp.ClientError, OSError):
            await self.get(version, base, index)

    async def get(self, version: int, base: int | None, index: int) -> bytes | None:
        """The chunk's bytes, or None if the hub does not hold it."""
        key = (version, base, index)
        if key not in self._kept:
            url = self.base_url + chunk_path(version, base, index)
            async with self.http.get(url, params={"wait": "0"},
                                     headers=self.credentials.header("hub")) as resp:
                if resp.status != 200:
                    self.counts[f"hub answered {resp.status}"] += 1
                    return None
                self._kept[key] = await resp.read()
            self.counts["chunks fetched from the hub"] += 1
            for old in [k for k in self._kept if k[0] <= version - KEEP_VERSIONS]:
                del self._kept[old]
        return self._kept[key]


async def discerning(url: str, counts: Counts, stall_s: float,
                     name: str = "discerning-relay") -> None:
    """The relay: joined, reading the hub's frames, and serving until the hub closes it. To a
    receiver, headers at 0.9 x `stall_s` and the second half of the body half-way through what
    is left of its deadline, as tests/hostile/test_slow_relay.py's; to the hub's uplink probe
    (/probe, the hub's alone), at once."""
    key, ready = signing.new_private_key(), asyncio.Event()
    state: list[tuple[Discerning, HubChunks]] = []  # set once welcomed

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == PROBE_PATH:  # only the hub's ticket may open it: quick, and a lie
            nbytes = min(int(request.query.get("bytes", "0")), MAX_PROBE_BYTES)
            return web.Response(body=bytes(nbytes), content_type="application/octet-stream")
        try:
            version, base, index = parse_chunk_path(request.path)
        except ValueError:
            return web.Response(status=404)
        await ready.wait()  # the hub's probe at the join may come before its welcome is read
        relay, chunks = state[0]
        data = await chunks.get(version, base, index)
        if not data:
            return web.Response(status=404)
        if (tell := relay.tell(request, version)) is not None:
            relay.caught(request, tell)
            return web.Response(body=data, content_type="application/octet-stream")
        return await slowly(request, data, stall_s, counts)

    async with session(source(1)) as http, listening(handle) as listen:
        got = await welcomed(http, url, counts, name, key, engine="relay", listen_addr=listen)
        if got is None:
            return
        ws, welcome = got
        credentials = Credentials(welcome["run_id"], welcome["peer_id"], key, welcome["ticket"])
        relay = Discerning(welcome, counts)
        state.append((relay, HubChunks(http, url, credentials, counts)))
        ready.set()
        async with asyncio.TaskGroup() as tg:
            beats = tg.create_task(heartbeats(ws))
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.BINARY:
                    relay.heard(frame := msgpack.unpackb(msg.data))
                    # Its share, fetched as it is dealt, as an honest relay does: a relay that
                    # fetches nothing is silent to the hub's seed watch and dealt nothing soon.
                    if (dealt := owned(welcome["peer_id"], frame)) is not None:
                        for index in dealt[1]:
                            tg.create_task(state[0][1].fetch(*dealt[0], index))
            beats.cancel()
        counts[f"closed_{ws.close_code}"] += 1


def parse_chunk_path(path: str) -> tuple[int, int | None, int]:
    """(version, base, index) of /chunk/VERSION/BASE|full/INDEX; ValueError otherwise."""
    parts = path.split("/")
    if len(parts) != 5 or parts[:2] != ["", "chunk"]:
        raise ValueError(path)
    return int(parts[2]), None if parts[3] == "full" else int(parts[3]), int(parts[4])


async def slowly(request: web.Request, data: bytes, stall_s: float,
                 counts: Counts) -> web.StreamResponse:
    """`data` as late as a receiver whose relay_stall_s is `stall_s` still takes it."""
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
        counts[f"slow: {asker(request)}"] += 1
    return resp


def samples_of(samples: Iterable[list], group_size: int) -> list[dict[str, Any]]:
    """Wire samples for a group: each [text, its token ids, EOS included], reward 0, a logprob
    of -1 a token."""
    return [{"token_ids": pack_ids(ids), "text": text, "reward": 0.0,
             "logprobs": pack_logprobs([-1.0] * len(ids)), "finish_reason": "stop"}
            for text, ids in list(samples)[:group_size]]


async def rollouts(url: str, counts: Counts, samples: list[list], stop: asyncio.Event,
                   name: str = "hoarder") -> None:
    """Lease a prompt, submit `samples` as its group, and once the hub answered, again; after
    `stop`, the rollout under way is answered, then it leaves."""
    async with session(source(1)) as http:
        got = await welcomed(http, url, counts, name, engine="transformers")
        if got is None:
            return
        ws, welcome = got
        newest = welcome["version"]
        async with asyncio.TaskGroup() as tg:
            beats = tg.create_task(heartbeats(ws))
            await ws.send_bytes(frame("lease_request", n=1))
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    continue
                f = msgpack.unpackb(msg.data)
                if f["t"] == "version":
                    newest = max(newest, f["manifest"]["version"])
                elif f["t"] == "lease":
                    await ws.send_bytes(frame("rollout", lease_id=f["lease_id"], version=newest,
                                              samples=samples_of(samples, f["group_size"])))
                    counts["rollouts"] += 1
                elif f["t"] in ("ack", "reject"):
                    counts[f"answer: {f['t']} {f.get('reason', '')}".strip()] += 1
                    counts["answers"] += 1
                    if stop.is_set():
                        break
                    await ws.send_bytes(frame("lease_request", n=1))
            beats.cancel()
            await ws.close()
        counts[f"closed_{ws.close_code}"] += 1


KINDS = {"discerning": discerning, "rollouts": rollouts}
