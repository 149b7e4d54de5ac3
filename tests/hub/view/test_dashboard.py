"""The dashboard's server on real sockets: a real hub with real peers, read over real HTTP, and
its feed's history at 100,000 steps."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
import re
import socket
import ssl
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.view import dashboard as dashboard_module
from echo2p2p.hub.view.dashboard import FILES, STATIC, logged_before, serve_dashboard
from echo2p2p.hub.view.metrics import RunCollector
from echo2p2p.hub.view.feed import KEEP, POINTS, STEP_SERIES, VERSION_KEYS, Feed
from echo2p2p.hub.run.start import start_hub

from tests.conftest import running_peers
from tests.hub.serving.test_join_auth import self_signed


async def sse(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, dict]]:
    """The events of a text/event-stream response, as (kind, data); comments and retry skipped."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            fields = dict(line.split(": ", 1) for line in block.decode().splitlines()
                          if ": " in line and not line.startswith(":"))
            if "event" in fields:
                yield fields["event"], json.loads(fields["data"])


async def test_a_run_fills_the_snapshot_and_streams_each_new_step(hub_cfg):
    """Snapshot, /status and /metrics fill from a run with two peers, and a step recorded after
    the snapshot reaches the open event stream with no new request."""
    cfg = hub_cfg.replace(max_lag=1)
    async with (start_hub(cfg, stream=None) as run, running_peers(run.url, 2),
                aiohttp.ClientSession() as http):
        base = f"http://127.0.0.1:{run.dashboard_port}"
        async with http.get(base + "/events") as stream:
            assert stream.headers["Content-Type"] == "text/event-stream"
            events = sse(stream)
            assert await anext(events) == ("hello", {"run_id": run.hub.core.run_id, "step": 0})
            await asyncio.wait_for(run.hub.until(lambda: run.hub.core.step >= 2), 60)
            async with http.get(base + "/api/snapshot") as r:
                snap = await r.json()
            steps = snap["steps"]
            assert snap["run_id"] == run.hub.core.run_id and snap["max_lag"] == 1
            n = len(steps["step"])
            assert set(steps) == set(STEP_SERIES) and steps["step"] == list(range(n)) and n >= 1
            assert all(len(v) == n for v in steps.values())
            logged = {r["step"]: r for r in run.records if "step" in r}
            assert steps["reward"] == [logged[s]["train/reward_mean"] for s in steps["step"]]
            trained = snap["staleness"]["trained"]
            assert set(trained) <= {"0", "1"} and sum(trained.values()) >= 4 * len(steps["step"])
            assert snap["status"]["staleness"] == snap["staleness"]
            new_step = version = None
            async with asyncio.timeout(60):
                async for kind, data in events:
                    if kind == "step" and data["step"] > steps["step"][-1]:
                        new_step = data
                    version = data if kind == "version" else version
                    if new_step and version:
                        break
            record = next(r for r in run.records if r.get("step") == new_step["step"])
            assert set(new_step) == {*STEP_SERIES, "eval", "staleness"}
            assert new_step["reward"] == record["train/reward_mean"]
            assert new_step["staleness"] == record["rollout/staleness_hist"]
            assert set(version) == set(VERSION_KEYS) and version["peers"] == 2
            assert len(version["cdf_s"]) == 11 and version["cdf_s"][0] == 0.0
        async with http.get(base + "/status") as r:
            board = await r.json()
        async with http.get(base + "/metrics") as r:
            metrics = {f.name for f in text_string_to_metric_families(await r.text())}
    peers = board["peers"].values()
    assert len(peers) == 2 and {p["state"] for p in peers} == {"active"}
    assert all(0 <= p["last_seen_s"] < 60 for p in peers)
    assert "lp_bound_usd_per_hour" in board["cost"]
    assert "echo2_step" in metrics


async def test_the_token_is_refused_without_it_and_taken_as_header_or_query(hub_cfg):
    """Every route answers 401 without the token or with a wrong one, and takes it as a bearer
    header or as ?token= (the event stream too)."""
    token = "s3cret-dashboard-token"
    async with (start_hub(hub_cfg.replace(dashboard_token=token), stream=None) as run,
                aiohttp.ClientSession() as http):
        base = f"http://127.0.0.1:{run.dashboard_port}"
        for path in ("/", "/static/dashboard.js", "/status", "/metrics", "/api/snapshot",
                     "/events"):
            for kwargs in ({}, {"params": {"token": "wrong"}},
                           {"headers": {"Authorization": "Bearer wrong"}},
                           {"headers": {"Authorization": token}}):
                async with http.get(base + path, **kwargs) as r:
                    assert r.status == 401, (path, kwargs)
                    assert "token" in await r.text()
        bearer = {"Authorization": f"Bearer {token}"}
        async with http.get(base + "/api/snapshot", headers=bearer) as r:
            assert r.status == 200 and (await r.json())["run_id"] == run.hub.core.run_id
        async with http.get(base + "/metrics", params={"token": token}) as r:
            assert r.status == 200
        async with http.get(base + "/events", params={"token": token}) as stream:
            assert (await anext(sse(stream)))[0] == "hello"


def test_a_dashboard_off_loopback_needs_a_token():
    """Bound beyond loopback, the dashboard (it shows peers' addresses) needs a token."""
    with pytest.raises(ConfigError) as exc:
        HubConfig.from_flat(dashboard_host="0.0.0.0")
    assert exc.value.field == "dashboard_token"
    HubConfig.from_flat(dashboard_host="0.0.0.0", dashboard_token="t")
    HubConfig.from_flat(dashboard_host="0.0.0.0", dashboard_port=-1)  # no dashboard: nothing to guard


async def test_the_page_and_only_its_files_are_served_over_the_hubs_tls(hub_cfg, tmp_path, caplog):
    """Over the hub's TLS: the page with a CSP allowing only its own inline scripts, the
    allow-listed files, and 404 for any other name, in the folder or out of it."""
    cert, key = self_signed(tmp_path)
    caplog.set_level(logging.INFO, logger="echo2p2p.hub.view.dashboard")
    tls = ssl.create_default_context(cafile=cert)
    async with (start_hub(hub_cfg.replace(tls_cert=cert, tls_key=key), stream=None) as run,
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as http):
        base = f"https://127.0.0.1:{run.dashboard_port}"
        assert f"dashboard on {base}/" in caplog.text
        async with http.get(base + "/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            page, csp = await r.read(), r.headers["Content-Security-Policy"]
        script_src = re.search(r"script-src ([^;]*)", csp).group(1)
        assert "unsafe-inline" not in script_src and "frame-ancestors 'none'" in csp
        for inline in re.findall(rb"<script>(.*?)</script>", page, re.S):
            assert base64.b64encode(hashlib.sha256(inline).digest()).decode() in script_src
        for name in STATIC:
            async with http.get(f"{base}/static/{name}") as r:
                assert r.status == 200 and await r.read() == (FILES / name).read_bytes()
        for name in ("uPlot.LICENSE", "index.html", "nope.js", "..%2Fdashboard.py",
                     "..%2F..%2Fpyproject.toml", "%2Fetc%2Fpasswd"):
            async with http.get(URL(f"{base}/static/{name}", encoded=True)) as r:
                assert r.status == 404, name
    assert Path(FILES / "uPlot.LICENSE").is_file()  # there, and still not served


async def test_a_stuck_client_is_dropped_and_the_steps_go_on(hub_cfg):
    """A client that stops reading is cut once its queue is over the bound; a client that
    reads keeps its stream, and the learner never waits on either."""
    async with start_hub(hub_cfg.replace(dashboard_port=-1), stream=None) as run:
        assert run.dashboard_port is None  # -1: no dashboard of its own
        feed = Feed(queue_bytes=128 << 10)
        run.runlog.listeners.append(feed.record)
        async with (running_peers(run.url, 1), serve_dashboard(run, feed, port=0) as port,
                    aiohttp.ClientSession() as http,
                    http.get(f"http://127.0.0.1:{port}/events") as ok):
            stuck = socket.socket()
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect(("127.0.0.1", port))
            stuck.sendall(b"GET /events HTTP/1.1\r\nHost: dashboard\r\n\r\n")  # then never reads
            pushed, steps = asyncio.Queue(), asyncio.Queue()

            async def read() -> None:
                async for kind, data in sse(ok):
                    if kind == "status" and "n" in data:
                        pushed.put_nowait(data["n"])
                    elif kind == "step":
                        steps.put_nowait(data["step"])

            reader = asyncio.create_task(read())
            pad, n = "x" * (16 << 10), 0
            while feed.statistics().dropped_clients == 0:
                n += 1
                assert n < 20_000, "the stuck client was never dropped"
                feed.publish("status", {"n": n, "pad": pad})
                assert await asyncio.wait_for(pushed.get(), 30) == n  # the reader keeps up
            assert feed.statistics().clients == 1
            step = run.hub.core.step
            await asyncio.wait_for(run.hub.until(lambda: run.hub.core.step >= step + 2), 60)
            while await asyncio.wait_for(steps.get(), 60) < step:
                pass  # the reader still gets the steps recorded after the drop
            stuck.settimeout(30)
            assert await asyncio.to_thread(drain, stuck) == "cut"
            reader.cancel()


async def test_a_flood_of_the_computed_routes_builds_each_once_a_moment(hub_cfg, monkeypatch):
    """20 requests each of the page, /status, /api/snapshot and /metrics on the dashboard's port
    and /status on the peers' port, within one moment (made an hour here): the status is built
    once per port, /metrics collected once, the page's files read once."""
    monkeypatch.setattr("echo2p2p.hub.serving.http_limits.FRESH_S", 3600.0)
    built = Counter()

    def counted(name, real):
        def call(*args, **kwargs):
            built[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(dashboard_module, "status", counted("status", dashboard_module.status))
    monkeypatch.setattr(RunCollector, "collect", counted("metrics", RunCollector.collect))
    read_bytes = Path.read_bytes

    def read(path: Path) -> bytes:  # the page's files only: the run reads files of its own
        built["read"] += path.parent == FILES
        return read_bytes(path)

    async with start_hub(hub_cfg, stream=None) as run, aiohttp.ClientSession() as http:
        monkeypatch.setattr(Path, "read_bytes", read)
        board, peers = f"http://127.0.0.1:{run.dashboard_port}", f"http://127.0.0.1:{run.port}"
        urls = [board + path for path in ("/", "/status", "/api/snapshot", "/metrics",
                                          *(f"/static/{name}" for name in STATIC))]
        for _ in range(20):
            for url in [*urls, peers + "/status"]:
                async with http.get(url) as r:
                    assert r.status == 200, url
                    await r.read()
    assert built == {"status": 2, "metrics": 1, "read": 1 + len(STATIC)}


async def test_requests_over_an_addresss_budget_are_counted_in_metrics(hub_cfg, monkeypatch):
    """8 requests at once from one address with a burst of 3 at 1/s: some wait their turn, the
    rest are refused; /metrics (asked from another address) counts what the client saw."""
    monkeypatch.setattr("echo2p2p.hub.serving.http_limits.FRESH_S", 0.0)
    cfg = hub_cfg.replace(http_requests_per_min=60, http_burst=3)
    other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with (start_hub(cfg, stream=None) as run, aiohttp.ClientSession() as http,
                aiohttp.ClientSession(connector=other) as scraper):
        url = f"http://127.0.0.1:{run.dashboard_port}"

        async def ask() -> int:
            async with http.get(url + "/status") as r:
                return r.status

        seen = Counter(await asyncio.gather(*(ask() for _ in range(8))))
        async with scraper.get(url + "/metrics") as r:
            fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
    counts = {(s.name, s.labels.get("outcome")): s.value for s in fams["echo2_http_requests"].samples
              + fams["echo2_http_requests_limited"].samples if s.labels["route"] == "pages"}
    assert seen[429] >= 1 and seen[200] + seen[429] == 8, seen
    assert counts[("echo2_http_requests_total", None)] == seen[200] + 1  # + the scrape itself
    assert counts[("echo2_http_requests_limited_total", "refused")] == seen[429]
    assert counts[("echo2_http_requests_limited_total", "delayed")] >= 1


def drain(sock: socket.socket) -> str:
    """Read `sock` to its end: "cut" once the server closed or reset it."""
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return "cut"


def step_record(step: int) -> dict:
    return {"step": step, "version": step + 1, "time_s": step * 0.5,
            "train/reward_mean": step / 100_000, "hub/learner_busy_frac": 0.5,
            "rollout/per_s": 100.0, "rollout/staleness_mean": 1.0, "cost/usd_total": step * 1e-3,
            "cost/usd_per_hour": 3.6, "rollout/staleness_hist": {"1": 4},
            "eval/accuracy": 0.5 if step % 100 == 0 else None}


def test_100000_steps_keep_2000_points_with_the_first_and_last_in_bounded_memory():
    """At 100,000 steps the snapshot has <= 2000 points a series, the first and last steps as
    they were, means over equal step ranges between, and the history stopped growing."""
    feed = Feed()
    for step in range(20_000):
        feed.record(step_record(step))
    tracemalloc.start()
    at_20k = tracemalloc.get_traced_memory()[0]
    for step in range(20_000, 100_000):
        feed.record(step_record(step))
    grown = tracemalloc.get_traced_memory()[0] - at_20k
    tracemalloc.stop()
    # bounded at KEEP buckets of 9 floats (288 KB); keeping every step would take 5 MB more
    assert grown < 1 << 20 and feed.steps.buckets <= KEEP
    steps = feed.snapshot()["steps"]
    assert all(len(v) <= POINTS for v in steps.values()) and len(steps["step"]) > POINTS // 2
    assert (steps["step"][0], steps["step"][-1]) == (0, 99_999)
    assert (steps["reward"][0], steps["reward"][-1]) == (0.0, 0.99999)
    assert all(a < b for a, b in zip(steps["step"], steps["step"][1:]))  # uPlot's x: increasing
    # reward is step / 1e5: a bucket's mean reward is its mean step's
    assert all(abs(r - s / 100_000) < 1e-5 for s, r in zip(steps["step"], steps["reward"]))
    evals = feed.snapshot()["evals"]
    assert evals["version"] == list(range(1, 100_000, 100)) and set(evals["accuracy"]) == {0.5}


async def test_numbers_that_are_not_finite_go_out_as_null():
    """JSON has no NaN: a step's NaN or infinite value is null in its event and the snapshot."""
    feed = Feed()
    subscriber = feed.subscribe(on_drop=lambda: None)
    feed.record({**step_record(0), "train/reward_mean": math.nan,
                 "hub/learner_busy_frac": math.inf})
    feed.publish("status", {"trust": -math.inf})
    frames = (await subscriber.wait_frames(1.0)).decode().split("\n\n")
    step, status = (json.loads(f.split("data: ", 1)[1]) for f in frames if "event: step" in f
                    or "event: status" in f)
    assert (step["reward"], step["busy"], step["rollouts_per_s"]) == (None, None, 100.0)
    assert status == {"trust": None}
    steps = feed.snapshot()["steps"]
    assert (steps["reward"], steps["busy"]) == ([None], [None])


def test_a_resumed_feed_starts_from_what_the_run_logged_before_its_checkpoint(tmp_path):
    """A run killed after step 4, resumed from its checkpoint at v3: steps 0-2 and versions up
    to 3 come back once each (the last of a step logged twice), steps 3-4 are trained again."""
    lines = [{"event": "eval", "version": 0, "eval/accuracy": 0.25}]
    for step in range(5):
        lines += [{"step": step, "version": step + 1, "train/reward_mean": step / 10},
                  {"event": "propagation", "version": step + 1, "peers": 2}]
    lines.insert(3, {"step": 1, "version": 2, "train/reward_mean": 0.99})  # logged, then again
    text = "\n".join(json.dumps(r) for r in lines) + "\nnot json\n[1, 2]\n"
    (tmp_path / "metrics.jsonl").write_text(text)
    feed = Feed()
    for record in logged_before(tmp_path, 3):
        feed.record(record)
    steps = feed.snapshot()["steps"]
    assert steps["step"] == [0, 1, 2] and steps["reward"] == [0.0, 0.1, 0.2]
    assert feed.snapshot()["evals"]["version"] == [0]
    assert [v["version"] for v in feed.snapshot()["versions"]] == [1, 2, 3]
