"""`echo2-hub demo` stops its local peers (issue 30: "stopping the demo with SIGTERM left its
peers running"): SIGTERM and SIGINT end the run cleanly and the peers with it; a demo killed
outright still takes them down (the kernel's parent-death signal)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys

import aiohttp
import psutil
import pytest

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]


async def step_of(http: aiohttp.ClientSession, base: str) -> int:
    async with http.get(f"{base}/status") as response:
        return json.loads(await response.text())["step"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=lambda sig: sig.name)
async def test_the_demo_stopped_leaves_no_peer_running(tmp_path, sig):
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "echo2p2p.hub.cli", "demo", "--peers", "2", "--port", "0",
        "--dashboard-port", "0", "--max-steps", "0", "--eval-every", "0",
        "--run-dir", str(tmp_path / "run"), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        async with asyncio.timeout(300):
            while not (found := re.search(rb"hub listening on ws://([\d.:]+)/ws",
                                          line := await demo.stdout.readline())):
                assert line, "the demo ended before it listened"
        drain = asyncio.create_task(demo.stdout.read())  # keep its pipe from filling
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(400):  # a learner step: the peers are up and delivering
                while await step_of(http, f"http://{found[1].decode()}") < 1:
                    await asyncio.sleep(0.2)  # polling the hub's own /status, not a sync
        peers = [p for p in psutil.Process(demo.pid).children(recursive=True)
                 if "echo2p2p.peer.cli" in " ".join(p.cmdline())]
        assert len(peers) == 2
        demo.send_signal(sig)
        async with asyncio.timeout(120):
            code = await demo.wait()
        output = (await drain).decode(errors="replace")
        gone, alive = psutil.wait_procs(peers, timeout=30)
        assert not alive, f"peers left running: {alive}\n{output[-2000:]}"
        if sig is not signal.SIGKILL:
            assert code == 0 and f"stopped by {sig.name}" in output, output[-2000:]
    finally:
        if demo.returncode is None:
            demo.kill()
            await demo.wait()
