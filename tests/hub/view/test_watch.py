"""`echo2-hub status URL`: a real hub's peers and step in the terminal; peer-sent text shown
literally; a dead URL is one line and exit 1; `--watch` redraws in place and reconnects."""

from __future__ import annotations

import asyncio
import fcntl
import io
import os
import pty
import re
import socket
import ssl
import struct
import subprocess
import sys
import termios

import pytest
from aiohttp import web
from rich.console import Console

from echo2p2p.hub.run.start import start_hub
from echo2p2p.hub.view.watch import MAX_ROWS, render, status_url
from echo2p2p.rates import rate_text

from tests.conftest import running_peers, serving
from tests.hub.serving.test_join_auth import self_signed

CLI = [sys.executable, "-m", "echo2p2p.hub.cli", "status"]
WIDE = {**os.environ, "COLUMNS": "200"}  # not a terminal: rich would draw 80 columns
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


async def status(*args: str) -> tuple[int, str, str]:
    """The real CLI in a child process, while this loop goes on serving the hub."""
    child = await asyncio.create_subprocess_exec(*CLI, *args, env=WIDE, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(child.communicate(), 60)
    return child.returncode, out.decode(), err.decode()


@pytest.mark.timeout(120)
async def test_status_of_a_real_hub_names_its_peers_and_step(hub_cfg):
    """From the peers' ws:// URL as the log prints it, and from the dashboard's port, with the
    dashboard token, the summary shows the run, both peers as active and the step the hub had
    reached; the dashboard without the token answers 401: one line, exit 1; the peers' port
    without it, the run but no peer."""
    cfg = hub_cfg.replace(dashboard_port=0, dashboard_token="peek")
    async with start_hub(cfg, stream=None) as run:
        async with running_peers(run.url, 2):
            await asyncio.wait_for(run.hub.until(lambda: run.hub.core.step >= 2), 60)
            before = run.hub.core.step
            board = f"http://127.0.0.1:{run.dashboard_port}"
            answers = await asyncio.gather(status(run.url, "--token", "peek"),
                                           status(board, "--token", "peek"), status(board),
                                           status(run.url))
            after = run.hub.core.step
    for rc, out, err in answers[:2]:
        assert rc == 0, err
        assert run.hub.core.run_id in out
        assert before <= int(re.search(r"step (\d+)", out).group(1)) <= after
        rows = [line for line in out.splitlines() if "test-0" in line or "test-1" in line]
        assert len(rows) == 2 and all("active" in row and "transformers" in row for row in rows)
    rc, out, err = answers[2]
    assert rc == 1 and out == "" and err.count("\n") == 1 and "answered 401" in err
    rc, out, err = answers[3]
    assert rc == 0 and run.hub.core.run_id in out and "test-" not in out and "--token" in out


def hostile_status(n_peers: int) -> dict:
    """A /status answer whose peers chose markup, escape sequences and junk numbers."""
    peers = {"p0": {"name": "[bold red]x", "engine": "[link=http://e.vil]y[/link]",
                    "held_version": 10**30, "trust": "very", "upload_mbps": float("nan"),
                    "state": "active", "usd": True},
             "p1": {"name": "\x1b[2J\x1b]0;owned\x07evil\u202e", "engine": "e" * 500,
                    "state": "quarantined"}}
    peers.update({f"q{i}": {"name": f"filler-{i:03d}", "state": "quarantined"}
                  for i in range(n_peers - 2)})
    return {"run_id": "[blink]run", "step": 7, "published_version": 7, "peers": peers,
            "last": {"train/reward_mean": "lots", "hub/learner_busy_frac": 0.5}}


async def test_peer_sent_text_comes_out_literally_and_bounded():
    """Rich markup in a peer's name styles nothing, escape sequences never reach the terminal,
    a number that is not one shows as "-", and only the first MAX_ROWS peers are listed (the
    hub's own run id is shown the same way)."""
    async def answer(request: web.Request) -> web.Response:
        return web.json_response(hostile_status(MAX_ROWS + 10))

    app = web.Application()
    app.router.add_get("/status", answer)
    async with serving(app) as port:
        rc, out, err = await status(f"http://127.0.0.1:{port}/status")
    assert rc == 0, err
    assert "[bold red]x" in out and "[link=http://e.vil]y[/link]" in out and "[blink]run" in out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "?[2J?]0;owned?evil?" in out and "e" * 500 not in out
    assert "reward -" in out and "and 10 more peers" in out
    row = next(line for line in out.splitlines() if "[bold red]x" in line)
    assert "1e+30" in row and "very" not in row and "nan" not in row.lower()
    assert sum("filler-" in line for line in out.splitlines()) == MAX_ROWS - 2


async def test_an_https_hub_is_trusted_with_its_ca_cert(tmp_path):
    """A hub on a self-signed certificate answers with --ca-cert; without it the
    certificate check fails in one line, and nothing is shown."""
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"run_id": "tls-run"})

    app = web.Application()
    app.router.add_get("/status", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
        url = f"https://127.0.0.1:{runner.addresses[0][1]}"
        trusted, untrusted = await asyncio.gather(status(url, "--ca-cert", cert), status(url))
    finally:
        await runner.cleanup()
    assert trusted[0] == 0 and "tls-run" in trusted[1]
    assert untrusted[0] == 1 and untrusted[1] == "" and untrusted[2].count("\n") == 1
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted[2]


def test_a_dead_url_exits_1_with_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([*CLI, f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"echo2-hub status: cannot reach http://127.0.0.1:{port}/status: " \
                          f"Connection refused\n"


@pytest.mark.parametrize("url, expected", [
    ("http://h:1", "http://h:1/status"), ("https://h:1/status", "https://h:1/status"),
    ("ws://h:1/ws", "http://h:1/status"), ("wss://h:1/", "https://h:1/status"),
    ("h:1", "http://h:1/status"), ("http://h:1/hub/", "http://h:1/hub/status")])
def test_status_url(url, expected):
    assert status_url(url) == expected


def read_terminal(fd: int) -> bytes:
    """All a child wrote to its terminal, until it exited."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:  # EIO: the child's side of the pty is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.timeout(60)
async def test_watch_redraws_in_place_and_says_reconnecting():
    """In a terminal, `--watch 0.2 --count 4` draws 4 times over the same lines: steps 10, 20,
    then a hub that failed (503) shown as reconnecting above the last answer, then step 40."""
    asked = 0

    async def answer(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        if asked == 3:
            return web.Response(status=503, text="restarting")
        return web.json_response({"run_id": "r", "step": 10 * asked, "peers": {}})

    app = web.Application()
    app.router.add_get("/status", answer)
    async with serving(app) as port:
        terminal, child_side = pty.openpty()
        fcntl.ioctl(child_side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        child = await asyncio.create_subprocess_exec(
            *CLI, f"http://127.0.0.1:{port}", "--watch", "0.2", "--count", "4",
            stdin=child_side, stdout=child_side, stderr=child_side,
            env={**os.environ, "TERM": "xterm-256color"})
        os.close(child_side)
        raw = (await asyncio.to_thread(read_terminal, terminal)).decode()
        os.close(terminal)
        assert await asyncio.wait_for(child.wait(), 30) == 0
    assert asked == 4
    text = ANSI.sub("", raw)
    seen = [m.group(0) for m in re.finditer(r"step \d+|reconnecting: [^\r\n]*", text)]
    frames = ["reconnecting" if s.startswith("reconnecting") else s for s in seen]
    # the last frame may be drawn once more as Live stops
    assert frames[:5] == ["step 10", "step 20", "reconnecting", "step 20", "step 40"]
    assert set(frames[5:]) <= {"step 40"}
    assert "503 Service Unavailable: restarting" in seen[2]
    assert raw.count("\x1b[1A") >= 3  # each redraw moves the cursor back up over the last one


def test_the_peers_table_says_what_its_two_rates_are():
    """adm/s and gen/s are different quantities, and the table's caption says which is which;
    each peer's row shows its own of both, with two significant figures at least: a real
    model's peer at 0.4/s shows 0.4, not 0."""
    status = {"run_id": "r", "step": 3, "max_lag": 2, "peers": {"p1": {
        "name": "alpha", "engine": "transformers", "held_version": 2, "state": "active",
        "admitted_per_s": 12.34, "gen_rollouts_per_s": 98.7}, "p2": {
        "name": "beta", "engine": "vllm", "held_version": 2, "state": "active",
        "admitted_per_s": 0.043, "gen_rollouts_per_s": 0.4}},
        "last": {"rollout/per_s": 0.443}}
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(render(status))
    out = console.export_text()
    caption = " ".join(out.split())  # rich wraps it
    assert "adm/s: completions admitted per second over the last 60 s" in caption
    assert "gen/s: made per second while busy" in caption
    assert re.search(r"alpha\s+transformers\s+2\s+12\.3\s+98\.7\s", out), out
    assert re.search(r"beta\s+vllm\s+2\s+0\.043\s+0\.4\s", out), out
    assert re.search(r"admitted/s 0\.44\s", out), out


@pytest.mark.parametrize(("per_s", "shown"), [
    (0.0, "0"), (0.4, "0.4"), (0.043, "0.043"), (0.456, "0.46"), (1.0, "1.0"), (12.345, "12.3"),
    (98.7, "98.7"), (925.4, "925"), (1662.0, "1662")])
def test_a_rate_keeps_two_significant_figures(per_s, shown):
    assert rate_text(per_s) == shown


def test_an_evaluation_under_way_shows_in_the_header():
    """/status's "evaluating" is the eval cell's `evaluating v4: 128/200`; none (null, or a
    hostile value) shows nothing."""
    def header_of(status: dict) -> str:
        console = Console(record=True, width=160, file=io.StringIO())
        console.print(render({"run_id": "r", "step": 4, **status}))
        return console.export_text()

    shown = header_of({"evaluating": {"version": 4, "done": 128, "total": 200}})
    assert "evaluating v4: 128/200" in shown, shown
    for hostile in (None, "soon", {"version": 4, "done": "x", "total": 200}, {"done": 1.5}):
        assert "evaluating" not in header_of({"evaluating": hostile})
