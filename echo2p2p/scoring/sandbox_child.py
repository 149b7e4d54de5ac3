"""The sandbox's child: `python -I -S sandbox_child.py WORK REPORT PARENT PROCESSES NAME=LIMIT...`.

Started by `echo2p2p.scoring.sandbox.run_python` (read its docstring for what the sandbox
guarantees). It sets the resource limits on itself, enters new user, mount, PID and network
namespaces when the kernel allows, makes every mount read-only but WORK, then forks the
program's interpreter (`main.py` in WORK), waits for it and writes to REPORT: one line
"isolated" or "not isolated: <why>" before the program starts, and "status <wait status>" after.
A file of its own, importing only what it needs, so each run starts in a few milliseconds; it
knows nothing of rewards or of the rest of echo2p2p (which `-S` cannot import).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

SETUP_FAILED = 125  # the exit status when it could not set itself up

# Linux <sched.h>, <sys/mount.h> and <sys/prctl.h>
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 1 << 14, 1 << 18
LOCKED_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
                "relatime": 1 << 21}  # a remount in a user namespace must keep these as they are
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38


def main(work: str, report_path: str, parent: int, max_processes: int,
         limits: dict[str, int]) -> int:
    """Limit and isolate this process, run the program in a fork, report how it ended."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(report_path, "w", buffering=1) as report:
        for name, value in limits.items():
            resource.setrlimit(getattr(resource, name), (value, value))
        problem = isolate(libc, work)
        if not problem:  # counted per user namespace: the program's processes only
            resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
        report.write(f"not isolated: {problem}\n" if problem else "isolated\n")
        die_with(libc, parent)
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        me = os.getpid()
        pid = os.fork()  # under a new PID namespace: its first process
        if pid == 0:
            die_with(libc, me)
            os.chdir(work)  # again: the directory entered before the bind mount is read-only
            os.execv(sys.executable, [sys.executable, "-I", "-S", "main.py"])
        _, status = os.waitpid(pid, 0)  # in a PID namespace: once every process in it is gone
        report.write(f"status {status}\n")
    return 0


def isolate(libc: ctypes.CDLL, work: str) -> str:
    """Enter new user, mount, PID and network namespaces and make every mount read-only but
    `work`; "" if done, else what failed (the program then runs without them). The program's
    uid stays unmapped in the new user namespace, so its exec drops every capability: it
    cannot undo the mounts."""
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0 or \
            libc.mount(work.encode(), work.encode(), None, MS_BIND, None) != 0:
        return f"mount: {os.strerror(ctypes.get_errno())}"
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:  # proc_pid_mountinfo(5): field 4 is the mount point, 5 its options
        target = unescape(fields[4])
        if target == work:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= LOCKED_FLAGS.get(option, 0)
        if libc.mount(None, target.encode(), None, flags, None) != 0:
            return f"read-only {target}: {os.strerror(ctypes.get_errno())}"
    return ""


def unescape(path: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    for code in ("040", "011", "012", "134"):
        path = path.replace("\\" + code, chr(int(code, 8)))
    return path


def die_with(libc: ctypes.CDLL, parent: int) -> None:
    """SIGKILL this process when `parent` goes (set after unshare: entering a user namespace
    clears it), and go now if it has gone already. A PID namespace's first process sees its
    parent as 0; if that one went already, the deadline's group kill takes it."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() not in (parent, 0):
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    try:
        args = sys.argv[1:]
        pairs = (arg.split("=") for arg in args[4:])
        sys.exit(main(args[0], args[1], int(args[2]), int(args[3]),
                      {name: int(value) for name, value in pairs}))
    except Exception as exc:  # the child's one boundary: say why on stderr, exit SETUP_FAILED
        print(f"sandbox set-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(SETUP_FAILED)
