"""`echo2-peer join` pointed at what is not a hub, as a user meets it: the command in a subprocess,
real servers on 127.0.0.1. What can never work (a wrong path, the dashboard's port, another
server, an unknown host, a refused token) ends with one sentence on stderr and exit code 1; what
may come back (nothing listening yet) is retried, with a line that says what the peer waits for."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.run.loop import HubRun
from echo2p2p.hub.serving.server import Hub, TokenizedProblem
from echo2p2p.hub.serving.tokens import TokenBook
from echo2p2p.hub.view.dashboard import serve_dashboard
from echo2p2p.hub.view.feed import Feed
from echo2p2p.hub.view.runlog import RunLog
from echo2p2p.peer.attempts import DNS_ATTEMPTS
from echo2p2p.tasks import AdditionTask

from tests.conftest import tracker
from tests.hub.serving.test_join_auth import self_signed

# A relay needs no model; no chunk server: nothing of the peer's own is listening.
PEER = (sys.executable, "-m", "echo2p2p.peer.cli", "join")
FLAGS = ("--engine", "relay", "--listen", "", "--connect-timeout-s", "10")
DEADLINE_S = 60.0  # a peer that gives up does so in seconds; this only bounds a failing test


async def join(url: str, *flags: str) -> tuple[int, str]:
    """Run `echo2-peer join url` to its end: (exit code, stderr). Its last line is printed, for
    the record (`pytest -s`)."""
    proc = await asyncio.create_subprocess_exec(*PEER, url, *FLAGS, *flags,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    print(err.decode().strip().splitlines()[-1:], proc.returncode)
    return proc.returncode, err.decode()


def assert_gave_up(code: int, err: str, *words: str) -> str:
    """Exit 1 with one `echo2-peer:` sentence holding `words`, and no traceback; the sentence."""
    assert code == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("echo2-peer: "), err
    for word in words:
        assert word in last, last
    return last


@contextlib.asynccontextmanager
async def http_server(app: web.Application) -> AsyncIterator[int]:
    """`app` on a free port of 127.0.0.1; yields the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def test_a_wrong_path_on_a_hubs_port_names_the_right_url():
    """ws://HOST:PORT/wrong on a real hub's port: 404, and the sentence gives the /ws URL."""
    async with tracker() as (_, _, url, _):
        address = url.split("/")[2]
        code, err = await join(url.replace("/ws", "/wrong"))
    assert_gave_up(code, err, f"{address} answered HTTP 404 on /wrong", f"join ws://{address}/ws")


async def test_the_dashboards_port_is_named_as_such(tmp_path):
    """The hub's dashboard (the real one, with and without its token) is not its peers' port:
    the sentence says so and where the peers' URL is printed."""
    task = AdditionTask()
    for token in ("", "secret"):
        cfg = HubConfig.from_flat(port=0, dashboard_port=0, dashboard_token=token,
                                  run_dir=str(tmp_path))
        hub = Hub(cfg, "run", task, [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]])
        run = HubRun(cfg, hub, None, None, RunLog(tmp_path, {}, stream=None), b"")
        async with serve_dashboard(run, Feed(), port=0) as port:
            code, err = await join(f"http://127.0.0.1:{port}/")
        assert_gave_up(code, err, f"127.0.0.1:{port} is a hub's dashboard, not its peers' port",
                       "listening on ws://HOST:PORT/ws")


async def test_another_server_is_no_hub():
    """A web server that is not a hub at all (404 everywhere, 200 without a websocket, no TLS
    for a wss:// URL)."""
    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html>hello</html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/page", page)
    async with http_server(app) as port:
        code, err = await join(f"ws://127.0.0.1:{port}/ws")
        assert_gave_up(code, err, f"127.0.0.1:{port} answered HTTP 404 on /ws",
                       "no hub's peer endpoint is there")
        code, err = await join(f"ws://127.0.0.1:{port}/page")
        assert_gave_up(code, err, f"127.0.0.1:{port} answered HTTP 200 on /page")
        code, err = await join(f"wss://127.0.0.1:{port}/ws")
        assert_gave_up(code, err, f"no TLS at 127.0.0.1:{port}", f"join ws://127.0.0.1:{port}/ws")


async def test_an_unknown_host_is_given_up_after_a_few_look_ups():
    """A host that does not resolve (the reserved .invalid domain never does): given up after
    DNS_ATTEMPTS look-ups, naming the host."""
    code, err = await join("ws://no-such-hub.invalid:8765/ws")
    last = assert_gave_up(code, err, "host no-such-hub.invalid not found",
                          f"{DNS_ATTEMPTS} attempts", "check the host name")
    assert err.count("retrying in") == DNS_ATTEMPTS - 1, err
    assert "ssl:default" not in err and last.count(".") <= 3  # our words, one sentence


async def test_a_closed_port_is_retried_with_a_line_that_says_why():
    """Nothing listening (a hub not started yet) may come back: the peer keeps trying, and each
    retry line says what it waits for, in our words (aiohttp's say ssl:default for ws://)."""
    async with http_server(web.Application()) as port:
        pass  # a port that was free a moment ago, closed now
    proc = await asyncio.create_subprocess_exec(*PEER, f"ws://127.0.0.1:{port}/ws", *FLAGS,
                                                "--reconnect-max-s", "0.5",
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    retries: list[str] = []
    try:
        async with asyncio.timeout(DEADLINE_S):
            while len(retries) < 5:
                line = (await proc.stderr.readline()).decode()
                assert line, f"the peer exited ({await proc.wait()}) after {retries}"
                if "retrying in" in line:
                    retries.append(line)
        assert proc.returncode is None  # still trying
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), DEADLINE_S)
    for line in retries:
        assert f"hub 127.0.0.1:{port} not reachable (connection refused" in line, line
        assert "ssl:default" not in line and "Traceback" not in line, line


async def test_a_refused_token_ends_the_peer(tmp_path):
    """A hub that requires a join token, joined without one or with a wrong one: exit 1, the
    hub's reason and where tokens come from, in one sentence."""
    book = TokenBook(tmp_path / "tokens.json")
    book.create("alice")
    async with tracker(tokens=str(book.path)) as (hub, _, url, _):
        code, err = await join(url)
        assert_gave_up(code, err, f"hub {url} refused us", "a join token is required",
                       "`echo2-hub token create`")
        code, err = await join(url, "--token", "abc.def")
        assert_gave_up(code, err, "join token not recognised", "`echo2-hub token create`",
                       "--token")
        assert hub.statistics().refused == 2


async def test_an_untrusted_certificate_names_the_flag(tmp_path):
    """A wss:// hub whose certificate no trusted authority signed (self-signed), joined without
    --ca-cert: exit 1, the sentence names --ca-cert."""
    cert, key_file = self_signed(tmp_path)
    async with tracker(tls_cert=cert, tls_key=key_file) as (hub, _, url, _):
        code, err = await join(url)
        assert_gave_up(code, err, f"hub {url.split('/')[2]}'s TLS certificate is not trusted",
                       "--ca-cert")
        assert hub.statistics().refused == 0 and not hub.peer_views()


async def test_a_hub_turning_joins_away_is_retried_until_it_lets_the_peer_in():
    """A hub that answers 429 at the upgrade (its address holds its share of connections) is
    retried with a line that says so; once the share frees up, the peer is welcomed."""
    async with tracker(max_peers_per_address=1) as (hub, _, url, _), \
            aiohttp.ClientSession() as http:
        holder = await http.ws_connect(url)
        await holder.send_bytes(m.encode(m.Hello("holder", "relay", "cpu")))
        await holder.receive()  # its welcome: the address's one connection is taken
        proc = await asyncio.create_subprocess_exec(*PEER, url, *FLAGS, "--reconnect-max-s", "0.5",
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(DEADLINE_S):
                while "retrying in" not in (line := (await proc.stderr.readline()).decode()):
                    assert line, f"the peer exited ({await proc.wait()})"
                assert "turns joins away for now (HTTP 429" in line, line
                await holder.close()
                await hub.until(lambda: len(hub.peer_views()) == 0)
                await hub.until(lambda: len(hub.peer_views()) == 1)  # the peer, in
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), DEADLINE_S)
