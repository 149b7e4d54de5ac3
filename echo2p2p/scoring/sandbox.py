"""Run untrusted Python source in a subprocess under the limits Linux gives: the code sandbox.

`run_python(source)` writes `source` to `main.py` in a fresh temporary directory (removed after
the run), and runs it with `sys.executable -I -S` (isolated mode and no `site`: no site-packages,
no user site, no PYTHON* variables; the standard library only) in an empty environment, stdin
from /dev/null, stdout and stderr to files. A child (`sandbox_child`) sets the limits and
namespaces below on itself, then forks the program's interpreter and waits for it.

What it guarantees (Linux):
- time: at `timeout_s` wall time (start-up included) its process group is SIGKILLed, and each
  process has RLIMIT_CPU of ceil(timeout_s) + 1 s;
- memory: RLIMIT_AS of `memory_bytes` per process (past it an allocation raises MemoryError);
- files: RLIMIT_FSIZE of `file_bytes` per file written (stdout and stderr too), RLIMIT_NOFILE of
  `max_open_files`, no core dumps; its working directory is removed afterwards;
- environment: none of the caller's variables reach it;
- when this process may create a user namespace (root, or unprivileged user namespaces on),
  `isolated` in the result: the program runs in new user, mount, PID and network namespaces, with
  no capabilities outside them (none inside either: its uid is unmapped, so exec drops them). No
  network: the new namespace has only a loopback interface, down, so no connection succeeds,
  127.0.0.1 included. Every mount is read-only but the working directory. Every process it
  starts dies with it (the kernel kills a PID namespace whole when its first process ends, and
  that one dies with this child), at most `max_processes` of them for a caller that is not root.
  Without that (`isolated` False, logged once at WARNING): no network, mount or process
  isolation, and only the process group is killed, which a process that calls setsid() escapes.

What it does not guarantee: it is no security boundary against a program that exploits the kernel
or Python itself. It runs as the caller's uid: it can read every file the caller can, the hub's
own keys included (as root: almost every file); run the hub as an unprivileged user with nothing
secret readable, or in a container, to rule that out. Root is exempt from RLIMIT_NPROC, so a
fork bomb under a root caller runs until the deadline. Disk use is bounded per file, not in total.
Host processes stay visible in /proc. Not POSIX-portable: it needs Linux and Python 3.11+.
"""

from __future__ import annotations

import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from . import sandbox_child

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_BYTES = 256 * 2**20
DEFAULT_FILE_BYTES = 2**20
DEFAULT_OPEN_FILES = 64
DEFAULT_PROCESSES = 32
TAIL_BYTES = 4096  # of stdout and of stderr, kept in the result
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
    isolated: bool  # ran in its own user, mount, PID and network namespaces (module docstring)


def run_python(source: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               memory_bytes: int = DEFAULT_MEMORY_BYTES, file_bytes: int = DEFAULT_FILE_BYTES,
               max_open_files: int = DEFAULT_OPEN_FILES,
               max_processes: int = DEFAULT_PROCESSES) -> SandboxResult:
    """Run `source` as a Python program under the limits of the module docstring; blocks for at
    most about `timeout_s`. Call it off the event loop (the scorer's workers do)."""
    if not timeout_s > 0 or min(memory_bytes, file_bytes, max_open_files, max_processes) < 1:
        raise ValueError("sandbox limits must be positive")
    root = os.path.realpath(tempfile.mkdtemp(prefix="echo2-sandbox-"))  # as mountinfo spells it
    try:
        work = os.path.join(root, "work")
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(source)
        limits = {"RLIMIT_CPU": math.ceil(timeout_s) + 1, "RLIMIT_AS": memory_bytes,
                  "RLIMIT_FSIZE": file_bytes, "RLIMIT_NOFILE": max_open_files, "RLIMIT_CORE": 0}
        argv = [sys.executable, "-I", "-S", sandbox_child.__file__, work,
                os.path.join(root, "report"), str(os.getpid()), str(max_processes),
                *(f"{name}={value}" for name, value in limits.items())]
        timed_out, returncode = _run_child(root, argv, timeout_s)
        return _result(root, timed_out, returncode, timeout_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_child(root: str, argv: list[str], timeout_s: float) -> tuple[bool, int]:
    """Start the child in a session of its own, wait for it until the deadline, then SIGKILL its
    whole process group, before reaping it (so the group id cannot have been reused)."""
    with open(os.path.join(root, "stdout"), "wb") as out, \
            open(os.path.join(root, "stderr"), "wb") as err:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 env={}, cwd=root, close_fds=True, start_new_session=True)
    try:
        timed_out = not _wait_exited(child, timeout_s)
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


def _result(root: str, timed_out: bool, returncode: int, timeout_s: float) -> SandboxResult:
    report = _read(os.path.join(root, "report"), 4096).splitlines()
    isolated = bool(report) and report[0] == "isolated"
    if report and not isolated:
        _warn_once(report[0].removeprefix("not isolated: "))
    status = next((int(line.split()[1]) for line in report if line.startswith("status ")), None)
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
                                     "SIGXFSZ": " (the file size limit)"}.get(name, "")
    elif code:
        last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        why = f"exit status {code}" + (f": {last[:200]}" if last else "")
    else:
        why = ""
    return SandboxResult(passed=code == 0, exit_code=code, timed_out=timed_out,
                         stdout_tail=stdout, stderr_tail=stderr, why=why, isolated=isolated)


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
        log.warning("sandboxed programs run without network, mount or process isolation on this "
                    "machine (%s): they can reach the network, write what this user can write, "
                    "and a process that leaves its group outlives the run", reason)
