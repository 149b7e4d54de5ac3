"""Slowloris on every HTTP server we run (issue 11, item 9): connections that send half a
request head and stop. The hub's server (websocket, chunks, /status) and each peer's chunk
server close them after a request-head deadline, and go on serving meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

from .conftest import yes
from .harness import hub_alive, hub_and_honest_peer, mark, small_cfg, still_training

HEAD_DEADLINE_S = 2.0  # the servers' idle / request-head deadline in this test (default 20 s)
SLOW_CLIENTS = 8  # per server
HALF_HEAD = b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # ...and never the rest


async def test_half_sent_requests_are_closed_by_the_servers(tmp_path, row, monkeypatch):
    """Half-sent request heads are closed by the hub's and the peer's HTTP servers; both go on."""
    r = row(f"9. slowloris: {SLOW_CLIENTS} half-sent request heads each to hub and peer")
    monkeypatch.setattr("echo2p2p.runtime.http_deadlines.IDLE_S", HEAD_DEADLINE_S)  # read when a server starts
    async with hub_and_honest_peer(small_cfg(tmp_path)) as (run, honest), \
            contextlib.AsyncExitStack() as stack:
        peer_port = urlsplit(honest.served_url).port
        since = mark(run, honest)
        slow = []
        for name, port in (("hub", run.port), ("peer", peer_port)):
            for _ in range(SLOW_CLIENTS):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                stack.callback(writer.close)
                writer.write(HALF_HEAD)
                await writer.drain()
                slow.append((name, reader))
        alive_meanwhile = await hub_alive(run)
        r.honest_training = await still_training(run, honest, since)
        closed = {"hub": 0, "peer": 0}
        answered = set()
        for name, reader in slow:
            try:
                data = await asyncio.wait_for(reader.read(), 60)  # until the server closes
            except ConnectionResetError:  # closed by an abort: a reset is a close too
                data = b""
            closed[name] += 1
            if data:
                answered.add(data.split(b"\r\n", 1)[0].decode("latin-1"))
        r.reaction = (f"closed by the server: hub {closed['hub']}/{SLOW_CLIENTS}, peer "
                      f"{closed['peer']}/{SLOW_CLIENTS}"
                      + (f", answered {sorted(answered)}" if answered else ", no answer"))
        r.hub_alive = yes(alive := alive_meanwhile and await hub_alive(run))
        r.note = f"deadline set to {HEAD_DEADLINE_S:.0f} s"
    assert alive
    assert closed == {"hub": SLOW_CLIENTS, "peer": SLOW_CLIENTS}, closed
