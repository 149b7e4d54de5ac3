"""The chaos harness: a hub and peers as real processes on loopback, the faults, and readers for
the evidence a run leaves behind.

Faults are what an operator's world does to processes: SIGKILL (no goodbye, sockets reset by the
kernel), never a call into a process. Evidence is only what the processes write: the hub's
debug log (grants, admissions, staleness drops, departures), its run log (metrics.jsonl), its
/status route, its checkpoints and journals on disk, and each peer's log ("vN complete"). The
accounting in `chaos_accounting` is computed from those, so a bookkeeping bug in the hub shows
up as a loss instead of being trusted.

Every process is started with PR_SET_PDEATHSIG (on Linux), so a pytest that dies takes them
along; `Cluster.close` ends the rest, even when a test fails.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BYZANTINE = Path(__file__).resolve().parent / "byzantine_peer.py"
POLL_S = 0.05  # how often a wait looks again

# Small and fast everywhere: the tiny built-in model, one torch thread per process.
HUB_FLAGS = ("--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0",
             "--torch-threads", "1", "--seed", "1", "--log-level", "debug")
PEER_FLAGS = ("--torch-threads", "1", "--log-level", "info", "--listen", "127.0.0.1:0",
              "--reconnect-max-s", "1", "--relay-stall-s", "3")


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `condition` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Proc:
    name: str
    role: str  # "hub", "peer" (generates), "relay" (relays only), "byzantine"
    popen: subprocess.Popen
    log: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class HubProc(Proc):
    run_dir: Path = Path()
    port: int = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def status(self) -> dict[str, Any] | None:
        """GET /status, or None while the hub does not answer; fails if the hub has exited."""
        assert self.alive, f"{self.name} exited ({self.popen.returncode}):\n{self.text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None


class Cluster:
    """The processes of one chaos scenario, their logs under `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[Proc] = []
        self.env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def _spawn(self, name: str, role: str, argv: list[str], cls=Proc, **extra) -> Proc:
        log = self.root / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(argv, cwd=self.root, env=self.env, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        proc = cls(name, role, popen, log, **extra)
        self.procs.append(proc)
        return proc

    def start_hub(self, run_dir: Path, *flags: str, resume: bool = False, port: int = 0,
                  name: str = "hub") -> HubProc:
        """`echo2-hub serve` (or `serve --resume run_dir`); returns once it listens."""
        where = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
        argv = [sys.executable, "-m", "echo2p2p.hub.cli", "serve", *where, "--port", str(port),
                *HUB_FLAGS, *flags]
        hub = self._spawn(name, "hub", argv, HubProc, run_dir=run_dir)
        listening = re.compile(r"listening on ws://127\.0\.0\.1:(\d+)/ws")

        def bound() -> int | None:
            assert hub.alive, f"{name} exited ({hub.popen.returncode}):\n{hub.text()[-3000:]}"
            found = listening.search(hub.text())
            return int(found.group(1)) if found else None

        hub.port = wait_for(bound, 120, f"{name} to listen")
        return hub

    def start_peer(self, hub: HubProc, name: str, *flags: str, engine: str = "transformers",
                   byzantine: tuple[str, ...] = ()) -> Proc:
        """`echo2-peer join` (or tests/chaos/byzantine_peer.py with `byzantine` attack flags)."""
        entry = [str(BYZANTINE), *byzantine] if byzantine else ["-m", "echo2p2p.peer.cli"]
        argv = [sys.executable, *entry, "join", hub.url, "--name", name, "--engine", engine,
                *PEER_FLAGS, *flags]
        role = "byzantine" if byzantine else ("relay" if engine == "relay" else "peer")
        return self._spawn(name, role, argv)

    def kill(self, proc: Proc) -> float:
        """SIGKILL `proc` and reap it; the monotonic time of the kill."""
        at = time.monotonic()
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(timeout=30)
        return at

    def close(self) -> None:
        """SIGTERM everything still running (peers stop cleanly on it), SIGKILL what lingers."""
        for proc in self.procs:
            if proc.alive:
                proc.popen.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)


# --- the hub's evidence ---------------------------------------------------------------------

GRANTED = re.compile(r"granted (L\d+) \(problem (\d+)\) to (p\d+)")
ADMITTED = re.compile(r"admitted (L\d+) \(v(\d+)\) from (p\d+)")
DROPPED = re.compile(r"dropped (L\d+): v(\d+) is too stale for step (\d+)")
LEFT = re.compile(r"peer left: (p\d+) \((.*)\); (\d+) leases re-queued")
JOINED = re.compile(r"peer joined: (p\d+) \((.*?), ")
PUBLISHED = re.compile(r"published v(\d+):")
QUARANTINED = re.compile(r"quarantined (p\d+) \(")
REPORTED = re.compile(r"(p\d+) reports relay (p\d+) on v\d+: (\w+)")
SPOT_FAILED = re.compile(r"(p\d+) \(.*?\) failed a spot-check")


@dataclass
class HubLog:
    """What one hub incarnation's debug log says happened."""

    granted: dict[str, tuple[int, str]] = field(default_factory=dict)  # lease -> (problem, peer)
    admitted: dict[str, tuple[int, str]] = field(default_factory=dict)  # lease -> (version, peer)
    dropped: set[str] = field(default_factory=set)
    left: dict[str, int] = field(default_factory=dict)  # peer id -> leases re-queued
    left_line: dict[str, int] = field(default_factory=dict)  # peer id -> line number
    names: dict[str, str] = field(default_factory=dict)  # peer id -> name
    published: list[int] = field(default_factory=list)
    published_line: dict[int, int] = field(default_factory=dict)  # version -> line number
    joined_line: dict[str, int] = field(default_factory=dict)  # peer id -> line number
    quarantined: dict[str, int] = field(default_factory=dict)  # peer id -> line number
    admitted_line: dict[str, int] = field(default_factory=dict)  # lease -> line number
    reported: set[tuple[str, str]] = field(default_factory=set)  # (relay, reason) reported
    spot_failed: set[str] = field(default_factory=set)  # peers that failed a spot-check

    @classmethod
    def read(cls, path: Path) -> HubLog:
        log = cls()
        for number, line in enumerate(path.read_text(errors="replace").splitlines()):
            if m := GRANTED.search(line):
                log.granted[m[1]] = (int(m[2]), m[3])
            elif m := ADMITTED.search(line):
                log.admitted[m[1]] = (int(m[2]), m[3])
                log.admitted_line[m[1]] = number
            elif m := DROPPED.search(line):
                log.dropped.add(m[1])
            elif m := LEFT.search(line):
                log.left[m[1]] = int(m[3])
                log.left_line[m[1]] = number
            elif m := JOINED.search(line):
                log.names[m[1]] = m[2]
                log.joined_line[m[1]] = number
            elif m := PUBLISHED.search(line):
                log.published.append(int(m[1]))
                log.published_line[int(m[1])] = number
            elif m := QUARANTINED.search(line):
                log.quarantined.setdefault(m[1], number)
            elif m := REPORTED.search(line):
                log.reported.add((m[2], m[3]))
            elif m := SPOT_FAILED.search(line):
                log.spot_failed.add(m[1])
        return log

    def published_after(self, line: int, final_version: int) -> list[int]:
        """Versions published after log line `line`, without `final_version`: the hub stops
        serving as soon as it has published that one, so whether peers finish it is a race."""
        return sorted(v for v, at in self.published_line.items() if at > line and v < final_version)

    def open_leases_of(self, peer_id: str) -> set[str]:
        """Leases granted to `peer_id` that it has not had admitted (as far as the log knows)."""
        return {lease for lease, (_, peer) in self.granted.items()
                if peer == peer_id and lease not in self.admitted}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every whole record of metrics.jsonl (a line torn by a kill is skipped)."""
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "step" in r and "event" not in r]


def events(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == kind]


class _Indices:
    """Stands in for the hub's problem list: the lease book only ever indexes it."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> int:
        return index


@dataclass(frozen=True)
class FinalState:
    """The hub's state as its last checkpoint and the journal after it leave it on disk."""

    checkpoint: int
    step: int  # the learner's version at that checkpoint
    queued: set[str]  # admitted groups not trained on (lease ids)
    pending: set[int]  # problem indices waiting to be granted again
    open: dict[str, int]  # open lease id -> problem index
    drawn: int  # problems drawn from the shuffled order so far
    trust: dict[str, Any]


def final_state(run_dir: Path) -> FinalState:
    """Read the current checkpoint's hub state and replay its journals, as a resumed hub would
    (the lease book is the core's own, pure; the buffer is rebuilt here from the records)."""
    import itertools

    import msgpack

    from echo2p2p.leases import LeaseBook
    from echo2p2p.hub.durable import read_journal

    root = run_dir / "checkpoints"
    number = int((root / "LATEST").read_text())
    state = msgpack.unpackb((root / f"ckpt-{number:06d}" / "hub.msgpack").read_bytes(),
                           raw=False, strict_map_key=False)
    book = LeaseBook(_Indices(), 1.0, itertools.count())
    book.restore(state["leases"], 0.0)
    queued = {wire[0] for wire in state["buffer"]}
    journals = sorted(p for p in root.glob("journal-*.log") if int(p.stem.split("-")[1]) >= number)
    for kind, *record in (r for j in journals for r in read_journal(j)):
        if kind == "lease":
            book.replay(tuple(record), 0.0)
        elif kind == "admit":
            book.replay(("done", record[0][0]), 0.0)
            queued.add(record[0][0])
    leases = book.state()
    return FinalState(number, state["step"], queued, set(leases["pending"]),
                      {lease_id: index for lease_id, index, _ in leases["open"]},
                      leases["drawn"], state["trust"])


# --- a peer's evidence ----------------------------------------------------------------------

COMPLETE = re.compile(r"\bv(\d+) complete in ")


def versions_held(peer: Proc) -> set[int]:
    """The versions `peer` says it assembled and verified."""
    return {int(m[1]) for m in COMPLETE.finditer(peer.text())}
