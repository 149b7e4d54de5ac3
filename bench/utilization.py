"""Learner utilization: the pool the provisioning rule picks, against the synchronous baseline.

A real hub (`echo2p2p.hub.run.start.start_hub`, real websockets on 127.0.0.1, the built-in tiny model)
trains with real in-process peers (`echo2p2p.peer.client.PeerClient`). Three things are held to chosen
values, so that a small CPU (2 cores here) is never the bottleneck:
- the learner's step takes T_train: the real GRPO step, then a sleep for the rest of T_train;
- peer i makes at most mu_i rollouts/s: the real transformers engine generates a group of G,
  then sleeps until G / mu_i has passed;
- a broadcast takes about T_bcast: the hub's and every peer's upload go through the in-process
  token bucket (`upload_limit_mbps`) at the rate that sends one version in T_bcast (versions
  always go in full, `anchor_every=1`, so every one has the same size).
The pool is what the hub's provisioning rule picks from a list of priced candidates:
`echo2p2p.activation.choose_active(candidates, R / T_train, margin)` (overlapped reading, how the
hub runs with S >= 1). The hub is told to activate every peer it gets (`activation="all"`), so
exactly that pool works. The same pool then runs the synchronous baseline, S = 0: the learner
waits every step for the broadcast and then for a whole batch of generation. Relay is pipelined
in both runs.

    python bench/utilization.py [--quick] [--steps 40] [--train-step-s 1.5] [--bcast-frac 0.6]
                                [--candidates NAME:USD_PER_H:MU,...] [--margin 0.1]

Measured busy fraction: learner seconds (padded step times) over wall time, in a steady window
from the end of step `--warmup` - 1 to the end of the last step (joining, loading and filling
the pipeline are left out). T_bcast: the median `done_s` of the hub's complete propagation
records of the versions published in that window. Predictions from the capacity model with the
measured T_bcast and the pool's sum(mu_i): echo2 by `predicted_busy_fraction` (overlapped
reading; 1.0 whenever sum(mu) >= R / T_train, so the gap to it is the hub's own overhead per step
and any wait for a batch short of groups dropped as stale); sync by T_train / (T_train + T_bcast
+ R / sum(mu)), one step, then one broadcast, then one batch of generation in turn. Also printed
for sync: the same with the generation of whole groups dealt round-robin (the slowest peer's
share sets the step), and the core's sequential reading at S = 0, which assumes generation
overlaps training (S = 0 forbids it), so it is no model of sync.

Prints a table, then one JSON line: {"bench": "utilization", "busy_frac": {"echo2", "sync"},
"predicted_busy_frac", "predicted_sync_busy_frac", "pool", "sum_mu", "required", ...}.
Targets: echo2 busy >= 0.95, and within 0.05 of its prediction.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is built in: never download
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no bar per model load

from echo2p2p.activation import PricedWorker, choose_active  # noqa: E402
from echo2p2p.capacity import Reading, Workload, predicted_busy_fraction  # noqa: E402

# name:$/h:rollouts/s. Prices as in bench/activation.py; mu scaled to this tiny workload.
CANDIDATES = "vol-3060:0:3,rtx3090:0.22:5,rtx4090:0.34:6,l4:0.44:4,a10:0.86:6,a100:1.19:12," \
             "h100:2.69:20"


class ThrottledEngine:
    """The real transformers engine, held to `rollouts_per_s`: a group of n completions takes
    n / rollouts_per_s of wall time at least (the rest after real generation is slept, in the
    peer's worker thread, with the engine lock held, as a busy GPU would hold it)."""

    def __init__(self, model: str, rollouts_per_s: float):
        from echo2p2p.policy.engines import TransformersEngine

        self.inner = TransformersEngine(model)
        self.rollouts_per_s = rollouts_per_s

    def load_weights(self, named_tensors) -> None:
        self.inner.load_weights(named_tensors)

    def generate(self, prompt_ids, n, **kw):
        start = time.perf_counter()
        out = self.inner.generate(prompt_ids, n, **kw)
        time.sleep(max(0.0, n / self.rollouts_per_s - (time.perf_counter() - start)))
        return out


def version_wire_bytes(model: str) -> int:
    """Bytes of one full version on the wire, built as the hub builds it (bf16, zstd)."""
    import torch

    from echo2p2p.snapshot import auto_chunk_bytes, build_snapshot
    from echo2p2p.hub.learning.learner import Learner
    from echo2p2p.policy.model import load_policy
    from echo2p2p.policy.weights import state_to_tensors

    policy, _ = load_policy(model)
    weights = Learner(policy, lr=1e-3).export_weights(torch.bfloat16)
    tensors = state_to_tensors(weights, torch.bfloat16)
    with ThreadPoolExecutor() as coder:  # as the hub does: chunks coded in parallel
        manifest, _ = build_snapshot(0, tensors, chunk_bytes=auto_chunk_bytes(
            sum(len(t[3]) for t in tensors)), map_chunks=coder.map)
    return sum(c.wire_bytes for c in manifest.chunks)


@contextlib.asynccontextmanager
async def running_peers(url: str, pool: list[PricedWorker], model: str,
                        rate_mbps: float) -> AsyncIterator[None]:
    """One real peer per pool member, throttled to its mu, stopped on exit."""
    from echo2p2p.peer.client import PeerClient
    from echo2p2p.peer.config import PeerConfig

    engines = [await asyncio.to_thread(ThrottledEngine, model, w.rollouts_per_s) for w in pool]
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        for w, engine in zip(pool, engines):
            cfg = PeerConfig(hub_url=url, name=w.worker_id, price_per_hour=w.price_per_hour,
                             listen="127.0.0.1:0", upload_limit_mbps=rate_mbps)
            tg.create_task(PeerClient(cfg, engine=engine).run(stop))
        try:
            yield
        finally:
            stop.set()


async def run_phase(args, pool: list[PricedWorker], max_lag: int, rate_mbps: float,
                    run_dir: Path, timeout_s: float) -> dict:
    """Train `args.steps` steps with `pool` at staleness bound `max_lag`; the measurements."""
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.learning.learner import hold_step_time
    from echo2p2p.hub.run.start import start_hub

    # Everything shares one process, so the default executor (min(32, cores + 4) threads) would
    # be too small: each peer parks a thread in generate and another waiting to load weights.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=64))
    cfg = HubConfig.from_flat(port=0, model=args.model, max_lag=max_lag, publish_every=args.publish_every
                    if max_lag else 1, group_size=args.group_size,
                    prompts_per_step=args.prompts_per_step, max_steps=args.steps, eval_every=0,
                    anchor_every=1, upload_limit_mbps=rate_mbps, relay="pipelined",
                    activation="all", torch_threads=1, seed=args.seed, run_dir=str(run_dir))
    real_s: list[float] = []
    start = time.perf_counter()
    async with asyncio.timeout(timeout_s):
        async with start_hub(cfg, stream=None) as run:
            hold_step_time(run.learner, args.train_step_s, real_s)
            async with running_peers(run.url, pool, args.model, rate_mbps):
                await run.finished.wait()
    steps = [r for r in run.records if "step" in r]
    window = steps[args.warmup - 1:]
    wall_s = window[-1]["time_s"] - window[0]["time_s"]
    busy_s = sum(r["train/step_s"] for r in window[1:])
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    # Versions published in the window; one published as the run stops reaches nobody.
    spread = [e for e in events if e.get("event") == "propagation"
              and args.warmup <= e["version"] <= last["step"]]
    done = [e["done_s"] for e in spread if e["complete"]]
    return {
        "busy_frac": busy_s / wall_s,
        "hub_busy_frac": last["hub/learner_busy_frac"],  # the hub's own, over the last 60 s
        "train_step_s": statistics.fmean(r["train/step_s"] for r in window[1:]),
        "real_step_s": statistics.median(real_s),
        "bcast_s": statistics.median(done) if done else None,
        "bcast_incomplete": len(spread) - len(done),
        "window": (window[0]["step"] + 1, last["step"]),
        "wall_s": wall_s,
        "stale": last["rollout/stale_on_arrival_total"] + last["rollout/stale_in_queue_total"],
        "lag_mean": statistics.fmean(r["rollout/staleness_mean"] for r in window[1:]),
        "kappa": cfg.staleness.kappa,
        "total_s": time.perf_counter() - start,
    }


def dealt_generation_s(pool: list[PricedWorker], groups: int, group_size: int) -> float:
    """Seconds until the slowest peer has made its share of `groups` groups, dealt round-robin
    (the hub's dispatch when every peer holds credits for its share; extra groups to the first
    peers): a synchronous step's generation, which the fluid R / sum(mu) underestimates."""
    shares = [groups // len(pool) + (i < groups % len(pool)) for i in range(len(pool))]
    return max(n * group_size / w.rollouts_per_s for n, w in zip(shares, pool))


def parse_candidates(spec: str) -> list[PricedWorker]:
    out = []
    for item in spec.split(","):
        name, price, mu = item.split(":")
        out.append(PricedWorker(name, float(price), float(mu)))
    return out


def _parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 steps a run instead of 40")
    p.add_argument("--steps", type=int, default=40, help="learner steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the window")
    p.add_argument("--train-step-s", type=float, default=1.5, help="T_train, held fixed")
    p.add_argument("--bcast-frac", type=float, default=0.6,
                   help="target T_bcast / T_train; sets the upload caps")
    p.add_argument("--rate-mbit", type=float, default=0.0,
                   help="every upload cap, Mbit/s (0 = from --bcast-frac)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-lag", type=int, default=2, help="S of the echo2 run")
    p.add_argument("--publish-every", type=int, default=0, help="kappa of the echo2 run (0: auto)")
    p.add_argument("--candidates", default=CANDIDATES, help="NAME:USD_PER_H:ROLLOUTS_PER_S,...")
    p.add_argument("--margin", type=float, default=0.1, help="activation margin")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 16, 4
    if not 1 <= args.warmup < args.steps - 2:
        p.error("need 1 <= --warmup < --steps - 2")
    return p, args


def run_both(args: argparse.Namespace, pool: list[PricedWorker], rate_mbps: float,
             timeout_s: float) -> dict[str, dict]:
    """The echo2 run (S = --max-lag) and the synchronous one (S = 0), each under `timeout_s`;
    their measurements by name."""
    watchdog = threading.Timer(2 * timeout_s + 60, lambda: os._exit(3))  # if shutdown hangs too
    watchdog.daemon = True
    watchdog.start()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, max_lag in (("echo2", args.max_lag), ("sync", 0)):
            r = asyncio.run(run_phase(args, pool, max_lag, rate_mbps, Path(tmp) / name, timeout_s))
            results[name] = r
            print(f"{name:5s} S={max_lag} kappa={r['kappa']}: steps {r['window'][0]}.."
                  f"{r['window'][1]} in {r['wall_s']:.1f} s, busy {r['busy_frac']:.3f} (hub, last "
                  f"60 s: {r['hub_busy_frac']:.3f}), T_train {r['train_step_s']:.3f} s (real step "
                  f"{r['real_step_s'] * 1000:.0f} ms), T_bcast {_fmt(r['bcast_s'])} s "
                  f"({r['bcast_incomplete']} incomplete), lag {r['lag_mean']:.2f}, "
                  f"{r['stale']} stale groups, run {r['total_s']:.0f} s", flush=True)
    watchdog.cancel()
    return results


def predictions(args: argparse.Namespace, results: dict[str, dict], pool: list[PricedWorker],
                sum_mu: float) -> dict[str, float]:
    """What the capacity model predicts of each run's busy fraction, printed beside the
    measured ones."""
    echo2, sync = results["echo2"], results["sync"]
    R = args.prompts_per_step * args.group_size
    predicted = predicted_busy_fraction(
        Workload(R, echo2["train_step_s"], echo2["bcast_s"] or 0.0, args.max_lag, echo2["kappa"]),
        sum_mu, Reading.OVERLAPPED)
    sync_bcast_s = sync["bcast_s"] or 0.0
    sync_fixed_s = sync["train_step_s"] + sync_bcast_s
    predicted_sync = sync["train_step_s"] / (sync_fixed_s + R / sum_mu)
    dealt_sync = sync["train_step_s"] / (sync_fixed_s + dealt_generation_s(
        pool, args.prompts_per_step, args.group_size))
    sequential_s0 = predicted_busy_fraction(Workload(R, sync["train_step_s"], sync_bcast_s, 0, 1),
                                            sum_mu, Reading.SEQUENTIAL)
    print(f"{'':6s} {'measured':>8s} {'predicted':>9s}")
    print(f"{'echo2':6s} {echo2['busy_frac']:8.3f} {predicted:9.3f}   (overlapped reading)")
    print(f"{'sync':6s} {sync['busy_frac']:8.3f} {predicted_sync:9.3f}   "
          f"(T/(T+T_bcast+R/mu); with groups dealt round-robin {dealt_sync:.3f}; the core's "
          f"sequential reading at S=0 says {sequential_s0:.3f})")
    return {"predicted_busy_frac": round(predicted, 4),
            "predicted_sync_busy_frac": round(predicted_sync, 4),
            "predicted_sync_dealt_busy_frac": round(dealt_sync, 4),
            "sequential_reading_s0": round(sequential_s0, 4)}


def main(argv: list[str] | None = None) -> int:
    p, args = _parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    R, T = args.prompts_per_step * args.group_size, args.train_step_s
    required = R / T  # overlapped reading: the hub runs this way with S >= 1
    selection = choose_active(parse_candidates(args.candidates), required, args.margin)
    if not selection.feasible:
        p.error(f"the candidates cannot reach {required * (1 + args.margin):.1f} rollouts/s")
    pool = sorted((w for w in parse_candidates(args.candidates) if w.worker_id in selection.active),
                  key=lambda w: -w.rollouts_per_s)
    sum_mu = selection.rollouts_per_s
    wire_bytes = version_wire_bytes(args.model)
    rate_mbps = args.rate_mbit or 8 * wire_bytes / (args.bcast_frac * T) / 1e6
    print(f"R = {R} rollouts/step, T_train = {T:g} s: required {required:.2f}/s, "
          f"+{args.margin:.0%} -> {required * (1 + args.margin):.2f}/s")
    members = ", ".join(f"{w.worker_id} ({w.rollouts_per_s:g}/s, ${w.price_per_hour:g}/h)"
                        for w in pool)
    print(f"pool: {members} = {sum_mu:g}/s, ${selection.price_per_hour:.2f}/h")
    print(f"version {wire_bytes / 1e6:.2f} MB on the wire, uploads capped at {rate_mbps:.1f} "
          f"Mbit/s (M/B = {8 * wire_bytes / rate_mbps / 1e6:.2f} s)")

    # Generous: every step as slow as a sync step (whole groups dealt), three times over.
    sync_step_s = T + 8 * wire_bytes / rate_mbps / 1e6 + dealt_generation_s(
        pool, args.prompts_per_step, args.group_size)
    results = run_both(args, pool, rate_mbps, 60 + 3 * args.steps * sync_step_s)
    echo2, sync = results["echo2"], results["sync"]
    print(json.dumps({
        "bench": "utilization",
        "busy_frac": {"echo2": round(echo2["busy_frac"], 4), "sync": round(sync["busy_frac"], 4)},
        **predictions(args, results, pool, sum_mu),
        "pool": [w.worker_id for w in pool], "sum_mu": sum_mu, "required": round(required, 3),
        "usd_per_hour": round(selection.price_per_hour, 4),
        "rollouts_per_step": R, "train_step_s": T, "max_lag": args.max_lag,
        "kappa": echo2["kappa"], "rate_mbps": round(rate_mbps, 3),
        "bcast_s": {"echo2": _round(echo2["bcast_s"]), "sync": _round(sync["bcast_s"])},
        "stale_groups": {"echo2": echo2["stale"], "sync": sync["stale"]},
        "window_steps": {"echo2": echo2["window"], "sync": sync["window"]},
    }))
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


if __name__ == "__main__":
    sys.exit(main())
