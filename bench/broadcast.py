"""How long one version takes to reach N peers: star, our overlays and shardcast, raced.

The hub and every peer are separate processes, each in its own network namespace with its
uplink shaped to B by `tc tbf` (`netns.Testbed`); the hub publishes a random (incompressible)
version of M bytes and logs when each peer holds all of it, verified, and when its engine
serves it. Strategies:
- star: the hub uploads the version to every peer (`echo2-hub --relay star`);
- pipelined: the tracker: the hub uploads each chunk once to its owner, owners relay to the
  rest as soon as a chunk is verified (`echo2p2p.relay`), shares by the uplinks the hub timed;
- gossip: `--relay gossip`: the hub deals each chunk to one seeder and gives each peer a
  neighbour sample; peers spread the rest over links (`echo2p2p.gossip`);
- striped-chain: `--relay striped-chain`, the ECHO-2 paper's: a ring in which every chunk
  starts at its stripe's first hop and each peer relays to one child;
- shardcast: PyPI shardcast's relay tree (`shardcast_race.py`), same hosts, shaping and bytes.
Modes (each overlay, at the largest N): uniform; heterogeneous (every third uplink at B/4),
against the max-flow bound M / min(B_hub, (B_hub + sum of peer uplinks) / N); churn (25 % of
the peers SIGKILLed 0.35 M/B into the version), against the undisturbed time; nat (a
`--nat-fraction` of the peers run no chunk server); slow_peer (one uplink at B/20): when all
the others hold it, over M/B. Each run broadcasts two versions: the first before any uplink
was measured by a version ("first_version_ratio": its time over the second's), the second
timed. `--scale` adds the emulated sweep at 64-256 peers (`gossip_sweep.scale_sweep`: the
same pure cores, RTT 20-200 ms, loss-free token buckets).

    python bench/broadcast.py [--quick] [--peers 4,8,16] [--mbytes 16] [--rate-mbit 20]

Prints a table, writes broadcast.png (needs matplotlib), then one JSON line: {"bench":
"broadcast", "shaping", "n_peers", "bytes", "rate_bps", "chunk_bytes", and per strategy:
"ratio_to_ideal" (all peers hold it / (M/B)), "ratio_q90_reload" (90 % serve it, reload
included), "first_version_ratio", "heterogeneous_ratio_to_bound", "churn_ratio",
"slow_peer_ratio" (all but the slow peer hold it / (M/B)), "slow_peer_over_uniform" (that
time over the uniform one), "slow_peer_first_version_ratio", "nat": {"ratio_to_ideal",
"hub_upload_copies"}; "scale_sweep": {strategy: {N: {"ratio_to_ideal", "hub_upload_copies"}}}}.
Without root every process runs on 127.0.0.1 with an in-process token bucket instead
("shaping": "token-bucket"; no shardcast).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import netns  # noqa: E402
import shardcast_race  # noqa: E402

from bench.gossip_sweep import scale_sweep  # noqa: E402
from echo2p2p.snapshot import auto_chunk_bytes  # noqa: E402
from echo2p2p.hub.core.events import VersionPublished

HUB_PORT = 8765
RUN_TIMEOUT_S = 600.0


# --- the hub process: a tracker that publishes random versions --------------------------


async def hub_main(args: argparse.Namespace) -> None:
    """Publish v0 (tiny, to join on), then `rounds` random versions of `bytes` each; print one
    JSON line when each is published and its propagation record when it has spread."""
    from echo2p2p import signing
    from echo2p2p.tasks import AdditionTask
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.serving.app import serve
    from echo2p2p.hub.serving.server import Hub, TokenizedProblem
    from tests.blob_versions import blob_version

    cfg = HubConfig.from_flat(host=args.host, port=args.port, relay=args.relay, chunk_bytes=args.chunk_bytes,
                    upload_limit_mbps=args.limit_mbps, peer_timeout_s=120, heartbeat_s=5,
                    zstd_level=1, tcp_congestion=args.tcp_congestion)
    key = signing.new_private_key()
    task = AdditionTask()
    records: asyncio.Queue[dict] = asyncio.Queue()
    hub = Hub(cfg, "bench", task, [TokenizedProblem(task.problems("train")[0], [1])],
              key, on_event=records.put_nowait)
    async with serve(hub, cfg.network.host, cfg.network.port):
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 64)))
        while not (len(hub.peer_views()) == args.n_peers
                   and all(p.stream_version == 0 and (p.server_url is None or p.relay != "unprobed")
                           for p in hub.peer_views().values())):
            await asyncio.sleep(0.05)  # joining is not part of the race
        for version in range(1, args.rounds + 1):
            built = await asyncio.to_thread(blob_version, key, version, os.urandom(args.bytes),
                                            chunk_bytes=cfg.overlay.chunk_bytes, zstd_level=1)
            hub.feed(VersionPublished(built))
            print(json.dumps({"published": version}), flush=True)
            while ((record := await records.get()).get("event") != "propagation"
                   or record["version"] != version):
                pass
            print(json.dumps(record), flush=True)


# --- the orchestrator ---------------------------------------------------------------------


class Cluster:
    """A hub and N relay peers as processes, in a testbed's namespaces or on loopback."""

    def __init__(self, bed: netns.Testbed | None, n: int, relay: str, args: argparse.Namespace,
                 rates_bps: list[int], nat: float = 0.0):
        self.bed, self.procs = bed, []
        host = bed.hosts[0].ip if bed else "127.0.0.1"
        port = HUB_PORT if bed else _free_port()
        rounds = 1 if relay == "star" else 2  # one untimed round to measure uplinks
        limit = [] if bed else ["--limit-mbps", str(rates_bps[0] / 1e6)]
        self.hub = self._start(0, [sys.executable, __file__, "_hub", "--host", host, "--port",
                                   str(port), "--relay", relay, "--n-peers", str(n), "--bytes",
                                   str(args.bytes), "--chunk-bytes", str(args.chunk_bytes),
                                   "--rounds", str(rounds), "--tcp-congestion",
                                   args.tcp_congestion, *limit], stdout=subprocess.PIPE)
        self.rounds = rounds
        for i in range(1, n + 1):
            cap = [] if bed else ["--upload-limit-mbps", str(rates_bps[i] / 1e6)]
            nated = i <= round(nat * n)  # no listener: nobody can dial it
            listen = "" if nated else f"{bed.hosts[i].ip if bed else '127.0.0.1'}:0"
            self.procs.append(self._start(i, [
                sys.executable, "-m", "echo2p2p.peer.cli", "join", f"ws://{host}:{port}/ws",
                "--engine", "relay", "--name", f"peer{i}", "--listen", listen,
                "--log-level", "error", "--tcp-congestion", args.tcp_congestion, *cap]))

    def _start(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        kw.update(env=env, start_new_session=True, text=True)
        return self.bed.popen(i, argv, **kw) if self.bed else subprocess.Popen(argv, **kw)

    def timed_record(self, on_published=None) -> dict:
        """The propagation record of the last round, with the first round's as "first";
        `on_published()` runs as the last starts. After RUN_TIMEOUT_S a watchdog kills the
        hub, which ends the wait."""
        watchdog = threading.Timer(RUN_TIMEOUT_S, lambda: os.killpg(self.hub.pid, signal.SIGKILL))
        watchdog.start()
        try:
            first: dict = {}
            for line in self.hub.stdout:
                msg = json.loads(line)
                if msg.get("published") == self.rounds and on_published:
                    on_published()
                if msg.get("version") == 1:
                    first = msg
                if msg.get("version") == self.rounds:
                    return {**msg, "first": first}
        finally:
            watchdog.cancel()
        raise RuntimeError(f"hub ended or timed out without a record (exit {self.hub.poll()})")

    def close(self) -> None:
        for proc in [self.hub, *self.procs]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_ours(bed, n: int, relay: str, rates_bps: list[int], args, churn: float = 0.0,
             nat: float = 0.0) -> dict:
    """One broadcast with our hub and peers; the record plus 'all_s', the time by which every
    peer still alive held the version."""
    cluster = Cluster(bed, n, relay, args, rates_bps, nat)
    try:
        def kill_some():  # churn: a timer after publication, then SIGKILL a quarter of peers
            time.sleep(0.35 * args.bytes * 8 / rates_bps[0])
            for proc in random.Random(n).sample(cluster.procs, max(1, round(churn * n))):
                os.killpg(proc.pid, signal.SIGKILL)

        record = cluster.timed_record(kill_some if churn else None)
    finally:
        cluster.close()
    record["all_s"] = record["done_s"] if record["complete"] else None
    record["strategy"] = relay
    return record


def run_shardcast(bed, n: int, args) -> dict:
    payload = Path(args.workdir) / "payload.bin"
    payload.write_bytes(os.urandom(args.bytes))
    middles, clients = shardcast_race.default_topology(n)
    out = shardcast_race.run_shardcast(bed, origin=0, middles=middles, clients=clients,
                                       payload=payload, timeout_s=RUN_TIMEOUT_S,
                                       workdir=Path(args.workdir), shard_bytes=args.chunk_bytes)
    return {"all_s": out["completion_s"] if out["ok"] else None, "error": out["error"],
            "strategy": "shardcast"}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    ns = sorted(int(x) for x in args.peers.split(","))
    args.bytes = int(args.mbytes * 2**20)
    args.chunk_bytes = args.chunk_kib << 10 or auto_chunk_bytes(args.bytes)
    rate = int(args.rate_mbit * 1e6)
    ideal_s = args.bytes * 8 / rate
    strategies, modes = args.strategies.split(","), args.modes.split(",")
    why_not = netns.unavailable() if args.shaping == "tbf" else "--shaping token-bucket"
    shaping = "tbf" if why_not is None else "token-bucket"
    if why_not:
        print(f"no network namespaces ({why_not}): shaping in-process, without shardcast",
              file=sys.stderr)
        strategies = [s for s in strategies if s != "shardcast"]
    runs: dict[tuple[str, str, int], dict] = {}  # (mode, strategy, N) -> its record
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        if "uniform" in modes:
            for n in ns:
                for strategy in strategies:
                    runs[("uniform", strategy, n)] = _one(args, "uniform", strategy, n, rate,
                                                          shaping)
        for mode in ("heterogeneous", "churn", "nat", "slow_peer"):
            for strategy in OVERLAYS:
                if mode in modes and strategy in strategies:
                    runs[(mode, strategy, ns[-1])] = _one(args, mode, strategy, ns[-1], rate,
                                                          shaping)
    sweep = scale_sweep([int(x) for x in args.scale.split(",")]) if args.scale else {}
    _plot(runs, ns, args.plot, ideal_s, sweep)
    print(f"M = {args.bytes / 2**20:.0f} MiB, B = {rate / 1e6:.0f} Mbit/s, M/B = {ideal_s:.2f} s, "
          f"chunks of {args.chunk_bytes >> 10} KiB, shaping {shaping}")
    print(json.dumps({"bench": "broadcast", "shaping": shaping, "n_peers": ns[-1],
                      "bytes": args.bytes, "rate_bps": rate, "chunk_bytes": args.chunk_bytes,
                      **summary(runs, ns[-1], ideal_s, args.nat_fraction), "scale_sweep": sweep}))
    return 0


OVERLAYS = ("pipelined", "gossip", "striped-chain")  # the strategies every mode races
SLOW_DIVISOR = 20  # slow_peer mode: one uplink at B / 20 (1 Mbit/s against 20)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N = 8, M = 8 MiB: a few minutes")
    p.add_argument("--peers", default="4,8,16", help="values of N, comma-separated")
    p.add_argument("--mbytes", type=float, default=16, help="M, the version's size in MiB")
    p.add_argument("--rate-mbit", type=float, default=20, help="B, every uplink, Mbit/s")
    p.add_argument("--chunk-kib", type=int, default=0,
                   help="chunk (and shardcast shard) size; 0 = the hub's automatic choice")
    p.add_argument("--strategies", default="star,pipelined,gossip,striped-chain,shardcast")
    p.add_argument("--modes", default="uniform,heterogeneous,churn,nat,slow_peer")
    p.add_argument("--nat-fraction", type=float, default=0.5,
                   help="nat mode: the fraction of peers that accept no inbound connection")
    p.add_argument("--scale", default="8,16,64,256",
                   help="the emulated scale sweep's N values (bench/gossip_sweep.py); '' = none")
    p.add_argument("--tcp-congestion", default="cubic",
                   help="the hub's and peers' --tcp-congestion ('' = the machine's default)")
    p.add_argument("--plot", default="broadcast.png")
    p.add_argument("--netns-prefix", default="e2b",
                   help="the network namespaces' name prefix: runs beside each other need two")
    p.add_argument("--shaping", choices=("tbf", "token-bucket"), default="tbf",
                   help="token-bucket: no namespaces, every process on 127.0.0.1 with an "
                        "in-process uplink cap (the fallback when namespaces cannot be made)")
    args = p.parse_args(argv)
    if args.quick:
        args.peers, args.mbytes = "8", 8
    return args


def _rates(mode: str, n: int, rate: int) -> list[int]:
    if mode == "heterogeneous":
        return [rate] + [rate // 4 if i % 3 == 0 else rate for i in range(1, n + 1)]
    if mode == "slow_peer":
        return [rate] * n + [rate // SLOW_DIVISOR]
    return [rate] * (n + 1)


def _one(args, mode: str, strategy: str, n: int, rate: int, shaping: str) -> dict:
    """One broadcast in `mode`; its record (with "all_s", None if incomplete), printed."""
    rates = _rates(mode, n, rate)
    bed = netns.Testbed(n + 1, rates, prefix=args.netns_prefix) if shaping == "tbf" else None
    try:
        if strategy == "shardcast":
            result = run_shardcast(bed, n, args)
        else:
            result = run_ours(bed, n, strategy, rates, args, churn=0.25 if mode == "churn" else 0.0,
                              nat=args.nat_fraction if mode == "nat" else 0.0)
    finally:
        if bed:
            bed.close()
    ideal_s = args.bytes * 8 / rate
    result["bound_s"] = args.bytes * 8 / min(rates[0], sum(rates) / n)
    print(f"{mode:14s} {strategy:13s} N={n:3d}  {_fmt(result['all_s'])} s  ratio "
          f"{_fmt(result['all_s'] and result['all_s'] / ideal_s)}  hub copies "
          f"{_fmt(result.get('hub_upload_copies'))}"
          + (f"  ({result.get('error')})" if result.get("error") else ""), flush=True)
    return result


def summary(runs: dict, n: int, ideal_s: float, nat_fraction: float) -> dict:
    """The JSON line's figures at the largest N, per strategy (None where not run)."""
    def per(mode: str, figure) -> dict:
        out = {}
        for strategy in ("star", *OVERLAYS, "shardcast"):
            rec = runs.get((mode, strategy, n))
            out[strategy] = _round(figure(rec)) if rec and rec.get("all_s") else None
            if strategy == "shardcast" and mode != "uniform":
                del out[strategy]  # shardcast runs uniform links only
        return out

    uniform = {s: r for (mode, s, _), r in runs.items() if mode == "uniform"}
    return {
        "ratio_to_ideal": per("uniform", lambda r: r["all_s"] / ideal_s),
        "ratio_q90_reload": per("uniform", lambda r: r["t_bcast_s"] / ideal_s
                                if r.get("t_bcast_s") else None),
        "first_version_ratio": per("uniform", lambda r: r["first"]["done_s"] / r["all_s"]
                                   if r.get("first") else None),
        "heterogeneous_ratio_to_bound": per("heterogeneous", lambda r: r["all_s"] / r["bound_s"]),
        "churn_ratio": per("churn", lambda r: r["all_s"] / uniform[r["strategy"]]["all_s"]),
        "slow_peer_ratio": per("slow_peer", lambda r: _all_but_slowest(r) / ideal_s),
        "slow_peer_over_uniform": per("slow_peer", lambda r: _all_but_slowest(r)
                                      / uniform[r["strategy"]]["all_s"]
                                      if uniform.get(r["strategy"], {}).get("all_s") else None),
        "slow_peer_first_version_ratio": per(
            "slow_peer", lambda r: _all_but_slowest(r["first"]) / ideal_s),
        "nat": {"fraction": nat_fraction,
                "ratio_to_ideal": per("nat", lambda r: r["all_s"] / ideal_s),
                "hub_upload_copies": per("nat", lambda r: r["hub_upload_copies"])},
    }


def _all_but_slowest(record: dict) -> float:
    """When every peer but the one that finished last held the version."""
    times = sorted(record["done_by_peer_s"].values())
    return times[-2] if len(times) > 1 else times[-1]


def _plot(runs: dict, ns: list[int], path: str, ideal_s: float, sweep: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy in ("star", *OVERLAYS, "shardcast"):
        points = sorted((n, r["all_s"]) for (mode, s, n), r in runs.items()
                        if mode == "uniform" and s == strategy and r.get("all_s"))
        if points:
            ax.plot(*zip(*points), marker="o", label=strategy)
    ax.axhline(ideal_s, color="grey", linestyle="--", label="M/B")
    ax.set(xlabel="peers N", ylabel="time until every peer holds the version (s)", xticks=ns,
           title="real processes, every uplink a tc tbf at B")
    ax.legend()
    for strategy, series in sweep.items():
        xs = sorted(series)
        ax2.plot(xs, [series[n]["ratio_to_ideal"] for n in xs], marker="o", label=strategy)
    ax2.axhline(1.0, color="grey", linestyle="--", label="M/B")
    ax2.set(xscale="log", xlabel="emulated peers N", ylabel="time / (M/B)",
            title="scale sweep: RTT 20-200 ms, token buckets")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(x: float | None) -> str:
    return "   -  " if x is None else f"{x:6.2f}"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _hub_entry(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    for flag, typ in (("--host", str), ("--port", int), ("--relay", str), ("--n-peers", int),
                      ("--bytes", int), ("--chunk-bytes", int), ("--rounds", int),
                      ("--limit-mbps", float), ("--tcp-congestion", str)):
        p.add_argument(flag, type=typ, default=0.0 if typ is float else None)
    asyncio.run(hub_main(p.parse_args(argv)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["_hub"]:
        _hub_entry(sys.argv[2:])
    else:
        sys.exit(main())
