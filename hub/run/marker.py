"""The run directory's `RUNNING` marker: what tells the next start that a hub was killed.

A hub that is killed without a word (SIGKILL, the kernel's OOM killer) cannot say so itself: its
last log line is whatever it was doing. So `running` writes `<run_dir>/RUNNING` (the process id,
when it started, the command that resumes the run) once the hub serves, and removes it however
the process ends that Python sees (done, a signal's clean stop, an exception with its
traceback). A marker still there at the next start, its process gone, means the last hub died
without a word: `unclean_notice` says so, with the checkpoint a resume goes back to and the
exact command. A second Ctrl-C's `os._exit` leaves the marker too (that exit printed the resume
command already; the next start repeats it).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

MARKER = "RUNNING"


@contextlib.contextmanager
def running(run_dir: Path, how: str) -> Iterator[None]:
    """`<run_dir>/RUNNING` while the block runs: this process, the time, `how` to resume."""
    marker = Path(run_dir) / MARKER
    marker.write_text(json.dumps({"pid": os.getpid(), "started": time.strftime(
        "%Y-%m-%d %H:%M:%S %Z"), "resume": how}) + "\n")
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def unclean_notice(run_dir: Path, checkpoint_step: int | None) -> str | None:
    """The sentence for a start in `run_dir` whose last hub died without a word (its marker is
    there, its process gone); None when the last one stopped cleanly, or never ran here.
    `checkpoint_step`: the version of the run dir's last checkpoint (None: it has none)."""
    marker = Path(run_dir) / MARKER
    try:
        facts = json.loads(marker.read_text())
        pid, started, how = int(facts["pid"]), str(facts["started"]), str(facts["resume"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid != os.getpid() and _alive(pid):
        return (f"{marker} says a hub (pid {pid}, started {started}) is serving this run dir: "
                f"if it is not, its process id was taken by another; delete the file")
    back = (f"a resume goes back to its last checkpoint, v{checkpoint_step}"
            if checkpoint_step is not None else "it left no checkpoint: a resume cannot continue it")
    return (f"the last hub in {run_dir} (pid {pid}, started {started}) did not stop cleanly: it "
            f"was killed without a word (SIGKILL, or the kernel's OOM killer when memory ran out: "
            f"`dmesg | grep -i oom` tells; --max-memory fits the hub into less); {back}; resume "
            f"with: {how}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, not ours
        return True
    return True
