"""`echo2-hub demo` stops its local peers (issue 30: "stopping the demo with SIGTERM left its
peers running"): SIGTERM and SIGINT end the run cleanly and the peers with it, and the learner
with them (issue 31: it trained two steps after its peers had left): no step after the stop,
a checkpoint of it, the command that resumes it, exit code 128 + the signal; a demo killed
outright still takes the peers down (the kernel's parent-death signal)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import aiohttp
import msgpack
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
        "--dashboard-port", "0", "--max-steps", "0", "--eval-every", "0", "--max-lag", "1",
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
        sent = time.monotonic()
        demo.send_signal(sig)
        async with asyncio.timeout(120):
            code = await demo.wait()
        print(f"{sig.name} to exit: {time.monotonic() - sent:.2f} s")
        output = (await drain).decode(errors="replace")
        gone, alive = psutil.wait_procs(peers, timeout=30)
        assert not alive, f"peers left running: {alive}\n{output[-2000:]}"
        # a kill without a word leaves the RUNNING marker the next start reads (hub.run.marker)
        assert (tmp_path / "run" / "RUNNING").exists() == (sig is signal.SIGKILL), output[-2000:]
        if sig is not signal.SIGKILL:
            run_dir = tmp_path / "run"
            stop = re.search(rf"stopped by {sig.name} at v(\d+) \(\d+ steps trained\): "
                             rf"checkpoint saved, its settings in {run_dir}/config.json "
                             rf"\(--resume reads them: the model, task and every other field "
                             rf"need no flag\); resume with: "
                             rf"(echo2-hub demo --resume {run_dir} --peers 2)\n", output)
            assert code == 128 + sig and stop, output[-2000:]
            # the command printed resumes the same run: its fields from the saved config
            shown = subprocess.run([sys.executable, "-m", "echo2p2p.hub.cli",
                                    *stop[2].split()[1:], "--print-config"],
                                   capture_output=True, text=True, check=True).stdout
            saved = re.escape(f"file {run_dir / 'config.json'}")
            assert re.search(rf"\n  max_lag +1 +{saved}\n", shown), shown
            assert re.search(rf"\n  model +'tiny' +{saved}\n", shown), shown
            assert "Traceback" not in output, output[-2000:]
            logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            trained = [r["step"] for r in logged if "event" not in r]
            assert max(trained) + 1 == int(stop[1]), output[-2000:]  # none after the stop
            latest = int((run_dir / "checkpoints" / "LATEST").read_text())
            state = msgpack.unpackb((run_dir / "checkpoints" / f"ckpt-{latest:06d}" /
                                     "hub.msgpack").read_bytes(), raw=False, strict_map_key=False)
            assert state["step"] == int(stop[1])
    finally:
        if demo.returncode is None:
            demo.kill()
            await demo.wait()
