"""Run untrusted Python source in a subprocess under the limits Linux gives: the code sandbox.

`run_python(source)` writes `source` to `main.py` in a fresh temporary directory (removed after
the run), and runs it with the Python installation's interpreter, `-I -S` (isolated mode and no
`site`: no site-packages, no user site, no PYTHON* variables; the standard library only) in an
empty environment, stdin from /dev/null, stdout and stderr to files. A child (`sandbox_child`)
sets the limits and namespaces below on itself, then forks the program's interpreter and waits.

What it guarantees (Linux):
- time: at `timeout_s` wall time (start-up included) its process group is SIGKILLed, and each
  process has RLIMIT_CPU of ceil(timeout_s) + 1 s;
- memory: RLIMIT_AS of `memory_bytes` per process (past it an allocation raises MemoryError).
  For a root caller where cgroup v2 hands the memory and pids controllers down
  (`sandbox_cgroup`; `cgroup` in the result), all its processes share a cgroup of their own:
  memory.max of `memory_bytes` for them together, shared memory and the kernel's memory for
  their IPC objects included (past it the kernel kills them all: "killed by SIGKILL (the memory
  limit)"), pids.max of `max_processes` (and its child), killed whole and removed after the run.
  Its processes are the first the kernel's OOM killer takes (oom_score_adj 1000), before the
  hub's;
- files: RLIMIT_FSIZE of `file_bytes` per file written (stdout and stderr too), RLIMIT_NOFILE of
  `max_open_files`, no core dumps; its working directory is removed afterwards;
- environment: none of the caller's variables reach it;
- user: a root caller's program runs as uid and gid 65534 (nobody), with no capabilities and
  RLIMIT_NPROC of `max_processes`; no file of the hub's is its, and no /proc/<pid> of a root
  process opens for it;
- when this process may create namespaces (root: mount, PID, network and IPC ones; otherwise a
  user namespace too, if unprivileged ones are on), `isolated` in the result: its root directory
  is a new one (chroot) holding only the system's programs and libraries (/bin, /lib*, /usr),
  the Python installation, a /proc that shows it its own processes only (for a root caller:
  hidepid, no other user's command line) and its working directory, all read-only but that
  directory: nothing else of the host exists for it, the hub's run directory and key included.
  No network: the new namespace has only a loopback interface, down, so no connection succeeds,
  127.0.0.1 included. Every process it starts dies with it (the kernel kills a PID namespace
  whole when its first process ends, and that one dies with this child).
  IPC: its System V shared memory, semaphores and message queues and its POSIX message queues
  are its own IPC namespace's, never the host's, and go with it: nothing of them is left once
  the run ends (the kernel frees a dead namespace's objects on its work queue, moments after).
  Its root has no /dev, so no /dev/shm: POSIX shared memory and named semaphores fail to open
  (ENOENT). For a root caller the namespace has limits (`ipc_limits`): `memory_bytes` of System
  V segments in all, each removed when it is last detached (so filled segments cannot pile up
  past what its processes map, which RLIMIT_AS bounds), IPC_OBJECTS segments, message queues and
  semaphore sets, and RLIMIT_MSGQUEUE of QUEUE_BYTES (at most the caller's own) for its uid's
  POSIX queues.
  A caller that is not root cannot change uid: its program keeps the caller's uid, unmapped in
  its user namespace (so its exec drops every capability), and gets no /proc (whose
  /proc/<pid>/root would reach the caller's files), at most `max_processes` processes; its IPC
  namespace keeps the kernel's defaults (an unmapped uid cannot set its limits): its objects
  still go with it, but while it runs the System V segments it fills and detaches are not
  bounded (its POSIX queues are, by RLIMIT_MSGQUEUE).
  Without namespaces (`isolated` False, logged once at WARNING; a hub refuses to start a
  reward that runs programs on such a machine unless given --unisolated-code): no network, mount, process or
  IPC isolation and no new root: what it makes of shared memory and message queues is the host's
  and stays, and only the process group is killed, which a process that calls setsid() escapes
  (but not its cgroup, where it has one). As root the program still runs as nobody (and fails to
  start if the interpreter lies where nobody may not go, as under a /root of mode 0700: safe,
  scores 0).

What it does not guarantee: it is no security boundary against a program that exploits the kernel
or Python itself. Run by a caller that is not root and without namespaces, the program can read
every file the caller can, the hub's key included: run the hub as root (its programs run as
nobody), where unprivileged user namespaces are on, or in a container. Disk use is bounded per
file, not in total. Without a cgroup, memory is bounded per process, not in total: up to
`max_processes` times `memory_bytes` (for a root caller, its System V segments included: one
that none of its processes maps is gone, or never had a page); and the program's uid counts
against RLIMIT_NPROC and RLIMIT_MSGQUEUE with every other process of that uid (nobody, for a
root caller).
Not POSIX-portable: it needs Linux and Python 3.11+.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import sandbox_cgroup, sandbox_child

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_BYTES = 256 * 2**20
DEFAULT_FILE_BYTES = 2**20
DEFAULT_OPEN_FILES = 64
DEFAULT_PROCESSES = 32
QUEUE_BYTES = 2**20  # RLIMIT_MSGQUEUE: POSIX message queues' bytes, for the program's uid
IPC_OBJECTS = 16  # System V segments, message queues and semaphore sets, each, in its namespace
TAIL_BYTES = 4096  # of stdout and of stderr, kept in the result
# The interpreter the program runs on: the installation's own, never a virtual environment's
# (whose site-packages `-S` skips anyway, and whose folder the program's root does not hold).
INTERPRETER = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
_warned_unisolated = False


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended."""

    passed: bool  # exited with status 0 within the time limit
    exit_code: int | None  # the program's exit status; -N: killed by signal N; None: timed out
    timed_out: bool  # killed at the wall-clock deadline
    stdout_tail: str  # the last TAIL_BYTES of its stdout (UTF-8, undecodable bytes replaced)
    stderr_tail: str
    why: str  # "" when passed, else a short reason: "timed out after 2 s", "exit status 1: ..."
    isolated: bool  # ran in its own namespaces and root directory (module docstring)
    uid: int | None  # the program's uid (65534: nobody, for a root caller); None: set-up failed
    cgroup: bool  # its processes ran in a cgroup v2 of their own (memory.max, pids.max)


def run_python(source: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               memory_bytes: int = DEFAULT_MEMORY_BYTES, file_bytes: int = DEFAULT_FILE_BYTES,
               max_open_files: int = DEFAULT_OPEN_FILES,
               max_processes: int = DEFAULT_PROCESSES,
               talk: Callable[[Channel], None] | None = None) -> SandboxResult:
    """Run `source` as a Python program under the limits of the module docstring; blocks for at
    most about `timeout_s`. Call it off the event loop (the scorer's workers do). `talk`: called
    while the program runs, with a `Channel` to it (the program gets the fds of its two pipes
    as its arguments: `main.py IN OUT`); the program is ended once `talk` returns."""
    if not timeout_s > 0 or min(memory_bytes, file_bytes, max_open_files, max_processes) < 1:
        raise ValueError("sandbox limits must be positive")
    root = os.path.realpath(tempfile.mkdtemp(prefix="echo2-sandbox-"))  # as mountinfo spells it
    try:
        work, jail = os.path.join(root, "work"), os.path.join(root, "jail")
        os.mkdir(work)
        os.mkdir(jail)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(source)
        if os.geteuid() == 0:  # its program runs as nobody (sandbox_child.NOBODY), which
            os.chown(work, sandbox_child.NOBODY, sandbox_child.NOBODY)  # must pass through
            os.chmod(root, 0o711)  # root (mkdtemp's 0700) when no chroot hides it
        limits = {"RLIMIT_CPU": math.ceil(timeout_s) + 1, "RLIMIT_AS": memory_bytes,
                  "RLIMIT_FSIZE": file_bytes, "RLIMIT_NOFILE": max_open_files, "RLIMIT_CORE": 0,
                  "RLIMIT_MSGQUEUE": QUEUE_BYTES}
        with _pipes(talk is not None) as (theirs, ours), \
                sandbox_cgroup.for_run(memory_bytes, max_processes) as cgroup:
            spec = {"work": work, "report": os.path.join(root, "report"),
                    "parent": os.getpid(), "processes": max_processes, "limits": limits,
                    "interpreter": INTERPRETER, "root": jail, "binds": _binds(),
                    "channel": theirs, "cgroup": cgroup and cgroup.path,
                    "ipc": ipc_limits(memory_bytes)}
            argv = [sys.executable, "-I", "-S", sandbox_child.__file__, json.dumps(spec)]
            timed_out, returncode = _run_child(root, argv, timeout_s, theirs, ours=ours, talk=talk)
            out_of_memory = cgroup is not None and cgroup.oom_kills() > 0
        return _result(root, timed_out, returncode, timeout_s, cgroup=cgroup is not None,
                       out_of_memory=out_of_memory)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ipc_limits(memory_bytes: int) -> dict[str, str]:
    """The limits of a program's IPC namespace, as its /proc/sys files and their values (a new
    namespace starts with the kernel's defaults, not the host's settings: about 2**64 bytes of
    System V shared memory, 32,000 message queues). Its System V segments hold `memory_bytes`
    in all, and each goes when it is last detached (or, never attached, when the process that
    made it ends: shm_rmid_forced), not at the end of the run."""
    page_bytes = os.sysconf("SC_PAGE_SIZE")
    n = str(IPC_OBJECTS)
    shm_pages = -(-memory_bytes // page_bytes)
    return {"kernel/shmmax": str(memory_bytes), "kernel/shmall": str(shm_pages),
            "kernel/shmmni": n, "kernel/shm_rmid_forced": "1", "kernel/msgmni": n,
            "kernel/sem": f"64 {64 * IPC_OBJECTS} 64 {n}",  # per set, in all, per call, sets
            "fs/mqueue/queues_max": n}


def sandbox_refusal(timeout_s: float = 30.0, unisolated: bool = False) -> str | None:
    """Why this machine cannot run a program in the sandbox (a trivial one fails, or, unless
    `unisolated` is accepted, it ran without namespaces of its own), or None. Checked before a
    run whose reward runs programs: otherwise every sample would score 0, or strangers'
    programs would reach the host."""
    result = run_python("print('ok')", timeout_s=timeout_s)
    if not (result.passed and result.stdout_tail.strip() == "ok"):
        return (f"the code sandbox cannot run a program here ({result.why or 'no output'}); as "
                "root it runs programs as nobody, who must be able to reach the Python "
                f"interpreter {INTERPRETER} (or the kernel must allow user and mount namespaces)")
    if result.isolated or unisolated:
        return None
    return ("the code sandbox cannot give programs namespaces of their own here (no user "
            "namespaces for this user): they would reach the network and leave shared memory "
            "behind; run the hub as root, allow unprivileged user namespaces (sysctl "
            "kernel.unprivileged_userns_clone=1 or user.max_user_namespaces), or pass "
            "--unisolated-code to run them anyway")


class Channel:
    """Lines to and from a program `run_python` runs, each wait bounded by its deadline."""

    def __init__(self, to_program: int, from_program: int, deadline: float):
        self._out, self._in, self.deadline = to_program, from_program, deadline
        self.hung_up = False  # the program closed its end (it ended, or closed the pipes)
        os.set_blocking(to_program, False)
        os.set_blocking(from_program, False)
        self._buffer = b""

    def ask(self, line: bytes, max_bytes: int = 2**20) -> bytes | None:
        """Send `line` (a newline is added) and read one line back (without its newline); None
        if the program closed its end, did not answer by the deadline, or answered more than
        `max_bytes`."""
        data = line + b"\n"
        while data:
            if not self._wait(write=True):
                return None
            try:
                data = data[os.write(self._out, data):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                self.hung_up = True
                return None
        while b"\n" not in self._buffer:
            if len(self._buffer) > max_bytes or not self._wait(write=False):
                return None
            try:
                more = os.read(self._in, 65536)
            except BlockingIOError:
                continue
            if not more:
                self.hung_up = True
                return None
            self._buffer += more
        answer, _, self._buffer = self._buffer.partition(b"\n")
        return answer if len(answer) <= max_bytes else None

    def _wait(self, write: bool) -> bool:
        left_s = self.deadline - time.monotonic()
        if left_s <= 0:
            return False
        fds = ([], [self._out], []) if write else ([self._in], [], [])
        return bool(any(select.select(*fds, left_s)))


def _binds() -> list[str]:
    """What the program's interpreter needs of the host's files: the system's programs and
    libraries, and the Python installation (`INTERPRETER`'s prefix)."""
    system = [p for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr")
              if os.path.lexists(p)]
    return system + [os.path.realpath(sys.base_prefix)]


@contextlib.contextmanager
def _pipes(wanted: bool) -> Iterator[tuple[list[int], list[int]]]:
    """Two pipes for a `Channel` ([] and [] if not `wanted`): the program's ends (its in, its
    out) and ours (to it, from it). Whoever closes one takes it out of its list; those left
    are closed on exit (never one twice: its number may be another thread's file by then)."""
    if not wanted:
        yield [], []
        return
    (their_in, to_it), (from_it, their_out) = os.pipe(), os.pipe()
    theirs, ours = [their_in, their_out], [to_it, from_it]
    try:
        yield theirs, ours
    finally:
        while theirs or ours:
            os.close((theirs or ours).pop())


def _run_child(root: str, argv: list[str], timeout_s: float, theirs: list[int],
               *, ours: list[int], talk: Callable[[Channel], None] | None) -> tuple[bool, int]:
    """Start the child in a session of its own, `talk` to its program if asked, wait for it
    until the deadline, then SIGKILL its whole process group, before reaping it (so the group
    id cannot have been reused)."""
    deadline = time.monotonic() + timeout_s
    with open(os.path.join(root, "stdout"), "wb") as out, \
            open(os.path.join(root, "stderr"), "wb") as err:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 env={}, cwd=root, close_fds=True, pass_fds=theirs,
                                 start_new_session=True)
    try:
        while theirs:  # the child has them: our copies would hide its end's closing
            os.close(theirs.pop())
        if talk is not None:
            talk(Channel(ours[0], ours[1], deadline))
            while ours:  # the program sees the end of its input: it is done
                os.close(ours.pop())
        timed_out = not _wait_exited(child, max(0.0, deadline - time.monotonic()))
        try:
            os.killpg(child.pid, signal.SIGKILL)  # what it left behind, or all of it
        except ProcessLookupError:
            pass
    finally:
        child.kill()  # a no-op unless something above raised
        returncode = child.wait()
    return timed_out, returncode


def _wait_exited(child: subprocess.Popen, timeout_s: float) -> bool:
    """Whether `child` exits within `timeout_s`, left a zombie (not reaped) so that its pid,
    and so its process group's id, stay taken. Linux before 5.3 has no pidfd: there the child
    is reaped, and its group id could in principle be reused before the group kill."""
    try:
        exited = os.pidfd_open(child.pid)
    except OSError:
        try:
            child.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:  # readable once the child has exited
        return bool(select.select([exited], [], [], timeout_s)[0])
    finally:
        os.close(exited)


def _result(root: str, timed_out: bool, returncode: int, timeout_s: float, *, cgroup: bool,
            out_of_memory: bool) -> SandboxResult:
    report = _read(os.path.join(root, "report"), 4096).splitlines()
    isolated = bool(report) and report[0] == "isolated"
    if report and not isolated:
        _warn_once(report[0].removeprefix("not isolated: "))
    status = next((int(line.split()[1]) for line in report if line.startswith("status ")), None)
    uid = next((int(line.split()[1]) for line in report if line.startswith("uid ")), None)
    if timed_out:
        code = None
    else:  # the program's own status, else (set-up failed) the child's
        code = returncode if status is None else os.waitstatus_to_exitcode(status)
    stdout = _read(os.path.join(root, "stdout"), TAIL_BYTES)
    stderr = _read(os.path.join(root, "stderr"), TAIL_BYTES)
    if timed_out:
        why = f"timed out after {timeout_s:g} s"
    elif code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        why = f"killed by {name}" + {"SIGXCPU": " (the CPU time limit)",
                                     "SIGXFSZ": " (the file size limit)",
                                     "SIGKILL": " (the memory limit)" if out_of_memory else ""
                                     }.get(name, "")
    elif code:
        last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        why = f"exit status {code}" + (f": {last[:200]}" if last else "")
    else:
        why = ""
    return SandboxResult(passed=code == 0, exit_code=code, timed_out=timed_out,
                         stdout_tail=stdout, stderr_tail=stderr, why=why, isolated=isolated,
                         uid=uid, cgroup=cgroup)


def _read(path: str, tail_bytes: int) -> str:
    """The last `tail_bytes` of a file as text ("" if it is not there)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - tail_bytes))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def _warn_once(reason: str) -> None:
    global _warned_unisolated
    if not _warned_unisolated:
        _warned_unisolated = True
        log.warning("sandboxed programs run without network, mount, process or IPC isolation "
                    "on this machine (%s): they can reach the network, write what this user can "
                    "write, leave shared memory and message queues behind in the host's IPC "
                    "namespace, and a process that leaves its group outlives the run", reason)
