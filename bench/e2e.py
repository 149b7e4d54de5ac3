"""End to end: wall-clock time to a held-out accuracy, ECHO-2 mode vs synchronous, on shaped links.

The built-in task and tiny model, the same seed, steps, prompts per step and group size in both
modes; a hub (in this process, `echo2p2p.hub.run.start.start_hub`) and 4 `echo2-peer join` processes
(`--torch-threads 1`) on 127.0.0.1. Modes:
- echo2: S = 4 (kappa = 3), pipelined overlay (peers relay chunks to each other);
- sync:  S = 0 (kappa = 1), star (the hub uploads every version to every peer).
Links are shaped with the token-bucket upload caps (hub `upload_limit_mbps`, each peer
`--upload-limit-mbps`), the same B everywhere and in both modes, chosen so that M / B = 2 T_train
(an 8B bf16 model over 1 Gbit/s against a ~60 s step): a short unshaped calibration run (sync)
first measures M, the wire bytes of one full version, and T_train, the median learner step over
as many steps as the timed runs (steps get ~4x faster as the policy converges and more groups
have zero advantage, so a shorter calibration would pick a slower step).
Every version goes out in full (`anchor_every = 1`; `--anchor-every 10` keeps the product's
lossless deltas, which make broadcasts far shorter than M / B).

Wall clock: the learner's own clock (`time_s` of each step record), from the moment step 0
began (peer start-up, ~10-20 s of imports on a small box, is left out; both modes then start from
the same point). Evaluation is kept out of the runs altogether, so it stalls neither mode: the
hub runs with `eval_every = 0`, the bench copies the learner's weights each time a step's record
is written (the run log's stream; ~1 ms a step) and, after the run, evaluates every
--eval-every-th version on the hub's held-out set (256 problems, greedy, `HubRun.evaluate`).
Time to target = wall time of the first evaluated version at or above --target; final accuracy
= the mean over the last 3 evaluated versions.

    python bench/e2e.py [--quick] [--target 0.7] [--steps 80] [--plot bench/e2e.png]

Prints per-mode summary lines (time to target, final accuracy, median learner step T_train,
median broadcast time = propagation `done_s`, learner busy fraction), writes a PNG of accuracy
vs wall time, then one JSON line {"bench": "e2e", "speedup_to_target": sync time / echo2 time,
"final_acc": {"echo2", "sync"}, ...}. The ECHO-2 claim holds if speedup_to_target >= 2 and the
final accuracies differ by less than "noise_2se" (two standard errors of a binomial accuracy).
On a small CPU box the peers and the learner share cores: the echo2 learner steps are slower
than sync ones (peers generate meanwhile); compare the T_train the summary prints per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2p2p.hub.config import HubConfig  # noqa: E402
from echo2p2p.runtime import process  # noqa: E402

MODES = {"echo2": dict(max_lag=4, relay="pipelined"), "sync": dict(max_lag=0, relay="star")}
N_PEERS = 4
FINAL_EVALS = 3


class Snapshots:
    """A run log stream that copies the learner's weights whenever a step's record is written.

    `HubRun` appends a step's record and writes it to the stream before the next step can start,
    so the weights copied then are exactly the version the record names (a ~1 ms copy, which is
    all this adds to the learner loop). They are evaluated after the run (`evaluate`)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.run = None
        self.weights: dict[int, dict] = {}  # version -> a copy of the learner's state dict

    def take(self, version: int) -> None:
        if version % self.every == 0 and version not in self.weights:
            state = self.run.learner.model.state_dict()
            self.weights[version] = {name: t.clone() for name, t in state.items()}

    def write(self, text: str) -> int:
        if self.run is not None and self.run.records:
            self.take(self.run.records[-1]["version"])
        return len(text)

    def flush(self) -> None:
        pass


@dataclass
class Outcome:
    """What one run left behind: step records, propagation records, held-out accuracies."""

    records: list[dict]
    propagation: list[dict]
    full_wire_bytes: int
    accuracy: dict[int, float]  # version -> held-out accuracy

    def points(self) -> list[tuple[float, float]]:
        """(wall s since step 0 began, accuracy) for every evaluated version; v0 at 0."""
        steps = [r for r in self.records if "step" in r]
        origin = steps[0]["time_s"] - steps[0]["train/step_s"]
        wall = {0: 0.0} | {r["version"]: r["time_s"] - origin for r in steps}
        return [(wall[v], a) for v, a in sorted(self.accuracy.items())]


async def run_cluster(cfg: HubConfig, rate_mbps: float, timeout_s: float,
                      eval_every: int = 0) -> Outcome:
    """Hub + N_PEERS peer processes until `cfg.run.max_steps`, then (`eval_every` > 0) the held-out
    accuracy of every `eval_every`-th version. Peers are stopped on every exit path, and after
    `timeout_s` the run fails (TimeoutError) instead of hanging."""
    from echo2p2p.hub.run.start import start_hub

    snaps = Snapshots(eval_every or cfg.run.max_steps + 1)
    peers: list[asyncio.subprocess.Process] = []
    async with start_hub(cfg, stream=snaps) as run:
        snaps.run = run
        snaps.take(0)  # the learner loop has not started yet: this is version 0
        try:
            async with asyncio.timeout(timeout_s):
                env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                for i in range(N_PEERS):
                    peers.append(await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "echo2p2p.peer.cli", "join", run.url, "--name", f"e2e-{i}",
                        "--torch-threads", "1", "--listen", "127.0.0.1:0",
                        "--upload-limit-mbps", str(rate_mbps), "--log-level", "warning", env=env))
                finished = asyncio.ensure_future(run.finished.wait())
                exits = [asyncio.ensure_future(p.wait()) for p in peers]
                try:
                    await asyncio.wait([finished, *exits], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for fut in (finished, *exits):
                        fut.cancel()
                if not run.finished.is_set():
                    raise RuntimeError("a peer process exited before the run finished")
        finally:
            await stop(peers)
        full_wire_bytes = run.hub.core.tracker.snapshot().wire_bytes
    accuracy = {}
    if eval_every:
        async with asyncio.timeout(timeout_s):
            for version, state in sorted(snaps.weights.items()):
                run.learner.model.load_state_dict(state)
                accuracy[version] = await run.evaluate()
    lines = (Path(cfg.run.run_dir) / "metrics.jsonl").read_text().splitlines()
    propagation = [r for r in map(json.loads, lines) if r.get("event") == "propagation"]
    return Outcome(run.records, propagation, full_wire_bytes, accuracy)


async def stop(peers: list[asyncio.subprocess.Process], grace_s: float = 10) -> None:
    """Terminate the peer processes; kill those still there after `grace_s`."""
    for proc in peers:
        if proc.returncode is None:
            proc.terminate()
    for proc in peers:
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """Wall seconds of the first evaluation at or above `target` (None: never)."""
    return next((round(t, 2) for t, a in points if a >= target), None)


def summarize(name: str, out: Outcome, target: float, n_problems: int) -> dict:
    points, steps = out.points(), [r for r in out.records if "step" in r]
    bcast = [p["done_s"] for p in out.propagation if p["complete"]]
    final = statistics.fmean(a for _, a in points[-FINAL_EVALS:])
    s = {
        "time_to_target_s": time_to(points, target),
        "final_acc": round(final, 4),
        "train_step_s": round(statistics.median(r["train/step_s"] for r in steps), 4),
        "bcast_s": round(statistics.median(bcast), 3) if bcast else None,
        "wall_s": round(steps[-1]["time_s"] - steps[0]["time_s"] + steps[0]["train/step_s"], 2),
        "busy_frac": round(steps[-1]["hub/learner_busy_frac"], 3),
        "staleness_mean": round(statistics.fmean(r["rollout/staleness_mean"] for r in steps), 2),
    }
    tt = s["time_to_target_s"]
    print(f"{name:5s}: target {target:g} at {'never' if tt is None else f'{tt:.2f} s'}, final acc "
          f"{final:.3f} (mean of last {FINAL_EVALS} evals of {n_problems}); {len(steps)} steps in "
          f"{s['wall_s']:.1f} s; T_train median {s['train_step_s']:.3f} s, broadcast median "
          f"{s['bcast_s']} s over {len(bcast)} versions, learner busy {s['busy_frac']:.2f}, "
          f"mean staleness {s['staleness_mean']}", flush=True)
    return s


async def bench(args: argparse.Namespace, workdir: Path) -> dict:
    base = dict(port=0, seed=args.seed, torch_threads=1, anchor_every=args.anchor_every,
                eval_every=0)  # evaluated after each run, from weight copies: no stalls
    rate_mbps = args.rate_mbps
    if not rate_mbps:
        cal = await run_cluster(HubConfig.from_flat(**base, **MODES["sync"], max_steps=args.steps,
                                          run_dir=str(workdir / "calibration")),
                                0.0, args.timeout_s)
        train_s = statistics.median(r["train/step_s"] for r in cal.records[1:])
        rate_mbps = cal.full_wire_bytes * 8 / (2 * train_s) / 1e6
        print(f"calibration: M = {cal.full_wire_bytes} wire bytes, T_train = {train_s:.3f} s "
              f"(median of {len(cal.records) - 1} unshaped sync steps) -> B = {rate_mbps:.1f} "
              f"Mbit/s, M/B = {cal.full_wire_bytes * 8 / rate_mbps / 1e6:.3f} s", flush=True)
    results, summary = {}, {}
    for name, mode in MODES.items():
        cfg = HubConfig.from_flat(**base, **mode, max_steps=args.steps, upload_limit_mbps=rate_mbps,
                        run_dir=str(workdir / name))
        results[name] = await run_cluster(cfg, rate_mbps, args.timeout_s, args.eval_every)
        summary[name] = summarize(name, results[name], args.target, cfg.tasks.eval_problems)
    plot(results, args.target, args.plot)
    tt = {k: s["time_to_target_s"] for k, s in summary.items()}
    fa = {k: s["final_acc"] for k, s in summary.items()}
    n = HubConfig().tasks.eval_problems
    return {
        "bench": "e2e",
        "speedup_to_target": speedup(tt),
        "final_acc": fa,
        "noise_2se": round(2 * math.sqrt(sum(a * (1 - a) / n for a in fa.values())), 4),
        "target": args.target,
        "time_to_target_s": tt,
        "speedup_by_target": {
            str(x): speedup({k: time_to(out.points(), x) for k, out in results.items()})
            for x in sorted({0.6, 0.75, args.target})},
        "wall_s": {k: s["wall_s"] for k, s in summary.items()},  # all --steps steps
        "bcast_s": {k: s["bcast_s"] for k, s in summary.items()},
        "train_step_s": {k: s["train_step_s"] for k, s in summary.items()},
        "rate_mbps": round(rate_mbps, 2),
        "full_wire_bytes": results["sync"].full_wire_bytes,
        "steps": args.steps,
        "loadavg_1m_at_start": args.load,
    }


def speedup(times: dict[str, float | None]) -> float | None:
    if times["sync"] is None or not times["echo2"]:
        return None
    return round(times["sync"] / times["echo2"], 2)


def plot(results: dict[str, Outcome], target: float, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"echo2": "ECHO-2 (S=4, pipelined)", "sync": "sync (S=0, star)"}
    for name, out in results.items():
        ax.plot(*zip(*out.points()), marker="o", markersize=3, label=labels[name])
    ax.axhline(target, color="grey", linestyle="--", label=f"target {target:g}")
    ax.set_xscale("symlog", linthresh=1)  # linear below 1 s, log above: the climb is early
    ax.set_xlim(left=0)
    ax.set(xlabel="learner wall time since step 0 began (s); evaluated afterwards",
           ylabel="held-out accuracy", title="tiny model, 4 peers, links shaped so M/B = 2 T_train")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="20 steps per mode: a few minutes")
    p.add_argument("--steps", type=int, default=80, help="learner steps per mode")
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every this many versions")
    p.add_argument("--target", type=float, default=0.7, help="held-out accuracy to reach")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--anchor-every", type=int, default=1,
                   help="1: every version in full (M/B per broadcast); 10: the product's deltas")
    p.add_argument("--rate-mbps", type=float, default=0.0,
                   help="B for every uplink, Mbit/s; 0 = calibrate so that M/B = 2 T_train")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="watchdog: a run (calibration or mode) taking longer fails")
    p.add_argument("--plot", default=str(Path(__file__).with_name("e2e.png")))
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 20
    args.load = round(os.getloadavg()[0], 2)
    process.configure("warning")
    print(f"load average (1 min) at start: {args.load} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="e2e-") as workdir:
        result = asyncio.run(bench(args, Path(workdir)))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
