"""The dashboard at scale: 100,000 steps of history and 1,000 peers, measured in Chromium.

The server is the real one (`echo2p2p.hub.view.dashboard.serve_dashboard`) over a real `Hub` without
a learner: --peers peer connections that said hello and were welcomed (real `HubProtocol`s, no
sockets; names, prices, rates, held versions and uploads of their own, a few quarantined, some
on standby) and a real `echo2p2p.hub.view.feed.Feed` fed --steps run log step records, an evaluation
every 10 steps and 200 propagation records, as the run log would hand them on. The page
(Debian's /usr/bin/chromium, 1400x900) is opened once, and reports in its own clock
(performance.now(), `window.dashboard.timings`):
- the snapshot's size, and the time to the first full render (from the navigation's start:
  HTML, scripts, snapshot, every chart and the first TABLE_ROWS rows of the table);
- one new step: its event applied, and the draw that followed (every chart);
- one status event of --peers peers: applied, and the draw (tiles, the table sorted and cut);
- the peers table filtered by a typed string.
Each live figure is the median (and max) of --repeats events sent one at a time by the feed.
The server's side: building the snapshot and the status JSON of --peers peers, in Python.

    python bench/dashboard_scale.py [--steps 100000] [--peers 1000] [--repeats 10]

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright.async_api import Page, async_playwright  # noqa: E402

from echo2p2p import messages as m  # noqa: E402
from echo2p2p.hub.config import HubConfig  # noqa: E402
from echo2p2p.hub.view.dashboard import serve_dashboard, snapshot  # noqa: E402
from echo2p2p.hub.view.feed import Feed, finite_json  # noqa: E402
from echo2p2p.hub.core.peer import Peer  # noqa: E402
from echo2p2p.hub.view.runlog import RunLog  # noqa: E402
from echo2p2p.hub.serving.server import Hub, TokenizedProblem  # noqa: E402
from echo2p2p.hub.view.status import status  # noqa: E402
from echo2p2p.hub.run.loop import HubRun  # noqa: E402
from echo2p2p.hub_protocol import HubProtocol  # noqa: E402
from echo2p2p.tasks import AdditionTask  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ENGINES = ("vllm", "transformers")


def step_record(step: int, rng: random.Random) -> dict:
    """A run log step record of a long run (the keys the feed reads, plausible values)."""
    lags = {"0": rng.randint(0, 8), "1": rng.randint(0, 16), "2": rng.randint(0, 8)}
    record = {"step": step, "version": step + 1, "time_s": 1.7 * step,
              "train/reward_mean": 0.9 - 0.7 * math.exp(-step / 20_000) + rng.gauss(0, 0.03),
              "hub/learner_busy_frac": 0.8 + 0.05 * math.sin(step / 500),
              "rollout/per_s": 900 + rng.gauss(0, 40), "rollout/staleness_mean": 1.0,
              "rollout/staleness_hist": lags, "cost/usd_total": 0.0012 * step,
              "cost/usd_per_hour": 260 + 10 * math.sin(step / 3000)}
    if (step + 1) % 10 == 0:
        record["eval/accuracy"] = 0.85 - 0.6 * math.exp(-step / 20_000)
    return record


def propagation_record(version: int, peers: int) -> dict:
    base = 40 + version % 7
    return {"event": "propagation", "version": version, "peers": peers, "t50_s": base,
            "t90_s": 1.4 * base, "t100_s": 2.1 * base, "t_bcast_s": 1.5 * base,
            "predicted_bcast_s": 1.3 * base,
            "cdf_s": [round(base * 2.1 * (i / 10) ** 1.5, 2) for i in range(11)],
            "bytes_from_hub": 16e9 * 1.2, "bytes_from_peers": 16e9 * (peers - 1.2),
            "full_wire_bytes": 16e9, "delta_wire_bytes": None if version % 10 == 0 else 1.1e9,
            "peers_on_delta": peers - 3, "complete": True}


def join_peers(hub: Hub, n: int, rng: random.Random) -> None:
    """`n` welcomed peer connections (no sockets), with accounts, rates and held versions.
    No public face of the hub makes a thousand socket-less peers: this rig writes its peer
    table, pool and trust book (private) by hand, as the tracker's tests make peers."""
    now = asyncio.get_running_loop().time()  # the hub's clock
    for i in range(n):
        peer_id = f"p{i:05d}"
        proto = HubProtocol(now, 1 << 20)
        hello = m.Hello(f"peer-{i:04d}-{rng.choice(['a100', 'h100', '4090', 'l4'])}",
                        ENGINES[i % 2], "cuda", listen_addr=f"http://10.0.{i // 250}.{i % 250}:9000")
        proto.receive_frame(m.encode(hello), now)
        conn = Peer(peer_id, hello, proto, hub.core.outbox)
        proto.send(m.Welcome(peer_id=peer_id, run_id=hub.core.run_id, model="model",
                             task="addition", version=0, max_lag=2, group_size=8,
                             temperature=1.0, top_p=1.0, max_new_tokens=256, seed=i))
        proto.held_version = hub.core.step - i % 3
        conn.upload_bps, conn.relay = rng.uniform(50e6, 1e9), "ok"
        hub._peers[peer_id] = conn
        hub._pool.join(peer_id, hello.name, round(rng.uniform(0, 2.5), 2), generates=True, now=now)
        account = hub._pool.accounts[peer_id]
        account.gen_rollouts_per_s = rng.uniform(0.5, 3.0)
        if i % 5 == 4:
            account.active_since = None  # on standby
        if i % 100 == 7:
            hub._trust.quarantined.add(conn.identity)


def build(args: argparse.Namespace, run_dir: Path) -> tuple[HubRun, Feed]:
    rng = random.Random(1)
    cfg = HubConfig.from_flat(port=0, dashboard_port=0, run_dir=str(run_dir))
    task = AdditionTask()
    problems = [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]]
    hub = Hub(cfg, "scale-bench", task, problems)
    hub.core.step = args.steps
    runlog = RunLog(run_dir, {"run_id": hub.core.run_id}, stream=None)
    run = HubRun(cfg, hub, None, None, runlog, b"")
    join_peers(hub, args.peers, rng)
    feed = Feed()
    feed.record({"event": "eval", "version": 0, "eval/accuracy": 0.25})
    for step in range(args.steps):
        record = step_record(step, rng)
        runlog.staleness.update({int(k): v for k, v in record["rollout/staleness_hist"].items()})
        feed.record(record)
    for version in range(args.steps - 199, args.steps + 1):
        feed.record(propagation_record(version, args.peers))
    return run, feed


async def live(page: Page, send, kind: str, repeats: int) -> list[dict]:
    """`repeats` events of `kind`, each sent by `send(i)` once the page drew the last one;
    the page's apply and draw times of each."""
    seen = []
    for i in range(repeats):
        await page.evaluate(f"delete dashboard.timings.events.{kind}")
        send(i)
        drawn = await page.wait_for_function(  # read in the same turn: another may follow
            f"() => {{ const e = dashboard.timings.events.{kind}; return e && e.draw_ms != null && e; }}")
        seen.append(await drawn.json_value())
    return seen


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} {max(values):8.1f}"


async def measure(args: argparse.Namespace, run: HubRun, feed: Feed) -> dict:
    rng = random.Random(2)
    async with serve_dashboard(run, feed) as port, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = await browser.new_page(viewport={"width": 1400, "height": 900})
        await page.goto(f"http://127.0.0.1:{port}/")
        await page.wait_for_function("() => dashboard.timings.first_render_ms !== null",
                                     timeout=120_000)
        first = await page.evaluate("dashboard.timings")
        held = await page.evaluate("dashboard.lengths()")
        steps = await live(page, lambda i: feed.record(step_record(args.steps + i, rng)), "step",
                           args.repeats)
        statuses = await live(page, lambda i: feed.publish("status", status(run)), "status",
                              args.repeats)
        await page.fill("#peer-filter", "peer-09")
        await page.evaluate("new Promise(requestAnimationFrame)")
        filtered = await page.evaluate("[dashboard.timings.table_ms, dashboard.lengths().rows]")
        await browser.close()
    return {"first": first, "held": held, "steps": steps, "statuses": statuses,
            "filtered": filtered}


def server_side(run: HubRun, feed: Feed) -> dict:
    start = time.perf_counter()
    body = finite_json(snapshot(run, feed))
    snapshot_ms = 1000 * (time.perf_counter() - start)
    start = time.perf_counter()
    status_bytes = len(finite_json(status(run)))
    return {"snapshot_ms": snapshot_ms, "snapshot_bytes": len(body),
            "status_ms": 1000 * (time.perf_counter() - start), "status_bytes": status_bytes}


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run, feed = build(args, Path(tmp))
        server = server_side(run, feed)
        page = await measure(args, run, feed)
        run.runlog.close()
    return {"server": server, **page}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--peers", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    r = asyncio.run(main_async(args))
    first, server, held = r["first"], r["server"], r["held"]
    step_apply = [e["apply_ms"] for e in r["steps"]]
    step_draw = [e["draw_ms"] for e in r["steps"]]
    status_apply = [e["apply_ms"] for e in r["statuses"]]
    status_draw = [e["draw_ms"] for e in r["statuses"]]
    print(f"{args.steps} steps, {args.peers} peers; the page holds {held['steps']} step points, "
          f"{held['versions']} versions, {held['peers']} peers in {held['rows']} rows")
    print(f"{'':34s} {'median':>8s} {'max':>8s}")
    print(f"{'snapshot (server, ms / bytes)':34s} {server['snapshot_ms']:8.1f} {server['snapshot_bytes']:8d}")
    print(f"{'status (server, ms / bytes)':34s} {server['status_ms']:8.1f} {server['status_bytes']:8d}")
    print(f"{'first full render (page, ms)':34s} {first['first_render_ms']:8.1f}")
    print(f"{'  of which snapshot fetch+parse':34s} {first['snapshot_ms']:8.1f}")
    print(f"{'one step: apply (ms)':34s} {spread(step_apply)}")
    print(f"{'one step: draw (ms)':34s} {spread(step_draw)}")
    print(f"{'one status: apply (ms)':34s} {spread(status_apply)}")
    print(f"{'one status: draw (ms)':34s} {spread(status_draw)}")
    print(f"{'filter the table (ms, rows)':34s} {r['filtered'][0]:8.1f} {r['filtered'][1]:8d}")
    print(json.dumps({
        "bench": "dashboard_scale", "steps": args.steps, "peers": args.peers,
        "snapshot_bytes": first["snapshot_bytes"], "first_render_ms": round(first["first_render_ms"], 1),
        "step_ms": round(statistics.median(a + d for a, d in zip(step_apply, step_draw)), 2),
        "status_ms": round(statistics.median(a + d for a, d in zip(status_apply, status_draw)), 2),
        "filter_ms": round(r["filtered"][0], 2), "server_snapshot_ms": round(server["snapshot_ms"], 1),
        "server_status_ms": round(server["status_ms"], 1)}))


if __name__ == "__main__":
    main()
