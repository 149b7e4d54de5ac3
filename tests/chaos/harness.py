"""The chaos harness: a hub and peers as real processes on loopback, the faults, and readers for
the evidence a run leaves behind.

Faults are what an operator's world does to processes: SIGKILL (no goodbye, sockets reset by the
kernel), never a call into a process. Evidence is only what the processes write: the hub's
debug log (grants, admissions, staleness drops, departures, versions held), its live step
lines, its run log (metrics.jsonl), its /status route, its checkpoints and journals on disk,
and each peer's log ("vN complete"). The accounting in `chaos_accounting` is computed from
those, so a bookkeeping bug in the hub shows up as a loss instead of being trusted.

Faults fire from events, not from polling: each process's output is read as a stream, line by
line, by a thread that tees it to the process's log file and, for the hub, folds it into a live
`HubLog`. `Cluster.wait_for(condition)` evaluates its condition once per batch of new lines (or
a process exit) and returns on the record that makes it true; nothing sleeps or looks again on
a timer.

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
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BYZANTINE = Path(__file__).resolve().parent / "byzantine_peer.py"

# Small and fast everywhere: the tiny built-in model, one torch thread per process.
PROMPTS_PER_STEP = 4  # the groups each learner step trains on
HUB_FLAGS = ("--prompts-per-step", str(PROMPTS_PER_STEP), "--group-size", "4",
             "--eval-every", "0", "--torch-threads", "1", "--seed", "1", "--log-level", "debug")
# debug: `versions_held` reads the peers' per-version "vN complete in" lines, which are DEBUG.
PEER_FLAGS = ("--torch-threads", "1", "--log-level", "debug", "--listen", "127.0.0.1:0",
              "--reconnect-max-s", "1", "--relay-stall-s", "3")


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
    lines: list[str] = field(default_factory=list)  # its output so far, as the reader got it

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def heard(self, number: int, line: str) -> None:
        """Line `number` of this process's output has arrived (called by its reader thread)."""


@dataclass
class HubProc(Proc):
    run_dir: Path = Path()
    port: int = 0
    live: HubLog = field(default_factory=lambda: HubLog())  # its debug log, as it is written

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def heard(self, number: int, line: str) -> None:
        self.live.feed(number, line)

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
        self._news = threading.Condition()  # notified on every line read and every exit
        self._threads: list[threading.Thread] = []

    def wait_for(self, condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Evaluate `condition` now and again after each batch of new output (or an exit) from
        any process, until it returns something truthy (returned); fail naming `what` once
        `timeout_s` pass without it. The condition runs with the readers held off, so it sees
        every process's `lines` (and the hub's `live` log) in one consistent state."""
        deadline = time.monotonic() + timeout_s
        with self._news:
            while True:
                result = condition()
                if result:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; "
                                         f"what each process printed last:\n{self.tails()}")
                self._news.wait(remaining)

    def tails(self, lines: int = 12) -> str:
        """The last `lines` lines of every process's output, the hub's 4 times as many: what a
        timed-out wait shows, to tell a stall from a slow machine."""
        out = []
        for proc in self.procs:
            state = "running" if proc.alive else f"exited {proc.popen.returncode}"
            keep = lines * 4 if proc.role == "hub" else lines
            out += [f"--- {proc.name} ({state})", *proc.lines[-keep:]]
        return "\n".join(out)

    def _spawn(self, name: str, role: str, argv: list[str], cls=Proc, **extra) -> Proc:
        popen = subprocess.Popen(argv, cwd=self.root, env=self.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        proc = cls(name, role, popen, self.root / f"{name}.log", **extra)
        self.procs.append(proc)
        for target in (self._read, self._watch_exit):
            thread = threading.Thread(target=target, args=(proc,), name=f"{target.__name__}-{name}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return proc

    def _read(self, proc: Proc) -> None:
        """Tee `proc`'s output to its log file, line by line, and announce each line."""
        with proc.log.open("ab") as out:
            for raw in proc.popen.stdout:
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace").rstrip("\n")
                with self._news:
                    proc.lines.append(line)
                    proc.heard(len(proc.lines) - 1, line)
                    self._news.notify_all()
        with self._news:
            self._news.notify_all()

    def _watch_exit(self, proc: Proc) -> None:
        """Announce `proc`'s exit (its output may stay open in a child for a while)."""
        proc.popen.wait()
        with self._news:
            self._news.notify_all()

    def wait_exit(self, proc: Proc, timeout_s: float, what: str) -> None:
        """Block until `proc` has exited and its reader has taken all it wrote."""
        self.wait_for(lambda: not proc.alive, timeout_s, what)
        for thread in self._threads:
            if thread.name == f"_read-{proc.name}":
                thread.join(timeout_s)

    def start_hub(self, run_dir: Path, *flags: str, resume: bool = False, port: int = 0,
                  name: str = "hub") -> HubProc:
        """`echo2-hub serve` (or `serve --resume run_dir`); returns once it says it listens."""
        where = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
        argv = [sys.executable, "-m", "echo2p2p.hub.cli", "serve", *where, "--port", str(port),
                *HUB_FLAGS, *flags]
        hub = self._spawn(name, "hub", argv, HubProc, run_dir=run_dir)

        def bound() -> int | None:
            assert hub.alive, f"{name} exited ({hub.popen.returncode}):\n{hub.text()[-3000:]}"
            return hub.live.port

        hub.port = self.wait_for(bound, 120, f"{name} to listen")
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
        """SIGTERM everything still running (peers stop cleanly on it), SIGKILL what lingers;
        then let the readers take the last of the output."""
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
        for thread in self._threads:
            thread.join(10)


# --- the hub's evidence ---------------------------------------------------------------------

GRANTED = re.compile(r"granted ([\w-]+) \(problem (\d+)\) to (p\d+)")
ADMITTED = re.compile(r"admitted ([\w-]+) \(v(\d+)\) from (p\d+)")
DROPPED = re.compile(r"dropped ([\w-]+): v(\d+) is too stale for step (\d+)")
WITHDRAWN = re.compile(r"withdrew ([\w-]+) \(v\d+\) of .*: quarantined")
CLOSED = re.compile(r"lease ([\w-]+) closed: ")
LEFT = re.compile(r"peer left: (p\d+) \((.*)\); (\d+) leases re-queued")
JOINED = re.compile(r"peer joined: (p\d+) \((.*?), ")
PUBLISHED = re.compile(r"published v(\d+):")
QUARANTINED = re.compile(r"quarantined (p\d+) \(")
REPORTED = re.compile(r"(p\d+) reports relay (p\d+) on v\d+: (\w+)")
SPOT_FAILED = re.compile(r"(p\d+) \(.*?\) failed a spot-check")
HOLDS = re.compile(r"(p\d+) holds v(\d+)$")
STEP = re.compile(r"^step +(\d+) +v(\d+) +reward ")  # the live line of each learner step
RESUMED = re.compile(r"^resumed at v(\d+): ")
LISTENING = re.compile(r"listening on ws://127\.0\.0\.1:(\d+)/ws")


@dataclass
class HubLog:
    """What one hub incarnation's debug log says happened."""

    granted: dict[str, tuple[int, str]] = field(default_factory=dict)  # lease -> (problem, peer)
    admitted: dict[str, tuple[int, str]] = field(default_factory=dict)  # lease -> (version, peer)
    dropped: set[str] = field(default_factory=set)
    withdrawn: set[str] = field(default_factory=set)  # admitted, then its peer was quarantined
    closed: set[str] = field(default_factory=set)  # granted, then taken back unanswered
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
    holds: dict[str, int] = field(default_factory=dict)  # peer id -> version it last said it holds
    steps: list[int] = field(default_factory=list)  # learner steps, as their live lines came
    resumed_at: int | None = None  # the version a resumed hub came back at
    port: int | None = None  # where it listens, once it says so
    lines: int = 0  # how many lines it has taken

    @classmethod
    def read(cls, path: Path) -> HubLog:
        log = cls()
        for number, line in enumerate(path.read_text(errors="replace").splitlines()):
            log.feed(number, line)
        return log

    def feed(self, number: int, line: str) -> None:
        """Take line `number` of the hub's output into account."""
        self.lines = number + 1
        if m := GRANTED.search(line):
            self.granted[m[1]] = (int(m[2]), m[3])
        elif m := ADMITTED.search(line):
            self.admitted[m[1]] = (int(m[2]), m[3])
            self.admitted_line[m[1]] = number
        elif m := DROPPED.search(line):
            self.dropped.add(m[1])
        elif m := WITHDRAWN.search(line):
            self.withdrawn.add(m[1])
        elif m := CLOSED.search(line):
            self.closed.add(m[1])
        elif m := HOLDS.search(line):
            self.holds[m[1]] = int(m[2])
        elif m := LEFT.search(line):
            self.left[m[1]] = int(m[3])
            self.left_line[m[1]] = number
        elif m := JOINED.search(line):
            self.names[m[1]] = m[2]
            self.joined_line[m[1]] = number
        elif m := PUBLISHED.search(line):
            self.published.append(int(m[1]))
            self.published_line[int(m[1])] = number
        elif m := QUARANTINED.search(line):
            self.quarantined.setdefault(m[1], number)
        elif m := REPORTED.search(line):
            self.reported.add((m[2], m[3]))
        elif m := SPOT_FAILED.search(line):
            self.spot_failed.add(m[1])
        elif m := STEP.search(line):
            self.steps.append(int(m[1]))
        elif m := RESUMED.search(line):
            self.resumed_at = int(m[1])
        elif m := LISTENING.search(line):
            self.port = int(m[1])

    def connected(self) -> dict[str, str]:
        """name -> peer id of the peers joined and not left."""
        return {name: pid for pid, name in self.names.items() if pid not in self.left}

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
    from echo2p2p.hub.learning.durable import read_journal

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
