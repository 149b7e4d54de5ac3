"""The sandbox (limits, throwaway directory, no network, processes killed whole, IPC objects in
a namespace of its own) and the code task's reward that runs a completion's program against its
row's tests in it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo2p2p.scoring.code import ForgedPass, code_tests, program_of
from echo2p2p.scoring import sandbox
from echo2p2p.scoring.sandbox import INTERPRETER, ipc_limits, run_python, sandbox_refusal

from . import host_ipc

ROOT = Path(__file__).resolve().parents[3]
ADD = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0"]}


@pytest.fixture(scope="module")
def isolated() -> bool:
    """Whether this machine lets the sandbox make its namespaces (else those tests skip)."""
    return run_python("pass").isolated


def need(isolated: bool) -> None:
    if not isolated:
        pytest.skip("no user namespaces here (root, or unprivileged user namespaces, needed): "
                    "the sandbox runs without network, mount and PID isolation")


def gone(pid: int, within_s: float = 2.0) -> bool:
    """Whether process `pid` has ended (exited, or a zombie), waiting up to `within_s` for it."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], within_s)[0])
    finally:
        os.close(fd)


def test_a_passing_program_scores_1_and_a_failing_assert_0():
    """A program whose tests pass scores 1.0, one with a failing assert 0.0."""
    row = {"tests": "assert add(2, 3) == 5"}
    assert code_tests("", "def add(a, b):\n    return a + b\n", row) == 1.0
    assert code_tests("", "def add(a, b):\n    return a - b\n", row) == 0.0
    failed = run_python("assert 1 == 2")
    assert not failed.passed and failed.exit_code == 1 and "AssertionError" in failed.why


def test_listed_tests_score_the_fraction_that_pass():
    """A list of tests scores the fraction passing; each runs after one before it failed."""
    assert code_tests("", "def add(a, b):\n    return a + b", ADD) == pytest.approx(2 / 3)
    assert code_tests("", "def add(a, b):\n    raise ValueError", ADD) == 0.0
    assert code_tests("", "this is not python", ADD) == 0.0


def test_ending_the_process_early_passes_nothing():
    """sys.exit() before the tests passes nothing; os._exit(0) before or during them is a
    forgery (ForgedPass); a test that a function of the program left scores the ones before."""
    for quits in ("import sys; sys.exit(0)", "raise SystemExit"):
        assert code_tests("", quits, ADD) == 0.0
    for cheat in ("import os; os._exit(0)", "def add(a, b):\n    import os; os._exit(0)"):
        with pytest.raises(ForgedPass):
            code_tests("", cheat, ADD)
    dies = "def add(a, b):\n    import os\n    if a == 2: os._exit(3)\n    return a + b"
    assert code_tests("", dies, ADD) == pytest.approx(1 / 3)  # test 2 cannot ask it any more
    # sys.exit() inside a function (common in contest code) fails that call, no forgery
    gives_up = "def add(a, b):\n    import sys\n    if a == 2: sys.exit(0)\n    return a + b"
    assert code_tests("", gives_up, ADD) == pytest.approx(2 / 3)


def test_the_program_is_the_fenced_block_or_the_template():
    """A fenced block is the code; "{prompt}{completion}" continues the prompt."""
    fenced = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert program_of("", fenced, {}) == "def add(a, b):\n    return a + b\n"
    assert code_tests("", fenced, {"tests": "assert add(1, 1) == 2"}) == 1.0
    row = {"program": "{prompt}{completion}", "tests": "assert x == 85"}
    assert code_tests("x = 47+", "38", row) == 1.0
    assert code_tests("x = 47+", "39", row) == 0.0


def test_code_tests_pickles_for_the_scorer_workers():
    """The reward is a module-level function: it pickles by reference, as a worker needs."""
    assert pickle.loads(pickle.dumps(code_tests)) is code_tests


def test_an_endless_loop_is_killed_at_the_time_limit():
    """`while True: pass` is killed at timeout_s and the call returns."""
    start = time.monotonic()
    result = run_python("while True: pass", timeout_s=0.5)
    assert result.timed_out and not result.passed and result.exit_code is None
    assert "timed out" in result.why
    assert time.monotonic() - start < 10  # generous: the deadline is 0.5 s
    assert code_tests("", "while True: pass", {"tests": "pass", "timeout_s": 0.5}) == 0.0


def test_allocating_2_gb_fails_under_the_memory_limit():
    """An allocation past memory_bytes raises MemoryError in the program."""
    result = run_python("x = bytearray(2 * 1024**3)", memory_bytes=256 * 2**20)
    assert not result.passed and "MemoryError" in result.why
    assert run_python("x = bytearray(16 * 2**20)", memory_bytes=256 * 2**20).passed


def test_writing_a_10_mb_file_fails_under_the_file_limit():
    """A file past file_bytes cannot be written (EFBIG); a small one can."""
    big = run_python("open('big', 'wb').write(b'x' * 10_000_000)", file_bytes=2**20)
    assert not big.passed and "File too large" in big.why
    assert run_python("open('small', 'wb').write(b'x' * 100_000)", file_bytes=2**20).passed


def test_the_throwaway_directory_is_gone_afterwards():
    """The program runs in a fresh directory, which is removed with what it wrote there."""
    result = run_python("import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())")
    assert result.passed
    work = Path(result.stdout_tail.strip())
    assert work.name == "work" and work.parent.name.startswith("echo2-sandbox-")
    assert not work.parent.exists()


SPAWN = """\
import os, time
r, w = os.pipe()
for _ in range({n}):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        {escape}
        print(os.readlink('/proc/self'), flush=True)  # its pid as the caller sees it
        os.write(w, b'.')
        time.sleep(60)
        os._exit(0)
    os.read(r, 1)
{then}
"""


@pytest.mark.parametrize("then", ["pass", "time.sleep(60)"], ids=["exits", "hangs"])
def test_children_left_running_are_killed_with_the_program(then):
    """Processes the program forked die with it, whether it exits or is killed at the deadline."""
    hangs = then != "pass"
    result = run_python(SPAWN.format(n=3, escape="pass", then=then),
                        timeout_s=1.0 if hangs else 5.0)
    assert result.timed_out == hangs
    pids = [int(line) for line in result.stdout_tail.split()]
    assert len(pids) == 3
    assert all(gone(pid) for pid in pids)


def test_a_fork_loop_is_bounded_and_killed_whole(isolated):
    """A program forking in a loop gets at most max_processes (with namespaces, or run as
    nobody by a root caller), and every child it made is gone after the run."""
    result = run_python(SPAWN.format(n=40, escape="pass", then="pass"), max_processes=16)
    pids = [int(line) for line in result.stdout_tail.split()]
    assert pids and all(gone(pid) for pid in pids)
    if isolated or os.geteuid() == 0:  # a root caller's program runs as nobody: not exempt
        assert len(pids) < 16
    else:
        assert len(pids) == 40


def test_a_child_that_leaves_the_group_is_killed_too(isolated):
    """With a PID namespace, a child that calls setsid() (out of the killed group) dies too."""
    need(isolated)
    result = run_python(SPAWN.format(n=2, escape="os.setsid()", then="pass"))
    pids = [int(line) for line in result.stdout_tail.split()]
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


IPC = """\
import ctypes, os
libc, rt = ctypes.CDLL(None, use_errno=True), ctypes.CDLL('librt.so.1', use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
def made(what, result):
    print(what + ':', 'made' if result >= 0 else os.strerror(ctypes.get_errno()), flush=True)
segment = libc.shmget({key}, 2**20, 0o1600)
made('shm', segment)
if segment >= 0:
    ctypes.memset(libc.shmat(segment, None, 0), 1, 2**20)
made('msg', libc.msgget({key}, 0o1600))
made('sem', libc.semget({key}, 1, 0o1600))
made('mq', rt.mq_open({name!r}.encode(), os.O_CREAT | os.O_RDWR, 0o600, None))
try:
    import _posixshmem
    made('posix shm', _posixshmem.shm_open({name!r}, os.O_CREAT | os.O_RDWR, 0o600))
except OSError as e:
    print('posix shm:', e.strerror, flush=True)
{then}
"""


def fresh_key() -> int:
    """A System V key no one uses (random, never IPC_PRIVATE's 0)."""
    return 0x2E000000 + int.from_bytes(os.urandom(3), "big")


@pytest.mark.parametrize("then", ["pass", "import time; time.sleep(60)"], ids=["exits", "hangs"])
def test_shared_memory_and_message_queues_are_not_the_hosts(isolated, then):
    """With namespaces, the System V segment, message queue and semaphore set and the POSIX
    message queue a program makes are its own IPC namespace's (made there), never the host's:
    none is left after the run, whether the program exits or is killed at the deadline; and
    its root has no /dev/shm, so POSIX shared memory is refused."""
    need(isolated)
    key, name = fresh_key(), f"/echo2-test-{os.urandom(4).hex()}"
    try:
        result = run_python(IPC.format(key=key, name=name, then=then),
                            timeout_s=1.0 if "sleep" in then else 5.0)
        said = dict(line.split(": ", 1) for line in result.stdout_tail.splitlines())
        left = {kind: [i for i, (k, _) in host_ipc.sysv(kind).items() if k == key]
                for kind in host_ipc.KINDS}
        assert left == {"shm": [], "msg": [], "sem": []}
        assert not host_ipc.queue_exists(name)
        assert not os.path.exists("/dev/shm" + name)
        assert said == {"shm": "made", "msg": "made", "sem": "made", "mq": "made",
                        "posix shm": "No such file or directory"}, result.stdout_tail
    finally:  # what a leaking sandbox left (the red check on the old one)
        for kind in host_ipc.KINDS:
            host_ipc.remove_sysv(kind, {i for i, (k, _) in host_ipc.sysv(kind).items() if k == key})
        host_ipc.unlink_queue(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink("/dev/shm" + name)


SHM_BOMB = """\
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
SIZE, buf = 16 * 2**20, ctypes.create_string_buffer(512)
touched = []
for i in range(40):  # 640 MiB, one 16 MiB segment at a time: made, filled, detached, kept
    segment = libc.shmget({key} + i, SIZE, 0o1600)
    if segment < 0:
        break
    address = libc.shmat(segment, None, 0)
    ctypes.memset(address, 1, SIZE)
    libc.shmdt(address)
    touched.append(segment)
print('touched', len(touched), flush=True)
print('alive', sum(libc.shmctl(s, 2, buf) == 0 for s in touched), flush=True)  # IPC_STAT
reserved = 0
while reserved < 40 and libc.shmget({key} + 100 + reserved, SIZE, 0o1600) >= 0:
    reserved += 1  # never attached: no pages, but the size counts against the namespace's total
print('reserved', reserved, flush=True)
"""


def test_shared_memory_past_the_memory_limit_is_not_held(isolated):
    """A program that fills 16 MiB System V segments one after the other, detaching each and
    keeping it, holds no more than memory_bytes of them at once (a detached segment goes at
    once; with a cgroup, past its memory.max the program is killed), and cannot reserve more
    than memory_bytes of segments in all."""
    need(isolated)
    key, memory_bytes, segment_bytes = fresh_key(), 96 * 2**20, 16 * 2**20
    try:
        result = run_python(SHM_BOMB.format(key=key), memory_bytes=memory_bytes, timeout_s=10)
        said = dict(line.split() for line in result.stdout_tail.splitlines())
        if getattr(result, "cgroup", False) and "memory limit" in result.why:
            return  # the kernel killed it at memory.max (getattr: a sandbox without cgroups)
        assert result.passed, result.why
        assert int(said["alive"]) * segment_bytes <= memory_bytes, said
        assert int(said["reserved"]) * segment_bytes <= memory_bytes, said
        assert int(said["touched"]) == 40  # each went once detached: room for the next
    finally:
        keys = {key + i for i in range(40)} | {key + 100 + i for i in range(40)}
        host_ipc.remove_sysv("shm", {i for i, (k, _) in host_ipc.sysv("shm").items()
                                     if k in keys})


def test_ipc_limits_bound_the_namespace_to_the_memory_limit():
    """The IPC namespace's limits: System V shared memory of memory_bytes in all (in pages,
    rounded up), a segment gone once detached, and a few objects of each kind."""
    page_bytes = os.sysconf("SC_PAGE_SIZE")
    limits = ipc_limits(10 * page_bytes + 1)
    assert limits["kernel/shmmax"] == str(10 * page_bytes + 1)
    assert limits["kernel/shmall"] == "11"
    assert limits["kernel/shm_rmid_forced"] == "1"
    assert int(limits["kernel/shmmni"]) <= 64 and int(limits["kernel/msgmni"]) <= 64
    semmsl, semmns, _, semmni = map(int, limits["kernel/sem"].split())
    assert semmns <= 4096 and semmni <= 64 and semmsl <= semmns
    assert int(limits["fs/mqueue/queues_max"]) <= 64


def test_no_network_not_even_to_a_listening_local_port(isolated):
    """A connection to a port listening on 127.0.0.1 fails inside the sandbox."""
    need(isolated)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        probe = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        with socket.create_connection(("127.0.0.1", port), timeout=1):  # it does listen
            pass
        result = run_python(probe)
    assert not result.passed and "Network is unreachable" in result.why


def test_the_program_cannot_see_the_callers_environment(monkeypatch, isolated):
    """A secret in the caller's environment is in neither the program's environment nor, with
    namespaces, readable from the caller's /proc/<pid>/environ."""
    monkeypatch.setenv("ECHO2_TEST_SECRET", "hunter2")
    probe = ("import json, os\nprint(json.dumps(dict(os.environ)))\n"
             f"try:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
             "except OSError as e:\n    print('denied', type(e).__name__)\n")
    result = run_python(probe)
    assert result.passed
    env = json.loads(result.stdout_tail.splitlines()[0])
    assert "ECHO2_TEST_SECRET" not in env and "hunter2" not in json.dumps(env)
    if isolated:
        assert "hunter2" not in result.stdout_tail and "denied" in result.stdout_tail


def test_files_outside_the_working_directory_are_read_only(tmp_path, isolated):
    """With namespaces, the program can write its working directory and nothing else: the
    interpreter's files are read-only, and the caller's other files are not there at all."""
    need(isolated)
    target = tmp_path / "outside.txt"
    result = run_python(f"open('inside.txt', 'w').write('x')\nopen({str(target)!r}, 'w')\n")
    assert not result.passed and "No such file or directory" in result.why
    assert not target.exists()
    inside_python = os.path.join(os.path.realpath(sys.base_prefix), "echo2-test.txt")
    result = run_python(f"open({inside_python!r}, 'w')\n")
    assert not result.passed and "Read-only file system" in result.why
    assert not os.path.exists(inside_python)


def test_the_shipped_code_dataset_is_its_generators_output(tmp_path):
    """examples/code.jsonl is what examples/make_code_dataset.py writes, under 1 MB, and its
    rows score 1 for the answer and 0 for the base model's habit of trailing junk."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_code_dataset",
                                                  ROOT / "examples" / "make_code_dataset.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    generator.main(["--out", str(tmp_path / "code.jsonl")])
    shipped = ROOT / "examples" / "code.jsonl"
    assert (tmp_path / "code.jsonl").read_bytes() == shipped.read_bytes()
    assert shipped.stat().st_size < 2**20
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows) >= 1000
    row = rows[1]
    assert code_tests(row["prompt"], row["answer"], row) == 1.0
    assert code_tests(row["prompt"], row["answer"] + "?", row) == 0.0
    assert 0 < code_tests(row["prompt"], str(int(row["answer"]) + 100), row) < 1


def test_bad_limits_are_refused():
    """A non-positive limit is a ValueError, from the sandbox and from a row."""
    with pytest.raises(ValueError):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError):
        code_tests("", "pass", {"tests": "pass", "timeout_s": -1})
    with pytest.raises(ValueError):
        code_tests("", "pass", {"tests": []})


def test_a_machine_whose_sandbox_cannot_run_a_program_is_refused_up_front(monkeypatch):
    """sandbox_refusal says why when a trivial program cannot run (an interpreter nobody can
    reach, as under a root whose Python lives in a 0700 home without namespaces), else None."""
    assert sandbox_refusal() is None
    monkeypatch.setattr(sandbox, "INTERPRETER", "/nonexistent/python3")
    why = sandbox_refusal()
    assert why is not None and "/nonexistent/python3" in why


def test_a_machine_whose_sandbox_cannot_isolate_is_refused_unless_accepted(monkeypatch):
    """A sandbox that runs the trivial program without namespaces of its own (a user without
    user namespaces; this machine has them, so its real result is relabelled) is refused with
    the ways out, unless --unisolated-code accepts it."""
    real = sandbox.run_python
    monkeypatch.setattr(sandbox, "run_python",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), isolated=False))
    why = sandbox_refusal()
    assert why is not None and "--unisolated-code" in why and "namespaces" in why
    assert sandbox_refusal(unisolated=True) is None


def test_a_root_callers_program_runs_as_nobody_and_finds_none_of_its_files(tmp_path, isolated):
    """As root: the program is uid 65534, a 0600 file of the caller is not in its root at all,
    and the caller's process is not in its /proc (no command line, root or environment)."""
    need(isolated)
    if os.geteuid() != 0:
        pytest.skip("the uid change is a root caller's")
    secret = tmp_path / "hub_key"
    secret.write_bytes(b"k" * 32)
    secret.chmod(0o600)
    probe = ("import os\nprint(os.getuid(), os.getgid())\n"
             f"for path in ({str(secret)!r}, '/proc/{os.getpid()}/root', "
             f"'/proc/{os.getpid()}/environ', '/proc/{os.getpid()}/cmdline'):\n"
             "    try:\n        print(len(os.listdir(path) if path.endswith('root') else "
             "open(path, 'rb').read()))\n"
             "    except OSError as e:\n        print(type(e).__name__)\n"
             "print(sorted(os.listdir('/')))\n")
    result = run_python(probe)
    assert result.passed and result.uid == 65534, result.why
    lines = result.stdout_tail.splitlines()
    assert lines[:5] == ["65534 65534"] + ["FileNotFoundError"] * 4
    assert "etc" not in lines[5] and "home" not in lines[5]  # only what the interpreter needs


def test_a_caller_that_is_not_root_keeps_its_uid_in_the_sandbox(tmp_path):
    """The fallback: run by an unprivileged user, the program keeps that uid (reported), and
    with user namespaces still finds no file of the caller's outside its root."""
    secret = tmp_path / "hub_key"
    secret.write_bytes(b"k" * 32)
    script = ("import sys; sys.path.insert(0, sys.argv[1])\n"
              "from echo2p2p.scoring.sandbox import INTERPRETER, run_python\n"
              f"r = run_python('print(open({str(secret)!r}).read())')\n"
              "print(r.uid, r.isolated, r.passed)\n")
    try:
        done = subprocess.run([INTERPRETER, "-I", "-c", script, str(ROOT)], user=65533,
                              group=65533, capture_output=True, text=True, timeout=60,
                              cwd="/", env={"TMPDIR": str(tmp_path)})
    except PermissionError:
        pytest.skip(f"an unprivileged user cannot run {INTERPRETER} here (not root, or the "
                    f"interpreter lies under a directory only root may enter)")
    if done.returncode != 0:
        pytest.skip(f"an unprivileged user cannot run the sandbox here: {done.stderr[-200:]}")
    uid, isolated, passed = done.stdout.split()
    assert uid == "65533"
    if isolated == "True":
        assert passed == "False"  # the caller's tmp_path is not in the program's root


def test_no_verdict_comes_from_the_program():
    """A program that prints the old pass line scores 0; one that prints its harness's decoy
    is a forgery; an object whose __eq__ always says True passes no test; the program's names
    cannot shadow the tests' builtins."""
    row = {"program": "def answer():\n    return {completion}\n",
           "tests": ["assert answer() % 10 == 0", "assert answer() == 110"]}
    fake_line = "print('\\n' + 'ab' * 16, 0, 1) or 110 + 1"
    assert code_tests("", fake_line, row) == 0.0
    decoy = "print(open('main.py').read().split(\"'\")[1]) or 0"
    with pytest.raises(ForgedPass):
        code_tests("", decoy, row)
    cheat = "type('E', (), {'__eq__': lambda s, o: True, '__mod__': lambda s, o: s})()"
    assert code_tests("", cheat, row) == 0.0
    assert code_tests("", "110", row) == 1.0
    slow = {**row, "timeout_s": 0.5}  # out of time while the tests ask it: 0, no forgery
    assert code_tests("", "[0 for _ in iter(int, 1)]", slow) == 0.0
    shadow = "def answer():\n    return 1\n__builtins__ = None\ndef sorted(x):\n    return 2\n"
    assert code_tests("", shadow, {"tests": ["assert answer() == 1",
                                             "assert sorted([2]) == [2]"]}) == 1.0
