"""The competitor: one file broadcast with PyPI `shardcast` 0.3.2 on a `netns.Testbed`.

shardcast (Prime Intellect's INTELLECT-2 weight distributor) is a relay tree over HTTP. The
origin's `OriginServer.broadcast(path, shard_size)` cuts the file into `v1/shard_00001.bin, ...`
in its data directory and adds `v1: <blake3>|<n_shards>` to `distribution.txt`. A
`MiddleNode(upstreams, data_dir, port, check_interval)` polls its upstream's `distribution.txt`
every check_interval, copies it into its own data directory at once, then fetches every shard
(SHARDCAST_MAX_CONCURRENT_DOWNLOADS at a time, one `wget` process each) and serves them. A
`ClientNode(servers, output_dir)` lists versions, and `download_version("v1", out)` fetches every
shard, reassembles the file and checks its blake3. A client asking its middle for a shard the
middle does not hold yet gets a 404 and retries after SHARDCAST_FAST_RETRY_INTERVAL: that is how
the tree pipelines. Every server is `http.server.HTTPServer`: one request at a time.

The race: each node is a process in its own host namespace, started one at a time, each waiting
for the previous to say "ready". The clock starts when `broadcast()` returns (the version is on
offer) and stops, per host, when the parent first sees that host hold all M bytes (middles: all
shard files, clients: the reassembled file), polling the file system every 20 ms; contents are
hashed afterwards, outside the clock. Node logs stay in `<workdir>/shardcast/h<i>.log`.
Quirks of 0.3.2, worked around with its own knobs, never patched:
- a downloader first fetches `data1.bin` from every server "to measure" it: we put one there;
- downloaders write the fixed scratch file /tmp/dummy.bin at start-up (hence the one-at-a-time
  start) and `temp_distribution.txt` next to their own source: each host gets its own copy of the
  package, as it would on its own machine;
- a server's listen backlog is 5: more concurrent downloads than that from one server overflow it,
  SYNs are dropped and connections stall >= 1 s (measured: 20-50% slower at the default 10);
- a client with several servers asks a random one for the version list, and middles that have
  not polled yet list nothing: it then gives up, or guesses the shard count and waits out three
  misses at the end. So each client gets one middle;
- retry intervals are whole seconds (int() of an env var); MiddleNode's check_interval is a float.

    python bench/shardcast_race.py --selftest
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import netns

SCRIPT = str(Path(__file__).resolve())
PORT = 8000
POLL_S = 0.02
ACCEPT_QUEUE = 5
"""Connections a shardcast server queues (socketserver's request_queue_size) beyond the one it
serves: the downloads that share one server are kept within it."""
DUMMY_BYTES = 64 * 1024
"""Size of data1.bin, shardcast's start-up "bandwidth" probe; any non-empty file works."""


def default_topology(n_peers: int) -> tuple[list[int], list[int]]:
    """(middles, clients) over host indices 1..n_peers; host 0 is the origin.

    shardcast's docs show the tiers but recommend no count. The origin sends the whole file to
    each of k middles (k M/B on its uplink) and each middle serves it to (n-k)/k clients
    ((n-k)/k M/B on its uplink); as clients pipeline behind their middle the broadcast takes
    about max(k, (n-k)/k) M/B, least at k ~ sqrt(n). run_shardcast gives client j middle j mod k
    (or the origin, when there are no middles).
    """
    k = max(1, round(math.sqrt(n_peers)))
    peers = list(range(1, n_peers + 1))
    return peers[:k], peers[k:]


def run_shardcast(testbed: netns.Testbed, *, origin: int, middles: list[int], clients: list[int],
                  payload: Path, timeout_s: float, workdir: Path, shard_bytes: int = 1 << 20,
                  check_interval_s: float = POLL_S, retry_interval_s: int = 0) -> dict:
    """Broadcast payload from host origin through middles to clients; time it.

    Returns {"completion_s", "per_host_s": {host: s}, "prepare_s" (the origin's sharding, before
    the clock), "ok", "error"}. check_interval_s: how often middles poll the origin.
    retry_interval_s: how long a downloader waits after a failed fetch, mostly a 404 from a
    middle that has not got the shard yet. shardcast allows whole seconds: 0 (its shortest)
    retries at once, re-spawning wget in a loop (costs CPU on a shared machine); 1 makes clients
    lag their middle by up to a second per miss.
    """
    size = payload.stat().st_size
    n_shards = math.ceil(size / shard_bytes)
    want = _sha256([payload])
    root = workdir / "shardcast"
    shutil.rmtree(root, ignore_errors=True)
    env = {**os.environ, "SHARDCAST_FAST_RETRY_INTERVAL": str(retry_interval_s),
           "SHARDCAST_SLOW_RETRY_INTERVAL": str(retry_interval_s)}
    url = {i: f"http://{testbed.hosts[i].ip}:{PORT}" for i in [origin, *middles]}
    upstreams = middles or [origin]
    served_by = {i: upstreams[j % len(upstreams)] for j, i in enumerate(clients)}
    procs: dict[int, subprocess.Popen] = {}
    per_host_s: dict[int, float] = {}
    prepare_s = None
    deadline = time.monotonic() + timeout_s

    def start(i: int, fan_out: int, *node_args: str) -> None:
        _start_node(testbed, procs, root, env, deadline, i, fan_out, *node_args)

    try:
        start(origin, 1, "origin", _data_dir(root, origin), str(shard_bytes))
        for i in middles:
            start(i, len(middles), "middle", _data_dir(root, i), url[origin], str(check_interval_s))
        for i, m in served_by.items():
            fan_out = list(served_by.values()).count(m)
            start(i, fan_out, "client", str(root / f"h{i}"), url[m])
        procs[origin].stdin.write(f"{payload}\n")
        procs[origin].stdin.flush()
        t_call, t0 = map(float, _wait_line(procs[origin], "offered", deadline, "origin")[1:])
        prepare_s = t0 - t_call
        files = _wait_all(procs, root, [*middles, *clients], set(served_by), size, n_shards,
                          t0, deadline, timeout_s, per_host_s)
        if bad := [i for i, held in files.items() if _sha256(held) != want]:
            raise RuntimeError(f"hosts {bad} hold wrong bytes")
        return {"completion_s": max(per_host_s.values()), "per_host_s": per_host_s,
                "prepare_s": prepare_s, "ok": True, "error": None}
    except (RuntimeError, TimeoutError, OSError) as e:
        return {"completion_s": None, "per_host_s": per_host_s, "prepare_s": prepare_s,
                "ok": False, "error": str(e)}
    finally:
        for p in procs.values():
            _kill_group(p)
        for i in procs:
            shutil.rmtree(root / f"h{i}", ignore_errors=True)


def _wait_all(procs: dict[int, subprocess.Popen], root: Path, hosts: list[int], clients: set[int],
              size: int, n_shards: int, t0: float, deadline: float, timeout_s: float,
              per_host_s: dict[int, float]) -> dict[int, list[Path]]:
    """Each of `hosts`' copies once it is whole, its time since `t0` noted in `per_host_s`;
    RuntimeError if a host exits without it, TimeoutError at `deadline`."""
    files: dict[int, list[Path]] = {}
    while len(files) < len(hosts):
        for i in hosts:
            if i not in files and (held := _holds(root, i, i in clients, size, n_shards)):
                files[i], per_host_s[i] = held, time.monotonic() - t0
            elif i not in files and procs[i].poll() is not None:
                raise RuntimeError(f"host {i} exited ({procs[i].returncode}) without the "
                                   f"file: {_tail(root / f'h{i}.log')}")
        if time.monotonic() > deadline:
            missing = sorted(set(hosts) - files.keys())
            raise TimeoutError(f"timeout after {timeout_s} s, hosts {missing} incomplete")
        time.sleep(POLL_S)
    return files


def _start_node(testbed: netns.Testbed, procs: dict[int, subprocess.Popen], root: Path,
                env: dict[str, str], deadline: float, i: int, fan_out: int, *node_args: str
                ) -> None:
    """Start host i's node (into `procs` at once, so that it is stopped whatever happens) and
    wait until it says it is ready; fan_out: how many nodes download from the same server."""
    site = root / f"h{i}" / "site"
    shutil.copytree(_shardcast_dir(), site / "shardcast")
    parallel = max(1, ACCEPT_QUEUE // fan_out)
    node_env = {**env, "SHARDCAST_MAX_CONCURRENT_DOWNLOADS": str(parallel),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))}
    with (root / f"h{i}.log").open("w") as log:
        procs[i] = testbed.popen(
            i, [sys.executable, SCRIPT, "--node", *node_args], env=node_env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    _wait_line(procs[i], "ready", deadline, f"host {i}")


def _data_dir(root: Path, i: int) -> str:
    d = root / f"h{i}" / "data"
    d.mkdir(parents=True)
    (d / "data1.bin").write_bytes(bytes(DUMMY_BYTES))
    return str(d)


def _holds(root: Path, i: int, client: bool, size: int, n_shards: int) -> list[Path] | None:
    """The files that make up host i's copy, once they hold all `size` bytes."""
    if client:
        out = root / f"h{i}" / "out.bin"
        return [out] if out.exists() and out.stat().st_size == size else None
    # A middle renames each shard into place whole (wget writes shard_N.tmp first).
    shards = sorted((root / f"h{i}" / "data" / "v1").glob("shard_*.bin"))
    if len(shards) != n_shards or sum(p.stat().st_size for p in shards) != size:
        return None
    return shards


def _shardcast_dir() -> Path:
    import shardcast

    return Path(shardcast.__file__).parent


def _wait_line(proc: subprocess.Popen, word: str, deadline: float, who: str) -> list[str]:
    """proc's next stdout line, split, which must start with word, by deadline."""
    if not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
        raise TimeoutError(f"{who} did not say {word!r} in time")
    line = proc.stdout.readline().split()
    if not line or line[0] != word:
        raise RuntimeError(f"{who} said {line!r} instead of {word!r} (exit {proc.poll()})")
    return line


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL proc and the wget processes it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(log: Path, n_chars: int = 600) -> str:
    return log.read_text(errors="replace")[-n_chars:].strip() if log.exists() else ""


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with p.open("rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def _node(role: str, args: list[str]) -> int:
    """Body of one node process: start the role, say "ready", then act on stdin."""
    from shardcast import ClientNode, MiddleNode, OriginServer

    if role == "origin":
        data_dir, shard_bytes = args
        origin = OriginServer(data_dir, PORT)
        print("ready", flush=True)
        payload = sys.stdin.readline().strip()
        t_call = time.monotonic()
        origin.broadcast(payload, int(shard_bytes))
        print("offered", t_call, time.monotonic(), flush=True)
    elif role == "middle":
        data_dir, upstream, check_interval_s = args
        MiddleNode([upstream], data_dir, PORT, check_interval=float(check_interval_s))
        print("ready", flush=True)
    else:
        out_dir, server = args
        client = ClientNode([server], out_dir)
        print("ready", flush=True)
        # download_version lists versions again and gives up (None) if its server lists no v1
        # (a middle that has not polled the origin since): keep asking until the deadline.
        while not ("v1" in client.list_available_versions()
                   and client.download_version("v1", f"{out_dir}/out.bin")):
            time.sleep(POLL_S)
        return 0
    sys.stdin.read()  # serve until the parent kills us
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--selftest", action="store_true",
                        help="1+4 hosts at 100 Mbit/s, a 20 MB payload; print time vs M/B")
    parser.add_argument("--node", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.node:
        return _node(args.node[0], args.node[1:])
    if not args.selftest:
        parser.print_help()
        return 2
    if reason := netns.unavailable():
        print(f"netns testbed unavailable: {reason}")
        return 1
    rate_bps, size = 100_000_000, 20_000_000
    middles, clients = default_topology(4)
    with tempfile.TemporaryDirectory(prefix="e2b-shardcast-") as tmp, \
            netns.Testbed(5, rate_bps, prefix="e2bsc") as testbed:
        payload = Path(tmp) / "payload.bin"
        payload.write_bytes(os.urandom(size))
        goodput_bps = netns.measure_throughput(testbed, 0, 1, 10_000_000) * 8
        result = run_shardcast(testbed, origin=0, middles=middles, clients=clients,
                               payload=payload, timeout_s=120, workdir=Path(tmp))
    ideal_s = size * 8 / rate_bps
    print(f"payload {size / 1e6:.0f} MB, uplinks {rate_bps / 1e6:.0f} Mbit/s (TCP goodput "
          f"{goodput_bps / 1e6:.1f}), origin 0, middles {middles}, clients {clients}")
    print(f"M/B {ideal_s:.2f} s; shardcast "
          + (f"{result['completion_s']:.2f} s = {result['completion_s'] / ideal_s:.2f} x M/B"
             if result["ok"] else f"failed: {result['error']}"))
    print(json.dumps({"bench": "shardcast_race", "ideal_s": ideal_s, **result}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
