"""What the host's IPC namespace holds, for the sandbox's tests (unit and hostile): System V
objects as /proc/sysvipc lists them, POSIX message queues by name, shared memory in use; and
the removal of what a test's program left there, so that a run against a sandbox that leaks
(today's main, for the red check) leaves nothing behind on the machine either."""

from __future__ import annotations

import ctypes
import os

KINDS = ("shm", "msg", "sem")
IPC_RMID = 0
_libc = ctypes.CDLL(None, use_errno=True)
_rt = ctypes.CDLL("librt.so.1", use_errno=True)  # mq_*: in libc since glibc 2.34, else here
_rt.mq_open.restype = ctypes.c_int  # variadic (name, flags[, mode, attr]): two arguments here
_rt.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
_rt.mq_unlink.argtypes = [ctypes.c_char_p]


def sysv(kind: str) -> dict[int, tuple[int, int]]:
    """The host's System V objects of `kind` ("shm", "msg", "sem"): id -> (key, owner's uid),
    from /proc/sysvipc (which shows the namespace of the process reading it)."""
    with open(f"/proc/sysvipc/{kind}", encoding="ascii") as f:
        header, *rows = [line.split() for line in f]
    key, uid = header.index("key"), header.index("uid")
    return {int(r[1]): (int(r[key]), int(r[uid])) for r in rows}


def remove_sysv(kind: str, ids: set[int]) -> None:
    """Remove the host's System V objects `ids` of `kind` (those gone already are skipped)."""
    for ipc_id in ids:
        if kind == "sem":
            _libc.semctl(ipc_id, 0, IPC_RMID)
        else:
            getattr(_libc, f"{kind}ctl")(ipc_id, IPC_RMID, None)


def queue_exists(name: str) -> bool:
    """Whether the host holds the POSIX message queue `name` ("/..."), by opening it."""
    fd = _rt.mq_open(name.encode(), os.O_RDONLY)
    if fd >= 0:
        os.close(fd)  # a queue descriptor is a file descriptor on Linux
        return True
    return False


def unlink_queue(name: str) -> None:
    _rt.mq_unlink(name.encode())


def shmem_bytes() -> int:
    """The host's shared memory in use (/proc/meminfo's Shmem: tmpfs and System V segments)."""
    with open("/proc/meminfo", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Shmem:"))
