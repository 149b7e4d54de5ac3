"""The sandbox's cgroup v2: one per run, bounding the memory and the number of processes of
everything a program starts together, and killed whole and removed when the run ends.

The rlimits bound each process (RLIMIT_AS), not a program's processes together, nor the memory
it makes the kernel spend (its IPC objects, page tables, a file written to a tmpfs); a cgroup's
memory.max counts every page charged to it. Used by a root caller where /sys/fs/cgroup is
cgroup v2 and the memory and pids controllers are handed down where a cgroup of its own can go
(`plan`): under the caller's own cgroup when its cgroup.subtree_control lists them (only the
root cgroup may both hold processes and hand controllers down), else beside it, under its
parent's: the hub's own cgroup holds the hub, so its programs' cgroups are its siblings,
inside whatever slice bounds the hub. Elsewhere (cgroup v1 or hybrid, a container's cgroup
namespace, a caller that is not root) it answers None, says why once at INFO, and the sandbox
keeps its rlimits and its IPC namespace's limits. Knows nothing of programs or namespaces:
the sandbox's child joins the cgroup itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

CGROUP_FS = "/sys/fs/cgroup"
CONTROLLERS = ("memory", "pids")
PREFIX = "echo2-sandbox-"  # then the creating process's pid and a random part
OPTIONAL = ("memory.oom.group", "memory.swap.max")  # Linux 4.19+; only with swap accounting
REMOVE_TIMEOUT_S = 2.0  # for the kernel to finish the processes cgroup.kill killed
_lock = threading.Lock()
_base: list[str | None] = []  # once decided: [the directory runs' cgroups go in, or None]


def plan(fs_type: str, euid: int, own: str, own_subtree: str,
         *, parent_subtree: str) -> tuple[str | None, str]:
    """Where this process's runs' cgroups go (a cgroup path, "/"-rooted, as /proc/self/cgroup
    writes it), or None and why not. `fs_type`: the file system mounted at /sys/fs/cgroup
    ("cgroup2" for v2), `own`: this process's cgroup, `*_subtree`: the cgroup.subtree_control
    of its cgroup and of that one's parent ("" if none)."""
    if euid != 0:
        return None, "the caller is not root"
    if fs_type != "cgroup2":
        return None, f"{CGROUP_FS} is {fs_type or 'not mounted'}, not cgroup v2"
    if set(CONTROLLERS) <= set(own_subtree.split()):
        return own, ""
    if own != "/" and set(CONTROLLERS) <= set(parent_subtree.split()):
        return os.path.dirname(own.rstrip("/")), ""
    return None, (f"neither its cgroup {own} nor that one's parent hands the memory and pids "
                  f"controllers down")


def limits(memory_bytes: int, max_processes: int) -> dict[str, str]:
    """A run's cgroup files and values: all its memory, and its processes (the sandbox's
    child too, hence the one more). Past memory.max the kernel kills every process in it
    (oom.group), as the deadline does, rather than one it picks while the rest go on. No swap,
    where swap is accounted: shared memory swapped out is memory still held."""
    return {"memory.max": str(memory_bytes), "memory.oom.group": "1", "memory.swap.max": "0",
            "pids.max": str(max_processes + 1)}


class RunCgroup:
    """One run's cgroup directory: made with its limits, joined by the sandbox's child (which
    writes its pid into cgroup.procs), then killed whole and removed."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def make(cls, base_dir: str, settings: dict[str, str]) -> RunCgroup:
        """A new cgroup in `base_dir` with `settings` written (an OPTIONAL file missing is
        skipped); OSError if it cannot be made."""
        path = os.path.join(base_dir, f"{PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
        os.mkdir(path)
        made = cls(path)
        try:
            for name, value in settings.items():
                if os.path.exists(os.path.join(path, name)):
                    made._write(name, value)
                elif name not in OPTIONAL:
                    raise FileNotFoundError(f"{path}/{name}: no such file")
        except BaseException:
            made.remove()
            raise
        return made

    def oom_kills(self) -> int:
        """How many of its processes the kernel killed at its memory limit."""
        with contextlib.suppress(OSError):
            with open(os.path.join(self.path, "memory.events"), encoding="ascii") as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        return 0

    def remove(self) -> None:
        """Kill every process left in it (cgroup.kill; before Linux 5.14, each listed one),
        wait until it is empty, and remove it; a warning if it stays."""
        for _ in range(3):  # listed ones may have forked meanwhile: pids.max bounds them
            if os.path.exists(os.path.join(self.path, "cgroup.kill")):
                self._write("cgroup.kill", "1")
            else:
                self.kill_listed()
            if self.wait_empty(REMOVE_TIMEOUT_S):
                break
        try:
            os.rmdir(self.path)
        except OSError as exc:
            log.warning("the sandbox's cgroup %s stays: %s", self.path, exc.strerror)

    def kill_listed(self) -> None:
        """SIGKILL each process its cgroup.procs lists (what cgroup.kill does, in one step)."""
        with open(os.path.join(self.path, "cgroup.procs"), encoding="ascii") as f:
            for pid in f.read().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def wait_empty(self, timeout_s: float) -> bool:
        """Whether it holds no process, waiting up to `timeout_s` for the kernel to say so
        (cgroup.events "populated 0"; the file signals a change as POLLPRI)."""
        deadline = time.monotonic() + timeout_s
        with open(os.path.join(self.path, "cgroup.events"), "rb", buffering=0) as events:
            poller = select.poll()
            poller.register(events, select.POLLPRI)
            while True:
                events.seek(0)
                if b"populated 0" in events.read().splitlines():
                    return True
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    return False
                poller.poll(left_s * 1000)

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w", encoding="ascii") as f:
            f.write(value)


@contextlib.contextmanager
def for_run(memory_bytes: int, max_processes: int) -> Iterator[RunCgroup | None]:
    """A cgroup for one run, removed on exit; None where this machine gives none (`plan`, or
    it could not be made: said once, and not tried again by this process)."""
    base = _base_dir()
    made = None
    if base is not None:
        try:
            made = RunCgroup.make(base, limits(memory_bytes, max_processes))
        except OSError as exc:
            _decide(None, f"a cgroup cannot be made in {base}: {exc}")
    try:
        yield made
    finally:
        if made is not None:
            made.remove()


def _base_dir() -> str | None:
    """The directory of the cgroup runs' cgroups go in, decided once per process; on the
    first decision, the empty cgroups of runs whose process died (a scoring worker killed at
    its deadline leaves its run's) are removed."""
    with _lock:
        if _base:
            return _base[0]
    fs_type, own = _mounted_type(), _own_cgroup()
    parent = os.path.dirname(own.rstrip("/"))
    found, why = plan(fs_type, os.geteuid(), own, _read(own, "cgroup.subtree_control"),
                      parent_subtree=_read(parent, "cgroup.subtree_control") if own != "/" else "")
    base = None if found is None else os.path.join(CGROUP_FS, found.lstrip("/"))
    if base is not None:
        remove_orphans(base)
    return _decide(base, why)


def _decide(base: str | None, why: str) -> str | None:
    with _lock:
        if _base != [base]:
            if base is None:
                log.info("sandboxed programs get no cgroup of their own (%s): their memory is "
                         "bounded per process and by their IPC namespace's limits", why)
            else:
                log.info("sandboxed programs run in cgroups of their own in %s", base)
        _base[:] = [base]
        return base


def remove_orphans(base: str) -> None:
    """Remove the runs' cgroups in `base` whose process has ended (those still holding a
    process stay: their turn comes with the next process to decide)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            pid = name.removeprefix(PREFIX).split("-")[0]
            if name.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(base, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


def _mounted_type() -> str:
    """The type of the file system mounted (last) at CGROUP_FS, "" if none."""
    found = ""
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:  # proc_pid_mountinfo(5): field 4 the mount point; after " - ", the type
            fields, _, rest = line.partition(" - ")
            if fields.split()[4] == CGROUP_FS:
                found = rest.split()[0]
    return found


def _own_cgroup() -> str:
    """This process's cgroup v2 path ("0::<path>" in /proc/self/cgroup), "/" if none listed."""
    with contextlib.suppress(OSError), open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip() or "/"
    return "/"


def _read(cgroup: str, name: str) -> str:
    with contextlib.suppress(OSError), \
            open(os.path.join(CGROUP_FS, cgroup.lstrip("/"), name), encoding="ascii") as f:
        return f.read()
    return ""
