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

from echo2p2p.hub.run.start import start_hub
from echo2p2p.negotiation import Agreed

from tests.blob_versions import blob_version
from tests.conftest import tracker, until, wait_first
from tests.hostile.harness import small_cfg
from tests.peer.test_overlay import CHUNK, Peers, holds, propagation
from echo2p2p.hub.core.events import VersionPublished

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
PREVIOUS = "4f049ef"  # main before issue 43's first wire change: protocol 2
DEADLINE_S = 600.0  # bounds a failing test only


@pytest.fixture(scope="module")
def old_peer(tmp_path_factory) -> Path:
    """`echo2-peer` of the previous release, in a venv of its own over this machine's packages
    (`pip install --no-deps -e`, as this checkout's own venv is made); checked to import
    itself, not this release."""
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
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "-e", str(src)],
                   check=True)
    said = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import echo2p2p.frames as f, echo2p2p.peer.cli as c; "
                           "print(f.PROTOCOL_VERSION, c.__file__)"],
                          check=True, capture_output=True, text=True, cwd=base).stdout.split()
    assert said[0] == "2" and said[1].startswith(str(src)), said  # that release, not this one
    return venv / "bin" / "echo2-peer"


@contextlib.asynccontextmanager
async def running(peer: Path, url: str, *flags: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`peer join url flags` as a process, stopped (SIGTERM, then killed) on exit; its stderr
    goes to the test's. Run outside this checkout: a Python started in it imports this
    release's `echo2p2p` first."""
    proc = await asyncio.create_subprocess_exec(str(peer), "join", url, "--torch-threads", "1",
                                                *flags, stdout=asyncio.subprocess.DEVNULL,
                                                cwd=peer.parents[2])  # not this checkout's root
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
        await wait_first(until(run.hub, lambda: bool(run.hub.peer_views()), DEADLINE_S),
                         proc.wait(), timeout_s=DEADLINE_S)
        assert proc.returncode is None, "the old peer exited"
        assert [c.protocol.agreed for c in run.hub._peers.values()] == [Agreed(2)]
        await asyncio.wait_for(run.finished.wait(), DEADLINE_S)
        assert proc.returncode is None
    steps = [r for r in run.records if "step" in r]
    assert len(steps) == 3
    assert run.hub.statistics().closed_for_protocol == 0


@pytest.mark.parametrize("dialler", ["old", "new"])
async def test_a_gossip_link_between_releases_carries_a_version(old_peer, dialler):
    """A gossip hub, one peer of each release; the `dialler` has no chunk server (NAT'd: it can
    only dial, so the link is its dial), so both directions are run. The link agreed 2 (the old
    end sends and answers no header), and the NAT'd end gets v1, bit for bit, over it."""
    data = os.urandom(1 << 20)
    old_listen = "" if dialler == "old" else "127.0.0.1:0"
    new_listen = "" if dialler == "new" else "127.0.0.1:0"
    async with tracker(relay="gossip") as (hub, key, url, records), \
            Peers(url, 1, listen=new_listen) as [new], \
            running(old_peer, url, "--engine", "relay", "--listen", old_listen,
                    "--relay-stall-s", "3"):
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await until(hub, lambda: len(hub.peer_views()) == 2 and all(
            p.stream_version == 0 and (p.server_url is None or p.relay != "unprobed")
            for p in hub.peer_views().values()), DEADLINE_S)
        old_id = next(pid for pid in hub.peer_views() if pid != new.welcome.peer_id)
        hub.feed(VersionPublished(blob_version(key, 1, data, chunk_bytes=CHUNK)))
        await asyncio.wait_for(records.wait_for("propagation", version=1), DEADLINE_S)
        link = new.fetcher.links.links.get(old_id)
        assert link is not None and link.protocol == 2
        assert link.dialled == (dialler == "new")
        assert holds(new, 1) and bytes(new.fetcher.store.stream(1)) == data
        assert hub.peer_views()[old_id].stream_version == 1
    record = propagation(records, 1)
    assert record["complete"] and record["peers"] == 2
    assert record["chunks_dealt"][new.welcome.peer_id if dialler == "new" else old_id] == 0
    assert record["bytes_from_peers"] > 0  # the NAT'd end took chunks over the link
