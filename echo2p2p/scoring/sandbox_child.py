"""The sandbox's child: `python -I -S sandbox_child.py SPEC`, SPEC a JSON object (see `main`).

Started by `echo2p2p.scoring.sandbox.run_python` (read its docstring for what the sandbox
guarantees). It joins the run's cgroup if it has one, sets the resource limits on itself,
enters new mount, PID, network and IPC namespaces (and a new user namespace unless it is root)
when the kernel allows, as root sets the IPC namespace's limits, builds a new root holding
only the interpreter's files, a /proc of its own processes (as root) and WORK, all read-only
but WORK, and chroots there; then forks the program's interpreter (`main.py` in WORK), which a
root caller runs as uid/gid 65534 (nobody), waits for it and writes to REPORT: "isolated" or
"not isolated: <why>" and "uid <uid>" before the program starts, "status <wait status>" after.
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
CLONE_NEWIPC = 0x08000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 1 << 14, 1 << 18
LOCKED_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
                "relatime": 1 << 21}  # a remount in a user namespace must keep these as they are
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
NOBODY = 65534  # the uid and gid a root caller's program runs as


def main(spec: dict) -> int:
    """Limit and isolate this process, run the program in a fork, report how it ended. `spec`:
    work, report, parent (pid), processes, limits ({RLIMIT_NAME: value}), interpreter, root
    (an empty directory for the new root), binds (paths the interpreter needs), channel (fds
    handed to the program as its arguments), cgroup (the run's cgroup directory, or None),
    ipc ({/proc/sys name: value}: the limits of its IPC namespace, set as root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    work, root = spec["work"], spec["root"]
    with open(spec["report"], "w", buffering=1) as report:
        if spec["cgroup"]:  # first: every process it starts is counted there
            with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
        try:  # raising it needs no privilege
            with open("/proc/self/oom_score_adj", "w") as adj:
                adj.write("1000")  # it and its program go first when memory runs out, not the hub
        except OSError:
            pass  # no /proc: the kernel picks as it would
        for name, value in spec["limits"].items():  # never above this process's own
            hard = resource.getrlimit(getattr(resource, name))[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(getattr(resource, name), (value, value))
        as_root = os.geteuid() == 0
        problem = isolate(libc, work, root, spec["binds"], user_namespace=not as_root,
                          ipc_limits=spec["ipc"])
        report.write(f"not isolated: {problem}\n" if problem else "isolated\n")
        report.write(f"uid {NOBODY if as_root else os.getuid()}\n")
        die_with(libc, spec["parent"])
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        me = os.getpid()
        pid = os.fork()  # under a new PID namespace: its first process
        if pid == 0:
            try:
                die_with(libc, me)
                if as_root or not problem:  # counted per uid (per user namespace)
                    limit = spec["processes"]
                    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
                if as_root:  # setuid from root drops every capability
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                os.chdir(work)  # again: the directory entered before the bind mount is read-only
                os.execv(spec["interpreter"], [spec["interpreter"], "-I", "-S", "main.py",
                                               *map(str, spec["channel"])])
            except BaseException as exc:  # nothing of it may return into this process
                print(f"sandbox set-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                os._exit(SETUP_FAILED)
        _, status = os.waitpid(pid, 0)  # in a PID namespace: once every process in it is gone
        report.write(f"status {status}\n")
    return 0


def isolate(libc: ctypes.CDLL, work: str, root: str, binds: list[str],
            *, user_namespace: bool, ipc_limits: dict[str, str]) -> str:
    """Enter new mount, PID, network and IPC namespaces (and a user namespace:
    `user_namespace`) and build the program's root there (`build_root`; without a user
    namespace, with `ipc_limits` set); "" if done, else what failed (the program then runs
    with what was done). What the program makes of System V IPC and POSIX message queues is in
    that namespace, and dies with it: the host's namespace never holds it."""
    flags = (CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
             | (CLONE_NEWUSER if user_namespace else 0))
    if libc.unshare(flags) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    return build_root(libc, work, root, binds, ipc_limits=None if user_namespace else ipc_limits)


def build_root(libc: ctypes.CDLL, work: str, root: str, binds: list[str],
               *, ipc_limits: dict[str, str] | None) -> str:
    """Mount a tmpfs on `root`, bind `binds` and `work` into it at their own paths, unless
    `ipc_limits` is None (a user namespace) a /proc where the program's uid sees its own
    processes only (hidepid: not the hub's command line) and through which `ipc_limits` are
    set, make all of it read-only but `work`, and chroot there; "" if done, else what failed.
    Nothing else of the host's files exists for the program: the hub's run directory and keys
    are not there to read, nor /dev (so no /dev/shm: POSIX shared memory fails to open). In a
    user namespace the program's uid stays unmapped, so its exec drops every capability: it
    cannot undo the mounts, and cannot set the IPC namespace's limits either."""
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0 or libc.mount(
            b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=755") != 0:
        return f"mount: {os.strerror(ctypes.get_errno())}"
    kept: list[str] = []
    for path in sorted(binds) + [work]:
        if any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            continue  # inside one bound already
        inside = root + path
        if os.path.islink(path):  # /lib -> usr/lib on a merged /usr
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            os.symlink(os.readlink(path), inside)
            continue
        os.makedirs(inside, exist_ok=True)
        if libc.mount(path.encode(), inside.encode(), None, MS_BIND | MS_REC, None) != 0:
            return f"bind {path}: {os.strerror(ctypes.get_errno())}"
        kept.append(path)
    if ipc_limits is not None:  # root: a /proc that shows the program its own processes only
        os.makedirs(root + "/proc")
        if libc.mount(b"proc", (root + "/proc").encode(), b"proc",
                      MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=invisible") != 0:
            return f"proc: {os.strerror(ctypes.get_errno())}"
        for name, value in ipc_limits.items():  # writable until made read-only below (a
            try:  # host's /proc/sys may be already); they show the opener's IPC namespace
                with open(f"{root}/proc/sys/{name}", "w") as f:
                    f.write(value)
            except OSError as exc:
                return f"IPC limit {name}: {exc.strerror}"
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        mounts = [line.split() for line in f]
    inside_work = root + work
    for fields in mounts:  # proc_pid_mountinfo(5): field 4 is the mount point, 5 its options
        target = unescape(fields[4])
        if target == inside_work or not (target == root or target.startswith(root + "/")):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= LOCKED_FLAGS.get(option, 0)
        if libc.mount(None, target.encode(), None, flags, None) != 0:
            return f"read-only {target}: {os.strerror(ctypes.get_errno())}"
    os.chroot(root)
    os.chdir(work)
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
        import json

        sys.exit(main(json.loads(sys.argv[1])))
    except Exception as exc:  # the child's one boundary: say why on stderr, exit SETUP_FAILED
        print(f"sandbox set-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(SETUP_FAILED)
