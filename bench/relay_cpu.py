"""CPU per relayed byte: what the hub and each peer process spend to move one version.

The hub and N relay peers run as `bench/broadcast.py` starts them (its `Cluster`: real
processes, real websockets and chunk servers), on 127.0.0.1 without any uplink cap by default,
or, with `--shaping tbf`, in network namespaces with every uplink a tc tbf at --rate-mbit. Use
tbf for figures that count: CPU per byte depends on the rate, since paced packets arrive one
or two at a time and each wakes the event loop (unshaped, segments are large and few); and on
the box's load (a busy box wakes a process less often, so more packets per wake-up). The hub
publishes two versions of M random bytes (the first to time uplinks); each process's CPU
(utime + stime from /proc/PID/stat, all threads, and the event loop's thread alone from
/proc/PID/task/PID/stat) is read when the second is published and when the hub logs that
every peer holds it. Reported per strategy and M: the hub's CPU per MiB it uploaded, a peer's
(mean) per MiB received and per MiB moved (received + its share of the peers' uploads), the
event loop's share, the kernel's share, and the CPU all processes demand at B: their CPU
seconds over M/B, in cores (against the 2 of the box the broadcast bench runs on).

Measured (8 peers, 20 Mbit/s tbf, 2 cores shared with other test suites, the box 90-100 %
busy), a peer's CPU per MiB received: unshaped 0.013 (pipelined) / 0.018 (gossip); tbf, 8 MiB
(64 KiB chunks) 0.034-0.051 / 0.057-0.063; 64 MiB (128 KiB chunks) 0.042 / 0.040, all
processes 0.8 cores at M/B. The loop thread is 80-90 % of a peer's CPU (blake2b and zstd run
in worker threads), the kernel 26-37 %. Reading chunk bodies with a receive low-water mark
(`echo2p2p.overlay.fetch`) took pipelined to 0.025 at 64 MiB (0.5 cores at M/B) without
changing its time to M/B: at this rate the CPU does not decide the race.

    python bench/relay_cpu.py [--peers 8] [--mbytes 8,64] [--strategies pipelined,gossip]
                              [--shaping none|tbf] [--profile DIR]

`--profile DIR`: peer 1 runs under cProfile (its event-loop thread only; the worker threads'
CPU is what "loop %" leaves), written to DIR/peer1-STRATEGY-M.prof with its top entries
printed. Ends with one JSON line {"bench": "relay_cpu", "n_peers", "rate_bps", "runs": [{
"strategy", "mbytes", "wall_s", "hub_cpu_s", "hub_s_per_mib_up", "hub_loop_share",
"peer_cpu_s" (mean), "peer_s_per_mib_received", "peer_s_per_mib_moved", "peer_loop_share",
"total_cpu_s", "system_share" (kernel time in it), "cores_at_rate" (total CPU over M/B),
"box_busy" (the whole box's CPUs busy during the round, anyone's)}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import netns  # noqa: E402

from bench.broadcast import Cluster  # noqa: E402
from echo2p2p.snapshot import auto_chunk_bytes  # noqa: E402

MIB = 1 << 20
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> tuple[float, float, float]:
    """(all threads, the main thread, system time of all threads) CPU seconds of process
    `pid`: utime + stime, but the last."""
    def read(path: str) -> tuple[float, float]:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) / TICKS, int(fields[12]) / TICKS  # utime, stime: fields 14, 15

    user, system = read(f"/proc/{pid}/stat")
    return user + system, sum(read(f"/proc/{pid}/task/{pid}/stat")), system


def box_busy() -> tuple[float, float]:
    """(busy, all) jiffies of every CPU of the box since boot (/proc/stat: busy = all but idle
    and iowait), whoever used them: the others' processes, softirqs, the kernel's shaping."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


class ProfiledCluster(Cluster):
    """`Cluster` whose peer 1 runs under cProfile, writing `profile_path` when it stops."""

    profile_path: str | None = None

    def _start(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        if i == 1 and self.profile_path and argv[1:3] == ["-m", "echo2p2p.peer.cli"]:
            argv = [argv[0], "-m", "cProfile", "-o", self.profile_path, *argv[1:]]
        return super()._start(i, argv, **kw)


def measure(args: argparse.Namespace, strategy: str, mbytes: float) -> dict:
    """One cluster, one timed version: the CPU figures of the hub and the peers."""
    args.bytes = int(mbytes * MIB)
    args.chunk_bytes = args.chunk_kib << 10 or auto_chunk_bytes(args.bytes)
    rate = int(args.rate_mbit * 1e6)
    n = args.peers
    bed = netns.Testbed(n + 1, rate, prefix="transport") if args.shaping == "tbf" else None
    ProfiledCluster.profile_path = (str(Path(args.profile) / f"peer1-{strategy}-{mbytes:g}.prof")
                                    if args.profile else None)
    cluster = None
    try:
        cluster = ProfiledCluster(bed, n, strategy, args, [0] * (n + 1))
        procs = [cluster.hub, *cluster.procs]
        before: list[tuple[float, float, float]] = []
        box: list[tuple[float, float]] = []

        def published() -> None:
            before.extend(cpu_s(p.pid) for p in procs)
            box.append(box_busy())

        record = cluster.timed_record(published)
        after = [cpu_s(p.pid) for p in procs]
        box.append(box_busy())
        if ProfiledCluster.profile_path:  # cProfile writes its file on a clean exit
            cluster.procs[0].send_signal(signal.SIGTERM)
            cluster.procs[0].wait(timeout=60)
    finally:
        if cluster is not None:
            cluster.close()
        if bed is not None:
            bed.close()
    out = {"strategy": strategy, "mbytes": mbytes, "chunk_bytes": args.chunk_bytes,
           **figures(record, before, after, box, n, rate)}
    if ProfiledCluster.profile_path and Path(ProfiledCluster.profile_path).exists():
        print(f"--- peer 1, {strategy}, {mbytes:g} MiB: top by own time (event-loop thread)")
        pstats.Stats(ProfiledCluster.profile_path, stream=sys.stdout).sort_stats(
            "tottime").print_stats(args.profile_top)
    return out


def figures(record: dict, before: list, after: list, box: list, n: int, rate: int) -> dict:
    """The round's figures from the hub's record and the CPU and box readings around it."""
    used = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
    system = sum(a[2] - b[2] for a, b in zip(after, before))
    wire_mib = record["full_wire_bytes"] / MIB
    peers = used[1:]
    peer_cpu = sum(c for c, _ in peers) / n
    peer_up_mib = record["bytes_from_peers"] / MIB / n
    total = sum(c for c, _ in used)
    ideal_s = record["full_wire_bytes"] * 8 / rate
    return {
        "wall_s": record["done_s"], "complete": record["complete"],
        "hub_upload_copies": record["hub_upload_copies"],
        "hub_cpu_s": round(used[0][0], 2),
        "hub_s_per_mib_up": _per(used[0][0], record["bytes_from_hub"] / MIB),
        "hub_loop_share": _per(used[0][1], used[0][0]),
        "peer_cpu_s": round(peer_cpu, 2),
        "peer_cpu_max_s": round(max(c for c, _ in peers), 2),
        "peer_s_per_mib_received": _per(peer_cpu, wire_mib),
        "peer_s_per_mib_moved": _per(peer_cpu, wire_mib + peer_up_mib),
        "peer_loop_share": _per(sum(m for _, m in peers), sum(c for c, _ in peers)),
        "total_cpu_s": round(total, 2),
        "system_share": _per(system, total),
        "cores_at_rate": _per(total, ideal_s),
        "box_busy": _per(box[1][0] - box[0][0], box[1][1] - box[0][1]),
    }


def _per(x: float, y: float) -> float | None:
    return round(x / y, 4) if y > 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--mbytes", default="8,64", help="values of M in MiB, comma-separated")
    p.add_argument("--strategies", default="pipelined,gossip")
    p.add_argument("--chunk-kib", type=int, default=0, help="0 = the hub's automatic choice")
    p.add_argument("--rate-mbit", type=float, default=20,
                   help="B: the rate 'cores_at_rate' is figured at, and tbf's")
    p.add_argument("--shaping", choices=("none", "tbf"), default="none")
    p.add_argument("--tcp-congestion", default="cubic")
    p.add_argument("--profile", default="", help="a folder: profile peer 1 into it")
    p.add_argument("--profile-top", type=int, default=25)
    args = p.parse_args(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    if args.shaping == "tbf" and (why := netns.unavailable()):
        p.error(f"--shaping tbf: {why}")
    runs = []
    print(f"{'strategy':10s} {'M MiB':>5s} {'wall s':>6s}  {'hub s/MiB up':>12s} "
          f"{'peer s/MiB recv':>15s} {'peer s/MiB moved':>16s} {'loop %':>6s} "
          f"{'total CPU s':>11s} {'sys %':>5s} {'cores at B':>10s} {'box busy %':>10s}")
    for mbytes in [float(x) for x in args.mbytes.split(",")]:
        for strategy in args.strategies.split(","):
            r = measure(args, strategy, mbytes)
            runs.append(r)
            print(f"{strategy:10s} {mbytes:5g} {r['wall_s']:6.2f}  "
                  f"{r['hub_s_per_mib_up'] or 0:12.4f} "
                  f"{r['peer_s_per_mib_received']:15.4f} {r['peer_s_per_mib_moved']:16.4f} "
                  f"{100 * (r['peer_loop_share'] or 0):6.0f} {r['total_cpu_s']:11.2f} "
                  f"{100 * (r['system_share'] or 0):5.0f} {r['cores_at_rate']:10.2f} "
                  f"{100 * r['box_busy']:10.0f}", flush=True)
    print(json.dumps({"bench": "relay_cpu", "n_peers": args.peers, "shaping": args.shaping,
                      "rate_bps": int(args.rate_mbit * 1e6), "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
