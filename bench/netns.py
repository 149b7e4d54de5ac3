"""A shaped testbed of hosts on one machine: network namespaces on one bridge, each uplink a tbf.

Theory of operation. Host i is a network namespace `<prefix>-h<i>` holding loopback and `eth0`,
one end of a veth pair with address 10.77.x.y/16. The other end, `p<i>`, is a port of bridge
`br0`, which lives in its own namespace `<prefix>-sw` (the "switch") rather than the root
namespace: the switch then shares nothing with the machine's real network (its links, routes,
br_netfilter/iptables), its names cannot collide with anyone else's, and deleting namespaces
removes everything (a veth dies with either end, a bridge with its namespace).
Every host's uplink, the egress of its own `eth0`, is a token bucket (`tc ... tbf`), so a
host sends at most `rate_bps` while receiving from any number of hosts: the model of a peer on a
home or cloud link whose upload is the bottleneck. tbf counts whole Ethernet frames, so TCP
goodput is ~95% of the rate (1448 payload bytes per 1514-byte frame); no delay emulation
(netem is not in this kernel), so round trips are the queueing delay alone.

Needs root, iproute2 (`ip`, `tc`) and a kernel with veth, bridge and sch_tbf. Knows nothing of
what runs in the hosts; `close()` removes namespaces and links and kills no process.

    python bench/netns.py --selftest
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

MTU_BYTES = 1500


@dataclass(frozen=True)
class Host:
    index: int
    """Position in `Testbed.hosts`."""
    name: str
    """Short name, `h<index>`."""
    ns: str
    """Network namespace, `<prefix>-h<index>`."""
    ip: str
    """Address of the host's `eth0`."""


def _sh(*argv: str) -> str:
    """Run one iproute2 command; raise with its stderr when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def tbf_args(rate_bps: int) -> list[str]:
    """`tbf rate .. burst .. limit ..` for a link of rate_bps.

    burst: the bucket must hold what the link sends in one timer tick (4 ms at HZ=250): when the
    qdisc watchdog wakes up late by a tick, the tokens it missed are still in the bucket and no
    throughput is lost. It is also at least two full frames (tbf drops a frame bigger than the
    bucket). A larger bucket only lets an idle host send a longer line-rate burst (here at most
    a tick's worth, or 3 kB).
    limit (queue bytes): 50 ms of the rate, a modest consumer-uplink buffer, but never under
    256 KiB: measured here, one TCP flow (BBR, ~0 RTT) keeps ~128-256 KiB queued, and a shorter
    queue drops enough to lose >10% goodput at 10 Mbit/s. More would only add bufferbloat to
    every control message queued behind bulk data.
    """
    rate_bytes = rate_bps // 8
    burst_bytes = max(rate_bytes // 250, 2 * (MTU_BYTES + 14))
    limit_bytes = max(rate_bytes // 20, 256 * 1024) + burst_bytes
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst_bytes), "limit", str(limit_bytes)]


def unavailable() -> str | None:
    """None when namespaces, veth, a bridge and tbf can be made here, else a one-line reason."""
    if os.geteuid() != 0:
        return "not root"
    ns = f"e2bprobe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", ns)
    except (OSError, RuntimeError) as e:
        return f"ip netns not available: {e}"
    steps = [
        ("veth", ["ip", "-n", ns, "link", "add", "name", "va", "type", "veth",
                  "peer", "name", "vb"]),
        ("bridge", ["ip", "-n", ns, "link", "add", "name", "br0", "type", "bridge"]),
        ("bridge", ["ip", "-n", ns, "link", "set", "vb", "master", "br0"]),
        ("tc tbf", ["tc", "-n", ns, "qdisc", "add", "dev", "va", "root", *tbf_args(10**8)]),
    ]
    try:
        for what, argv in steps:
            try:
                _sh(*argv)
            except (OSError, RuntimeError) as e:
                return f"{what} not available: {e}"
        return None
    finally:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


class Testbed:
    """n_hosts namespaces on one bridge, host i's uplink shaped to rate_bps[i]."""

    def __init__(self, n_hosts: int, rate_bps: int | list[int], *, prefix: str = "e2b") -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", prefix):
            raise ValueError(f"prefix must be a short lowercase name, got {prefix!r}")
        rates = rate_bps if isinstance(rate_bps, list) else [rate_bps] * n_hosts
        if len(rates) != n_hosts or not 1 <= n_hosts <= 4000:
            raise ValueError(f"need 1..4000 hosts and one rate per host, got {n_hosts}, {rates}")
        self.prefix = prefix
        self.switch_ns = f"{prefix}-sw"
        self.hosts = [Host(i, f"h{i}", f"{prefix}-h{i}", f"10.77.{(i + 1) >> 8}.{(i + 1) & 255}")
                      for i in range(n_hosts)]
        self._remove_namespaces()  # a crashed earlier run with this prefix left them behind
        try:
            self._build(rates)
        except BaseException:
            self.close()
            raise

    def _build(self, rates: list[int]) -> None:
        sw = self.switch_ns
        _sh("ip", "netns", "add", sw)
        _sh("ip", "-n", sw, "link", "add", "name", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        for host, rate in zip(self.hosts, rates):
            port = f"p{host.index}"
            _sh("ip", "netns", "add", host.ns)
            _sh("ip", "-n", host.ns, "link", "add", "name", "eth0", "type", "veth",
                "peer", "name", port, "netns", sw)
            _sh("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
            _sh("ip", "-n", host.ns, "addr", "add", f"{host.ip}/16", "dev", "eth0")
            _sh("ip", "-n", host.ns, "link", "set", "lo", "up")
            _sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
            self.set_rate(host.index, rate)

    def set_rate(self, i: int, rate_bps: int) -> None:
        """Shape host i's uplink to rate_bps (takes effect for frames queued from now on)."""
        _sh("tc", "-n", self.hosts[i].ns, "qdisc", "replace", "dev", "eth0", "root",
            *tbf_args(rate_bps))

    def popen(self, i: int, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start argv inside host i's namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[i].ns, *argv], **popen_kwargs)

    def run(self, i: int, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        """Run argv to completion inside host i's namespace."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[i].ns, *argv], **kw)

    def _remove_namespaces(self) -> None:
        mine = re.compile(rf"{re.escape(self.prefix)}-(sw|h\d+)")
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for name in [line.split()[0] for line in listed.splitlines() if line.strip()]:
            if mine.fullmatch(name):
                subprocess.run(["ip", "netns", "delete", name], capture_output=True)

    def close(self) -> None:
        """Remove the namespaces, and with them the veths and the bridge. Idempotent."""
        self._remove_namespaces()

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SINK = """
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
buf = bytearray(1 << 20)
while conn.recv_into(buf):
    pass
conn.sendall(b"k")
"""

_SOURCE = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block, left = bytes(1 << 20), int(sys.argv[3])
t0 = time.perf_counter()
while left > 0:
    left -= conn.send(memoryview(block)[:min(left, len(block))])
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print(time.perf_counter() - t0)
"""


def measure_throughput(testbed: Testbed, src: int, dst: int, nbytes: int) -> float:
    """TCP goodput in bytes/s of nbytes sent from host src to host dst (one connection).

    The clock runs from the first send to the receiver's acknowledgement of end-of-stream, so it
    counts every byte delivered; it excludes the connection handshake.
    """
    dst_ip = testbed.hosts[dst].ip
    sink = testbed.popen(dst, [sys.executable, "-c", _SINK, dst_ip],
                         stdout=subprocess.PIPE, text=True)
    try:
        port = sink.stdout.readline().strip()
        done = testbed.run(src, [sys.executable, "-c", _SOURCE, dst_ip, port, str(nbytes)],
                           capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"throughput client failed: {done.stderr.strip()}")
        return nbytes / float(done.stdout)
    finally:
        sink.kill()
        sink.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--selftest", action="store_true",
                        help="3 hosts at 50 Mbit/s; measure 0->1; exit 0 if within 15%%")
    args = parser.parse_args(argv)
    if not args.selftest:
        parser.print_help()
        return 2
    if reason := unavailable():
        print(f"netns testbed unavailable: {reason}")
        return 1
    rate_bps = 50_000_000
    with Testbed(3, rate_bps, prefix="e2bself") as testbed:
        measured = measure_throughput(testbed, 0, 1, 30_000_000) * 8
    ratio = measured / rate_bps
    print(f"configured {rate_bps / 1e6:.1f} Mbit/s, measured TCP goodput "
          f"{measured / 1e6:.1f} Mbit/s ({ratio:.1%})")
    return 0 if abs(ratio - 1) <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
