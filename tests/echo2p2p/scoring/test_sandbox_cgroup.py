"""The sandbox's cgroup: where a run's cgroup goes (or why none), its limits, and, on a writable
cgroup v2 hierarchy, that it kills what is left in it and goes. Where this machine gives runs a
cgroup, a program past its memory.max is killed and says so."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from echo2p2p.scoring import sandbox_cgroup
from echo2p2p.scoring.sandbox import run_python
from echo2p2p.scoring.sandbox_cgroup import PREFIX, RunCgroup, limits, plan, remove_orphans

BOTH = "cpuset cpu io memory hugetlb pids rdma misc"


def test_plan_takes_the_own_cgroup_then_its_parent_else_says_why():
    """A root caller's runs go under its own cgroup when it hands memory and pids down, else
    beside it under its parent's; anything else (not root, not cgroup v2, a controller
    missing, the root cgroup without them) is None with a reason."""
    assert plan("cgroup2", 0, "/", BOTH, parent_subtree="") == ("/", "")
    assert plan("cgroup2", 0, "/system.slice/hub.service", "",
                parent_subtree=BOTH) == ("/system.slice", "")
    assert plan("cgroup2", 0, "/a/b", "memory pids", parent_subtree="") == ("/a/b", "")
    assert plan("cgroup2", 0, "/hub", "", parent_subtree="memory pids") == ("/", "")
    cases = {("cgroup2", 1000, "/", BOTH, ""): "not root",
             ("tmpfs", 0, "/", BOTH, ""): "is tmpfs, not cgroup v2",
             ("", 0, "/", BOTH, ""): "not mounted",
             ("cgroup2", 0, "/", "cpu io", ""): "memory and pids",
             ("cgroup2", 0, "/hub", "memory", "cpu memory"): "memory and pids",
             ("cgroup2", 0, "/hub", "", ""): "memory and pids"}
    for args, why in cases.items():
        base, said = plan(*args[:4], parent_subtree=args[4])
        assert base is None and why in said, (args, said)


def test_a_runs_limits_bound_its_memory_and_processes():
    """memory.max is the run's memory in all (past it, all of it is killed), pids.max its
    processes and the sandbox's child, and no swap."""
    assert limits(96 * 2**20, 16) == {"memory.max": str(96 * 2**20), "memory.oom.group": "1",
                                      "memory.swap.max": "0", "pids.max": "17"}


def writable_cgroup2() -> str:
    """A directory of a cgroup v2 hierarchy this process may make cgroups in and move
    processes into (any controllers), else skip."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        mounts = [line.split(" - ")[0].split()[4] for line in f
                  if line.split(" - ")[1].split()[0] == "cgroup2"]
    for mount in mounts:
        try:
            made = RunCgroup.make(mount, {})
        except OSError:
            continue
        made.remove()
        return mount
    pytest.skip("no cgroup v2 hierarchy this process may write here")


def test_a_run_cgroup_kills_what_is_left_in_it_and_goes():
    """Removing a run's cgroup kills its processes, one that left its session too, and
    removes the directory; killing each listed process (kernels before cgroup.kill) works."""
    base = writable_cgroup2()
    for how in ("remove", "kill_listed"):
        made = RunCgroup.make(base, {})
        procs = [subprocess.Popen(["sleep", "60"], start_new_session=new) for new in (False, True)]
        try:
            for proc in procs:
                with open(os.path.join(made.path, "cgroup.procs"), "w") as f:
                    f.write(str(proc.pid))
            assert not made.wait_empty(0.0)
            if how == "kill_listed":
                made.kill_listed()
                assert made.wait_empty(5.0)
            made.remove()
            assert [proc.wait(timeout=5) for proc in procs] == [-9, -9]
            assert not os.path.exists(made.path)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


def test_a_cgroup_that_cannot_take_its_limits_is_not_left_behind():
    """A limit file that is not there is an error, and the half-made cgroup is removed."""
    base = writable_cgroup2()
    before = set(os.listdir(base))
    with pytest.raises(FileNotFoundError):
        RunCgroup.make(base, {"no.such.limit": "1"})
    assert set(os.listdir(base)) == before


def test_the_cgroups_of_ended_processes_are_removed():
    """A run's cgroup left by a process that died (a scoring worker killed mid-run) is removed
    by the next process's first run; one of a live process stays."""
    base = writable_cgroup2()
    ended = subprocess.Popen(["true"])
    ended.wait()
    orphan = os.path.join(base, f"{PREFIX}{ended.pid}-0")
    live = os.path.join(base, f"{PREFIX}{os.getpid()}-0")
    os.mkdir(orphan)
    os.mkdir(live)
    try:
        remove_orphans(base)
        assert not os.path.exists(orphan) and os.path.exists(live)
    finally:
        for path in (orphan, live):
            if os.path.exists(path):
                os.rmdir(path)


def test_for_run_gives_a_cgroup_with_its_limits_or_says_once_why_not(monkeypatch, caplog):
    """On this machine: a run's cgroup holds memory.max and goes afterwards, or there is none
    and the reason is logged once, at INFO."""
    monkeypatch.setattr(sandbox_cgroup, "_base", [])
    caplog.set_level(logging.INFO, logger=sandbox_cgroup.__name__)
    for _ in range(2):
        with sandbox_cgroup.for_run(96 * 2**20, 8) as made:
            if made is not None:
                with open(os.path.join(made.path, "memory.max"), encoding="ascii") as f:
                    assert f.read().strip() == str(96 * 2**20)
        assert made is None or not os.path.exists(made.path)
    said = [r.getMessage() for r in caplog.records if "cgroup" in r.getMessage()]
    assert len(said) == 1, said
    assert ("get no cgroup of their own (" in said[0]) == (made is None)


MEMORY_HOG = """\
import os
for _ in range(2):
    if os.fork() == 0:
        break
block = bytearray(40 * 2**20)  # 3 processes x 40 MiB, each under its own RLIMIT_AS
for i in range(0, len(block), 4096):
    block[i] = 1
import time; time.sleep(0.5)
"""


def test_a_program_past_its_cgroups_memory_is_killed_and_told():
    """With a cgroup (where this machine gives one), three processes of 40 MiB each, each under
    RLIMIT_AS, are past a 64 MiB memory.max together: the kernel kills the run, and the result
    says it was the memory limit."""
    if not run_python("pass").cgroup:
        pytest.skip("this machine gives the sandbox no cgroup (root, cgroup v2 with memory "
                    "and pids handed down, needed)")
    result = run_python(MEMORY_HOG, memory_bytes=64 * 2**20, timeout_s=10)
    assert not result.passed and "killed by SIGKILL (the memory limit)" in result.why
