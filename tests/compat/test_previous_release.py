"""Issue 43's "done when", with a peer of the previous release: commit 4f049ef (main before
the issue's first wire change, protocol 2), built from this repository's own git history into a
venv of its own, its `echo2-peer join` run as a process against this release's hub. It trains
there (served in protocol 2), and a gossip link between it and a peer of this release carries a
version whichever end dials (the link agreed 2: the old end sends no header). Skipped with the
reason where the repository has no history for that commit (a source tarball)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from echo2p2p.hub.learning.run_setup import start_hub
from echo2p2p.negotiation import Agreed

from tests.blob_versions import blob_version
from tests.conftest import tracker, wait_until
from tests.hostile.harness import small_cfg
from tests.peer.test_overlay import CHUNK, Peers, holds, propagation

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = "4f049ef"  # main before issue 43's first wire change: protocol 2
DEADLINE_S = 600.0  # bounds a failing test only


@pytest.fixture(scope="module")
def old_peer(tmp_path_factory) -> Path:
    """`echo2-peer` of the previous release, in a venv of its own over this machine's packages
    (`pip install --no-deps --no-build-isolation -e`: offline); checked to import itself."""
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{PREVIOUS}^{{commit}}"],
                           capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"no git history for {PREVIOUS} here: the previous release cannot be built")
    base = tmp_path_factory.mktemp("previous")
    src, venv = base / "src", base / "venv"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps",
                    "--no-build-isolation", "-e", str(src)], check=True)
    said = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import echo2p2p.frames as f, echo2p2p.peer.cli as c; "
                           "print(f.PROTOCOL_VERSION, c.__file__)"],
                          check=True, capture_output=True, text=True).stdout.split()
    assert said[0] == "2" and said[1].startswith(str(src)), said  # that release, not this one
    return venv / "bin" / "echo2-peer"


@contextlib.asynccontextmanager
async def running(peer: Path, url: str, *flags: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`peer join url flags` as a process, stopped (SIGTERM, then killed) on exit; its stderr
    goes to the test's."""
    proc = await asyncio.create_subprocess_exec(str(peer), "join", url, "--torch-threads", "1",
                                                *flags, stdout=asyncio.subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_a_peer_of_the_previous_release_trains_on_this_hub(old_peer, tmp_path):
    """The 4f049ef peer (with its chunk server) against this hub: served in protocol 2, it is
    the run's only peer and the learner takes 3 steps on its rollouts."""
    cfg = small_cfg(tmp_path, max_steps=3)
    async with start_hub(cfg, stream=None) as run, \
            running(old_peer, run.url, "--listen", "127.0.0.1:0", "--name", "old") as proc:
        await wait_until(lambda: run.hub._peers or proc.returncode is not None, DEADLINE_S)
        assert proc.returncode is None, "the old peer exited"
        assert [c.protocol.agreed for c in run.hub._peers.values()] == [Agreed(2)]
        await asyncio.wait_for(run.finished.wait(), DEADLINE_S)
        assert proc.returncode is None
    steps = [r for r in run.records if "step" in r]
    assert len(steps) == 3
    assert run.hub.statistics().closed_for_protocol == 0


@pytest.mark.parametrize("first", ["old", "new"])
async def test_a_gossip_link_between_releases_carries_a_version(old_peer, first):
    """A gossip hub, one peer of each release: whichever joined first has the lower id, and
    its dial is the link kept (one per pair), so both directions are run. The link agreed 2,
    and both peers complete v1 with bytes from each other."""
    data = os.urandom(1 << 20)
    async with tracker(relay="gossip") as (hub, key, url, records), \
            contextlib.AsyncExitStack() as stack:
        hub.publish(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK))
        new = None
        for n, which in enumerate(["old", "new"] if first == "old" else ["new", "old"], 1):
            if which == "old":
                await stack.enter_async_context(running(
                    old_peer, url, "--engine", "relay", "--listen", "127.0.0.1:0",
                    "--relay-stall-s", "3"))
            else:
                [new] = await stack.enter_async_context(Peers(url, 1))
            await wait_until(lambda: len(hub.peer_views()) == n, DEADLINE_S)
        await wait_until(lambda: all(p.stream_version == 0 and p.relay != "unprobed"
                                     for p in hub.peer_views().values()), DEADLINE_S)
        old_id = next(pid for pid in hub.peer_views() if pid != new.welcome.peer_id)
        hub.publish(blob_version(key, 1, data, chunk_bytes=CHUNK))
        await asyncio.wait_for(records.wait_for("propagation", version=1), DEADLINE_S)
        links = new.fetcher.links.links
        await wait_until(lambda: old_id in links and links[old_id].dialled == (first == "new"))
        assert links[old_id].protocol == 2
        assert holds(new, 1) and bytes(new.fetcher.store.stream(1)) == data
        assert hub.peer_views()[old_id].stream_version == 1
    record = propagation(records, 1)
    assert record["complete"] and record["peers"] == 2
    assert record["bytes_from_peers"] > 0
