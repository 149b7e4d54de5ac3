"""Ctrl-C on `echo2-hub serve`, typed on a real terminal (a pty), then the resume it prints
(issue 31, items 6 and 7): the learner stops after its step, the step is checkpointed, one line
gives the command that resumes it, the exit code is 130; the resumed run goes on with the run's
clock and totals, and the report covers the whole run."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from echo2p2p.hub.view.report import summary
from echo2p2p.hub.view.run_data import read_run

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

LISTENING = r"listening on (ws://[\d.:]+/ws)"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


class Terminal:
    """A command on a pseudo-terminal of its own, as a user's shell runs it in the foreground:
    Ctrl-C is the byte the terminal turns into SIGINT for its process group."""

    def __init__(self, argv: list[str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal
            os.execve(argv[0], argv, ENV)
        self.text = ""

    def _read(self, timeout_s: float) -> bool:
        """Read what is there within `timeout_s`; False at the end (the command closed it)."""
        ready, _, _ = select.select([self.fd], [], [], max(timeout_s, 0.0))
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 1 << 16)
        except OSError:  # EIO: every process holding the terminal has gone
            chunk = b""
        self.text += chunk.decode(errors="replace")
        return bool(chunk)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(pattern, self.text)):
            tail = self.text[-3000:]
            assert time.monotonic() < deadline, f"no {pattern!r} in {timeout_s} s:\n{tail}"
            assert self._read(deadline - time.monotonic()), f"ended before {pattern!r}:\n{tail}"
        return found

    def wait_exit(self, timeout_s: float) -> int:
        """Its exit code, once it closed the terminal (within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while self._read(deadline - time.monotonic()):
            assert time.monotonic() < deadline, \
                f"still running after {timeout_s} s:\n{self.text[-3000:]}"
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def start_peer(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "echo2p2p.peer.cli", "join", url,
                             "--torch-threads", "1", "--log-level", "warning"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def steps(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if "event" not in r]


def test_ctrl_c_on_serve_checkpoints_says_how_to_resume_and_the_resumed_run_is_one_run(tmp_path):
    run_dir = tmp_path / "run"
    serve = [sys.executable, "-m", "echo2p2p.hub.cli", "serve", "--model", "tiny", "--port", "0",
             "--dashboard-port", "-1", "--max-steps", "0", "--eval-every", "0",
             "--torch-threads", "1", "--max-lag", "1", "--run-dir", str(run_dir)]
    hub, peer = Terminal(serve), None
    try:
        peer = start_peer(hub.wait_for(LISTENING, 300)[1])
        hub.wait_for(r"step +2 ", 300)  # three learner steps: peers deliver, the hub trains
        before = steps(run_dir)[-1]
        typed = time.monotonic()
        os.write(hub.fd, b"\x03")  # Ctrl-C
        line = hub.wait_for(r"stopped by SIGINT at v(\d+) \(\d+ steps trained\): checkpoint "
                            r"saved, its settings in \S+config.json \(--resume reads them: the "
                            r"model, task and every other field need no flag\); resume with: "
                            r"(echo2-hub serve --resume \S+)\r?\n", 60)
        code = hub.wait_exit(60)
        stop_s = time.monotonic() - typed
    finally:
        hub.kill()
        if peer is not None:
            peer.kill()
            peer.wait()
    print(f"Ctrl-C to exit: {stop_s:.2f} s")
    assert code == 130, hub.text[-3000:]
    assert "Traceback" not in hub.text, hub.text[-3000:]
    assert line[2] == f"echo2-hub serve --resume {run_dir}"
    stopped_at = int(line[1])
    logged = steps(run_dir)
    assert logged[-1]["step"] + 1 == stopped_at  # nothing trained after the stop
    checkpoints = run_dir / "checkpoints"
    latest = checkpoints / f"ckpt-{int((checkpoints / 'LATEST').read_text()):06d}"
    state = msgpack.unpackb((latest / "hub.msgpack").read_bytes(), raw=False,
                            strict_map_key=False)
    assert state["step"] == stopped_at and (latest / "learner").is_dir()

    # the command it printed, with two more steps to train
    argv = line[2].split()[1:] + ["--max-steps", str(stopped_at + 2), "--torch-threads", "1"]
    resumed, peer = Terminal([sys.executable, "-m", "echo2p2p.hub.cli", *argv]), None
    try:
        peer = start_peer(resumed.wait_for(LISTENING, 300)[1])
        assert resumed.wait_exit(300) == 0, resumed.text[-3000:]
    finally:
        resumed.kill()
        if peer is not None:
            peer.kill()
            peer.wait()
    assert "Traceback" not in resumed.text, resumed.text[-3000:]
    records = steps(run_dir)
    assert [r["step"] for r in records] == list(range(stopped_at + 2))
    for key in ("time_s", "rollout/admitted_groups_total", "rollout/stale_on_arrival_total",
                "rollout/stale_in_queue_total", "rollout/rejected_total"):
        assert all(a[key] <= b[key] for a, b in zip(records, records[1:])), key
    assert records[-1]["rollout/admitted_groups_total"] > before["rollout/admitted_groups_total"]
    assert records[stopped_at]["time_s"] >= state["loop"]["time_s"] >= before["time_s"]
    rows = dict(summary(read_run(run_dir)))  # report.html's table: the whole run
    last = records[-1]
    assert rows["wall time (learner loop)"] == f"{last['time_s'] / 60:.1f} min"
    assert rows["dropped stale (on arrival / in queue)"] == \
        f"{last['rollout/stale_on_arrival_total']} / {last['rollout/stale_in_queue_total']}"
    assert rows["steps"].startswith(f"{stopped_at + 2} (last version {stopped_at + 2})")


def test_a_second_ctrl_c_exits_at_once_and_leaves_the_last_checkpoint_whole(tmp_path):
    from echo2p2p.hub.learning.durable import Checkpoints

    run_dir = tmp_path / "run"
    hub, peer = Terminal([sys.executable, "-m", "echo2p2p.hub.cli", "serve", "--model", "tiny",
                          "--port", "0", "--dashboard-port", "-1", "--max-steps", "0",
                          "--eval-every", "1", "--torch-threads", "1",
                          "--run-dir", str(run_dir)]), None
    try:
        peer = start_peer(hub.wait_for(LISTENING, 300)[1])
        hub.wait_for(r"step +1 ", 300)
        os.write(hub.fd, b"\x03")
        hub.wait_for("stopping on SIGINT", 30)
        typed = time.monotonic()
        os.write(hub.fd, b"\x03")
        code = hub.wait_exit(30)
        print(f"second Ctrl-C to exit: {time.monotonic() - typed:.2f} s")
    finally:
        hub.kill()
        if peer is not None:
            peer.kill()
            peer.wait()
    assert code == 130, hub.text[-3000:]
    assert re.search(r"echo2-hub: stopped at once by a second SIGINT; the last checkpoint is "
                     rf"kept: resume with: echo2-hub serve --resume {run_dir}\r?\n", hub.text)
    assert "Traceback" not in hub.text, hub.text[-3000:]
    _, state, _ = Checkpoints(run_dir).load()
    assert state["step"] >= 1


def test_ctrl_c_the_moment_the_hub_says_it_listens_stops_it_cleanly(tmp_path):
    """The "listening on" line is printed once the run's own handlers are set: a Ctrl-C typed
    as soon as it shows is a clean stop with the resume line, never "while starting"."""
    run_dir = tmp_path / "run"
    hub = Terminal([sys.executable, "-m", "echo2p2p.hub.cli", "serve", "--model", "tiny",
                    "--port", "0", "--dashboard-port", "-1", "--eval-every", "0",
                    "--torch-threads", "1", "--run-dir", str(run_dir)])
    try:
        hub.wait_for(LISTENING, 300)
        os.write(hub.fd, b"\x03")
        code = hub.wait_exit(60)
    finally:
        hub.kill()
    assert code == 130, hub.text[-3000:]
    assert "while starting" not in hub.text, hub.text[-3000:]
    assert re.search(rf"resume with: echo2-hub serve --resume {run_dir}\r?\n", hub.text), \
        hub.text[-3000:]
