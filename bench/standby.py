"""Warm or cold standby: what a standby peer costs in bytes, and what it costs to wake it.

A real hub (`echo2p2p.hub.run.start.start_hub`, the built-in tiny model, websockets on 127.0.0.1) with a
learner held at T_train per step (the real step, then a sleep) and two real in-process peers: a
free one, fast enough alone, and a paid one, which cost-aware activation puts on standby. Every
upload (the hub's and the peers') goes through the token bucket at --rate-mbps, so a full version
takes a visible time to travel. Per standby mode:

1. once the paid peer is on standby, count the chunk bytes it downloads over --standby-steps
   learner steps (warm: every version, mostly as deltas; cold: nothing);
2. stop the free peer: the hub re-plans and activates the paid one. Time from its activation
   until it holds the newest version (and the chunk bytes it downloads meanwhile: a delta from
   what it holds, or the version in full), and until its first rollout is admitted (the learner
   starves meanwhile: nobody else generates). The second includes waiting for lease budget,
   which frees up when the learner finishes its current step.

    python bench/standby.py [--rate-mbps 5] [--train-step-s 1.0] [--standby-steps 6]

Prints a table, then one JSON line: {"bench": "standby", "full_version_bytes": ...,
"warm": {"standby_bytes_per_version": ..., "wake_to_current_version_s": ...,
"wake_to_first_rollout_s": ..., "wake_bytes": ...}, "cold": {...}}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.learning.learner import hold_step_time
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig


async def until(condition, timeout_s: float = 120.0) -> float:
    """Poll `condition` every 5 ms; the time it first held (perf_counter)."""
    deadline = time.perf_counter() + timeout_s
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError("condition not reached in time")
        await asyncio.sleep(0.005)
    return time.perf_counter()


@contextlib.asynccontextmanager
async def peer(url: str, name: str, price: float, rate_mbps: float):
    client = PeerClient(PeerConfig(hub_url=url, name=name, price_per_hour=price,
                                   upload_limit_mbps=rate_mbps, torch_threads=1))
    task = asyncio.create_task(client.run(asyncio.Event()))
    try:
        yield client
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def measure(mode: str, args: argparse.Namespace, run_dir: str) -> dict:
    cfg = HubConfig.from_flat(port=0, prompts_per_step=4, group_size=4, max_lag=2, eval_every=0,
                    run_dir=run_dir, torch_threads=1, seed=0, standby=mode,
                    upload_limit_mbps=args.rate_mbps)
    async with start_hub(cfg, stream=None) as run:
        hold_step_time(run.learner, args.train_step_s)
        hub = run.hub
        async with peer(run.url, "paid", 1.0, args.rate_mbps) as paid:
            async with peer(run.url, "free", 0.0, args.rate_mbps):
                await until(lambda: len(hub.peer_views()) == 2)
                paid_id = next(p for p, c in hub.peer_views().items() if c.name == "paid")
                await until(lambda: (view := hub.peer_views()[paid_id]).state != "active"
                            and not view.open_leases)
                step, got = hub.core.step, paid.statistics().downloaded_bytes
                await until(lambda: hub.core.step >= step + args.standby_steps)
                standby_bytes = paid.statistics().downloaded_bytes - got
                versions = hub.core.step - step  # kappa = 1 at S = 2: one version per step
            admitted = hub.peer_views()[paid_id].account["admitted"]
            woke = await until(lambda: hub.peer_views()[paid_id].state == "active")
            newest, got = hub.statistics().newest_version, paid.statistics().downloaded_bytes
            current = await until(lambda: (paid.version or 0) >= newest)
            wake_bytes = paid.statistics().downloaded_bytes - got
            first = await until(lambda: hub.peer_views()[paid_id].account["admitted"] > admitted)
            full_bytes = hub.core.tracker.snapshot().wire_bytes
    return {"standby_bytes_per_version": round(standby_bytes / versions),
            "wake_to_current_version_s": round(max(current - woke, 0.0), 3),
            "wake_to_first_rollout_s": round(first - woke, 3), "wake_bytes": wake_bytes,
            "full_version_bytes": full_bytes}


async def main(args: argparse.Namespace) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("warm", "cold"):
            results[mode] = await asyncio.wait_for(measure(mode, args, f"{tmp}/{mode}"), 300)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbps", type=float, default=5.0)
    parser.add_argument("--train-step-s", type=float, default=1.0)
    parser.add_argument("--standby-steps", type=int, default=6)
    args = parser.parse_args()
    results = asyncio.run(main(args))
    full = results["warm"].pop("full_version_bytes")
    results["cold"].pop("full_version_bytes")
    print(f"{'standby':8s} {'bytes/version on standby':>25s} {'wake to newest':>15s} "
          f"{'wake to 1st rollout':>20s} {'bytes to catch up':>18s}")
    for mode, r in results.items():
        print(f"{mode:8s} {r['standby_bytes_per_version']:25d} {r['wake_to_current_version_s']:14.3f}s "
              f"{r['wake_to_first_rollout_s']:19.3f}s {r['wake_bytes']:18d}")
    print(f"a full version is {full} bytes: {8 * full / args.rate_mbps / 1e6:.2f} s at "
          f"{args.rate_mbps:g} Mbit/s; learner step {args.train_step_s:g} s")
    print(json.dumps({"bench": "standby", "rate_mbps": args.rate_mbps,
                      "train_step_s": args.train_step_s, "full_version_bytes": full, **results}))
