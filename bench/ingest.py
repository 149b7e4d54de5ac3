"""How fast the hub admits rollouts: 64 websocket peers on loopback, 256-token rollouts.

The hub side is the real network shell (`echo2p2p.hub.serving.server.Hub` behind aiohttp: session validation,
lease book, staleness check, each sample's token ids decoded and scored with the task verifier
in the scorer's worker processes, buffer, acks); a drain task stands in for the learner and
discards batches, so this measures ingest alone. The peers run in a second process (one event
loop, N connections) so the hub gets a core of its own; the scoring workers need cores too.

Phase 1 (saturation): every peer submits as soon as it holds a lease -> admitted rollouts/s.
Phase 2 (half load): peers pace submissions to half that rate -> p99 submit-to-ack latency.

    python bench/ingest.py [--peers 64] [--seconds 8] [--tokens 256] [--group-size 8]
                           [--score-workers 1]

Prints a table, then one JSON line: {"bench": "ingest", "rollouts_per_s": ..., "p99_ack_ms": ...,
"round_trips_per_group": ..., "hub_file": ...} (a phase with no ack has None latencies; the
file says which tree's hub ran). A rollout is one completion; a submission carries a group of
G of them. To compare commits, each in an environment of its own: `bench/ingest_compare.py`.

With --dashboard-clients N the hub process also serves the live dashboard on the hub's loop
(`echo2p2p.hub.view.dashboard`: a feed given a step record per drained batch, as the learner loop
gives it, and the status event every 2 s), and saturation phases alternate without and with
N clients (0, N, N, 0 per round, after a warm-up) in a third process that behave as the page
does: GET /, its static files and /api/snapshot once, then hold /events open and parse every
event. It prints each phase's admitted rollouts/s and the ratio with/without clients, then
{"bench": "ingest_dashboard", "ratio": ..., ...}.

    python bench/ingest.py --dashboard-clients 20 [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import resource
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

import echo2p2p.hub  # noqa: E402
from echo2p2p import messages as m  # noqa: E402
from echo2p2p.completions import CompletionDecoder  # noqa: E402
from echo2p2p.session import Session, Side  # noqa: E402
from echo2p2p.tasks import AdditionTask  # noqa: E402
from echo2p2p.hub.config import HubConfig  # noqa: E402
from echo2p2p.hub.view.dashboard import STATIC, serve_dashboard  # noqa: E402
from echo2p2p.hub.view.feed import Feed  # noqa: E402
from echo2p2p.hub.view.runlog import RunLog  # noqa: E402
from echo2p2p.hub.serving.server import Hub, TokenizedProblem  # noqa: E402
from echo2p2p.hub.run.loop import HubRun  # noqa: E402
from echo2p2p.staleness import lag_versions  # noqa: E402
from tests.conftest import wait_until  # noqa: E402


# --- peers (second process) ------------------------------------------------------------------


async def peer(url: str, args: argparse.Namespace, rate: float, until: float, lat: list[float],
               counts: list[int], decoder: CompletionDecoder) -> None:
    rng = random.Random()
    rows = [[rng.randrange(4, decoder.vocab_size) for _ in range(args.tokens)]  # no special ids
            for _ in range(args.group_size)]
    # Honest texts, as an engine decodes them: the hub decodes every sample's ids and counts a
    # text that differs as a lie.
    samples = [m.Sample(m.pack_ids(row), m.pack_logprobs([-rng.random() for _ in row]),
                        decoder.completion(row).text, 0.0, "length") for row in rows]
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        session = Session(Side.PEER, 0.0)
        await ws.send_bytes(session.send(m.Hello("bench", "transformers", "cpu")))
        session.receive((await ws.receive()).data, 0.0)
        await ws.send_bytes(session.send(m.LeaseRequest(4)))
        sent_at: dict[str, float] = {}
        leases: asyncio.Queue[m.LeaseGrant] = asyncio.Queue()

        async def submit() -> None:  # a task of its own, so acks are read while it waits
            next_send = time.perf_counter() + (rng.random() / rate if rate else 0.0)
            while (lease := await leases.get()) is not None:
                if rate:  # paced: a fixed schedule, so queueing delay is not hidden
                    await asyncio.sleep(max(0.0, next_send - time.perf_counter()))
                    next_send = max(next_send + 1.0 / rate, time.perf_counter())
                sent_at[lease.lease_id] = time.perf_counter()
                await ws.send_bytes(session.send(m.RolloutSubmission(lease.lease_id, 0, samples)))
                await ws.send_bytes(session.send(m.LeaseRequest(1)))

        submitter = asyncio.create_task(submit())
        async for frame in ws:
            msg = session.receive(frame.data, 0.0)
            now = time.perf_counter()
            if isinstance(msg, m.Ack):
                lat.append(now - sent_at.pop(msg.lease_id))
                counts[0] += 1
            elif isinstance(msg, m.LeaseGrant):
                leases.put_nowait(None if now >= until else msg)
                if now >= until:
                    break
        await submitter


async def peers_main(args: argparse.Namespace) -> None:
    from echo2p2p.policy.model import build_char_tokenizer

    decoder = CompletionDecoder(build_char_tokenizer())  # before the clock: imports transformers
    lat: list[float] = []
    counts = [0]
    start = time.perf_counter()
    until = start + args.seconds
    rate = args.rate / args.peers if args.rate else 0.0
    await asyncio.gather(*(peer(args.url, args, rate, until, lat, counts, decoder)
                           for _ in range(args.peers)))
    lat.sort()
    print(json.dumps({"acks": counts[0], "seconds": time.perf_counter() - start,
                      "p50_ms": 1e3 * lat[len(lat) // 2] if lat else None,
                      "p99_ms": 1e3 * lat[int(len(lat) * 0.99)] if lat else None}))


# --- dashboard clients (third process) -------------------------------------------------------


async def browser(base: str, n: int, counts: Counter) -> None:
    """One open dashboard page: its files and snapshot once, then every event, parsed."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        for path in ("/", *(f"/static/{name}" for name in STATIC), "/api/snapshot"):
            async with http.get(base + path) as r:
                body = await r.read()
                assert r.status == 200, (path, r.status)
        json.loads(body)
        async with http.get(base + "/events") as stream:
            buffer, subscribed = b"", False
            async for chunk in stream.content.iter_any():
                if not subscribed:  # the hello came: the hub has it subscribed
                    subscribed = True
                    counts["connected"] += 1
                    if counts["connected"] == n:
                        print("ready", flush=True)
                counts["bytes"] += len(chunk)
                *events, buffer = (buffer + chunk).split(b"\n\n")
                for event in events:
                    if b"\ndata: " in event:
                        json.loads(event.split(b"\ndata: ", 1)[1])
                        counts["events"] += 1


async def browsers_main(args: argparse.Namespace) -> None:
    """N browsers until SIGTERM; prints what they read."""
    counts: Counter = Counter()
    tasks = [asyncio.ensure_future(browser(args.url, args.dashboard_clients, counts))
             for _ in range(args.dashboard_clients)]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for task in tasks:
        task.cancel()
    ended = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [repr(e) for e in ended if isinstance(e, Exception)]  # cancelled is not one
    print(json.dumps({**counts, "failed": failed}), flush=True)


@contextlib.asynccontextmanager
async def browsers(base: str, n: int):
    """`n` open pages in a third process, connected on entry; yields what they read (filled
    on exit)."""
    read: dict = {}
    if n == 0:
        yield read
        return
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--browsers-process", "--url", base,
        "--dashboard-clients", str(n), stdout=asyncio.subprocess.PIPE)
    assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
    try:
        yield read
    finally:
        proc.terminate()
        out, _ = await proc.communicate()
        read.update(json.loads(out.decode().strip().splitlines()[-1]))


# --- hub (this process) ----------------------------------------------------------------------


async def phase(hub: Hub, url: str, args: argparse.Namespace, rate: float) -> dict:
    before = hub.statistics().admitted_samples
    t0 = time.perf_counter()
    cpu0, kids0 = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--peers-process", "--url", url, "--peers", str(args.peers),
        "--seconds", str(args.seconds), "--tokens", str(args.tokens),
        "--group-size", str(args.group_size), "--rate", str(rate), stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    elapsed = time.perf_counter() - t0
    result = json.loads(out.decode().strip().splitlines()[-1])
    result["rollouts_per_s"] = (hub.statistics().admitted_samples - before) / result["seconds"]
    result["elapsed_s"] = elapsed
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["hub_cpu"] = (time.process_time() - cpu0) / elapsed
    result["peers_cpu"] = (kids.ru_utime + kids.ru_stime - kids0.ru_utime - kids0.ru_stime) / elapsed
    return result


async def drain(hub: Hub, run: HubRun | None = None) -> None:
    """Stands in for the learner: takes every batch at once (and with a `run`, logs a step
    record of it, which the dashboard's feed gets)."""
    start, step = time.perf_counter(), 0
    while True:
        batch = await hub.wait_batch()
        if run is not None:
            record = step_record(hub, run, step, batch, time.perf_counter() - start)
            run.records.append(record)
            run.runlog.step(record)
        step += 1


def step_record(hub: Hub, run: HubRun, step: int, batch: list, time_s: float) -> dict:
    """A step record with the learner loop's keys (`HubRun._record`), from the batch."""
    lags = Counter(lag_versions(hub.core.step, g.version) for g in batch)
    run.runlog.staleness.update(lags)
    rewards = [r for g in batch for r in g.rewards]
    c = hub.statistics()
    return {"step": step, "version": step + 1, "time_s": round(time_s, 3),
            "train/reward_mean": sum(rewards) / len(rewards), "train/policy_loss": 0.0,
            "rollout/staleness_hist": {str(k): v for k, v in sorted(lags.items())},
            "rollout/staleness_mean": sum(k * v for k, v in lags.items()) / len(batch),
            "rollout/leases": [g.lease_id for g in batch],
            "rollout/per_s": c.admitted_samples / max(time_s, 1e-9),
            "rollout/admitted_groups_total": c.admitted_groups,
            "rollout/stale_on_arrival_total": c.stale_on_arrival,
            "hub/learner_busy_frac": 0.0, "hub/peers": c.peers,
            **run.capacity_metrics(), **hub.statistics().cost}


async def with_dashboard(hub: Hub, url: str, args: argparse.Namespace) -> list[tuple[int, dict]]:
    """The dashboard on this loop; a warm-up, then rounds of saturation phases with 0, N, N
    and 0 browsers (ABBA: a drift in time weighs on both sides alike)."""
    with tempfile.TemporaryDirectory() as run_dir:
        run = HubRun(hub.core.cfg, hub, None, None, RunLog(Path(run_dir), {}, stream=None), b"")
        feed = Feed()
        run.runlog.listeners.append(feed.record)
        results = []
        async with asyncio.TaskGroup() as tg, serve_dashboard(run, feed, port=0) as port:
            drainer = tg.create_task(drain(hub, run))
            base = f"http://127.0.0.1:{port}"
            await phase(hub, url, replace_seconds(args, args.seconds / 2), rate=0.0)  # warm-up
            n = args.dashboard_clients
            for clients in [0, n, n, 0] * args.rounds:
                async with browsers(base, clients) as read:
                    await wait_until(lambda: feed.clients == clients, 30)  # gone ones, at the next write
                    result = await phase(hub, url, args, rate=0.0)
                results.append((clients, {**result, "read": read}))
            drainer.cancel()
        return results


def replace_seconds(args: argparse.Namespace, seconds: float) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "seconds": seconds})


def report_dashboard(results: list[tuple[int, dict]], args: argparse.Namespace) -> None:
    print(f"{'phase':<7}{'browsers':>9}{'rollouts/s':>12}{'hub CPU':>9}{'events read':>13}"
          f"{'MB read':>9}")
    for i, (clients, r) in enumerate(results):
        print(f"{i + 1:<7}{clients:>9}{r['rollouts_per_s']:>12.0f}{r['hub_cpu']:>9.2f}"
              f"{r['read'].get('events', 0):>13}{r['read'].get('bytes', 0) / 1e6:>9.2f}")
    without = [r["rollouts_per_s"] for c, r in results if c == 0]
    with_ = [r["rollouts_per_s"] for c, r in results if c]
    ratio = (sum(with_) / len(with_)) / (sum(without) / len(without))
    print(f"with {args.dashboard_clients} open dashboards: {ratio:.3f} x the admitted rollouts/s "
          f"without ({args.peers} peers, {args.seconds:.0f} s per phase, "
          f"uvloop={'uvloop' in sys.modules})")
    print(json.dumps({"bench": "ingest_dashboard", "clients": args.dashboard_clients,
                      "ratio": round(ratio, 4),
                      "rollouts_per_s_without": round(sum(without) / len(without)),
                      "rollouts_per_s_with": round(sum(with_) / len(with_)),
                      "phases": [[c, round(r["rollouts_per_s"])] for c, r in results],
                      "peers": args.peers, "seconds": args.seconds}))


async def hub_main(args: argparse.Namespace) -> None:
    from echo2p2p.policy.model import build_char_tokenizer

    cfg = HubConfig.from_flat(port=0, group_size=args.group_size, prompts_per_step=128,
                    max_new_tokens=args.tokens, max_lag=1, score_workers=args.score_workers,
                    joins_per_min=0, joins_per_min_total=0)  # every emulated peer joins at
    # once from 127.0.0.1, once a phase: the join limits are not what this measures
    task = AdditionTask()
    problems = [TokenizedProblem(p, [ord(c) % 100 for c in p.prompt]) for p in task.problems("train")]
    hub = Hub(cfg, "bench", task, problems, decode=CompletionDecoder(build_char_tokenizer()))
    app = web.Application()
    app.router.add_get("/ws", hub.routes()["/ws"])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"ws://127.0.0.1:{runner.addresses[0][1]}/ws"
    async with hub:  # on the way out the peers are sent away and the scorer closed
        await hub.scorer.start()  # its workers start now, not in the timed phases
        if args.dashboard_clients:
            results = await with_dashboard(hub, url, args)
        else:
            async with asyncio.TaskGroup() as tg:
                drainer = tg.create_task(drain(hub))
                full = await phase(hub, url, args, rate=0.0)
                half_rate_groups = full["rollouts_per_s"] / args.group_size / 2
                # Half of nothing would be an unpaced phase (rate 0): none is run, its figures
                # are None.
                half = await phase(hub, url, args, rate=half_rate_groups) if half_rate_groups \
                    else {"rollouts_per_s": 0.0, "p50_ms": None, "p99_ms": None, "hub_cpu": 0.0,
                          "peers_cpu": 0.0}
                drainer.cancel()
            scoring = hub.statistics().scoring
    await runner.cleanup()
    if args.dashboard_clients:
        report_dashboard(results, args)
        return
    print(f"{'phase':<12}{'rollouts/s':>12}{'groups/s':>10}{'p50 ack ms':>12}{'p99 ack ms':>12}"
          f"{'hub CPU':>9}{'peers CPU':>11}")
    for name, r in (("saturation", full), ("half load", half)):
        print(f"{name:<12}{r['rollouts_per_s']:>12.0f}{r['rollouts_per_s'] / args.group_size:>10.0f}"
              f"{ms(r['p50_ms']):>12}{ms(r['p99_ms']):>12}{r['hub_cpu']:>9.2f}"
              f"{r['peers_cpu']:>11.2f}")
    print(f"({args.peers} peers, {args.tokens}-token rollouts with logprobs, G={args.group_size}, "
          f"{args.seconds:.0f} s per phase, uvloop={'uvloop' in sys.modules})")
    print(f"(scored from the ids by {args.score_workers} worker process(es): {scoring.calls} "
          f"groups in {scoring.round_trips} round trips, {scoring.timeouts} timeouts)")
    print(f"(hub imported from {Path(echo2p2p.hub.__file__).parent})")
    print(json.dumps({"bench": "ingest", "rollouts_per_s": round(full["rollouts_per_s"]),
                      "p99_ack_ms": half["p99_ms"] and round(half["p99_ms"], 2),
                      "p99_ack_saturation_ms": full["p99_ms"] and round(full["p99_ms"], 2),
                      "peers": args.peers, "tokens": args.tokens, "group_size": args.group_size,
                      "groups_per_s": round(full["rollouts_per_s"] / args.group_size),
                      "half_load_rollouts_per_s": round(half["rollouts_per_s"]),
                      "round_trips_per_group": scoring.calls and round(
                          scoring.round_trips / scoring.calls, 3),
                      "hub_file": echo2p2p.hub.__file__}))


def ms(value: float | None) -> str:
    """A latency for the table: '-' when its phase got no ack."""
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=64)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--score-workers", type=int, default=1, help="the hub's scoring processes")
    p.add_argument("--dashboard-clients", type=int, default=0,
                   help="also serve the dashboard, and alternate phases with this many open pages")
    p.add_argument("--rounds", type=int, default=1, help="with --dashboard-clients: ABBA rounds")
    p.add_argument("--peers-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--browsers-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    if args.browsers_process:
        run(browsers_main(args))
    else:
        run(peers_main(args) if args.peers_process else hub_main(args))


if __name__ == "__main__":
    main()
