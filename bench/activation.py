"""Cost-aware activation at 1,000 priced workers under churn, against the LP lower bound.

A pool of simulated rollout workers, 80 % rented GPUs and 20 % free volunteers, loses and gains
workers every tick and its throughputs drift. Each tick the hub re-plans with each policy:
cost-aware (`echo2p2p.activation.Activator`: greedy by price per throughput, finishes, prune,
with hysteresis), the same without hysteresis (`choose_active` from scratch), activate-all and
fastest-first. Every cost is divided by the LP lower bound of that tick's pool; every re-plan of
the cost-aware Activator is timed with time.perf_counter.

    python bench/activation.py [--quick] [--ticks 200] [--workers 1000] [--seed 0]

Prices: approximate on-demand list prices in $/GPU-hour, single GPU, read from public pages
(not fetched live; they change often):
  - RunPod (https://www.runpod.io/pricing), community-cloud rates as tabulated on
    https://deploybase.ai/articles/runpod-gpu-pricing, "data as of March 2026":
    RTX 3090 0.22, RTX 4090 0.34, L4 0.44, A100 PCIe 80GB 1.19, H100 SXM 2.69;
  - Lambda (https://lambda.ai/pricing), as quoted on
    https://techbytes.app/posts/serverless-gpu-pricing-matrix-modal-replicate-lambda-2026/,
    "verified on May 7, 2026": A10 0.86, A100 40GB 1.48, H100 PCIe 2.86.
Throughput: decoding is memory-bandwidth-bound (every generated token reads all the weights), so
a type's rollouts/s is taken proportional to its memory bandwidth from NVIDIA's spec sheets
(GB/s): RTX 3090 936, RTX 4090 1008, L4 300, A10 600, A100 40GB 1555, A100 80GB PCIe 1935,
H100 PCIe 2000, H100 SXM 3350; volunteers are RTX 3060-class (360). The scale, 1 rollout/s per
TB/s, is arbitrary (about a 1k-token completion of a 7-8B bf16 model at a moderate batch) and
cancels in every ratio reported; KV-cache capacity and compute limits are ignored. Each worker
gets +-15 % jitter on its price and its throughput.

Prints a table, then one JSON line:
{"bench": "activation", "cost_over_lp_bound": ..., "replan_ms": ..., "replan_p99_ms": ...,
 "activate_all_over_lp": ..., "fastest_first_over_lp": ..., ...}
Ratios are means over ticks of $/h over the LP bound at the plan's target, required x (1 +
margin). A set the Activator keeps may sag to its keep floor, required x (1 + margin/2), which
can put it below that bound; the "same supply" ratios divide instead by the LP bound for the
throughput the set actually delivers: what a set costs over the cheapest fractional way to buy
as much. Switches count workers turned on or off among those present in both ticks (joins and
leaves are not switches).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo2p2p.activation import (Activator, PricedWorker, Selection, activate_all, choose_active,
                                 fastest_first, lp_lower_bound)
from echo2p2p.capacity import Reading, Workload, required_throughput

# name: ($/h, memory bandwidth GB/s, share of the rented pool)
GPU_TYPES = {
    "RTX 3090": (0.22, 936, 0.20),
    "RTX 4090": (0.34, 1008, 0.20),
    "L4": (0.44, 300, 0.10),
    "A10": (0.86, 600, 0.10),
    "A100 40GB": (1.48, 1555, 0.10),
    "A100 80GB": (1.19, 1935, 0.10),
    "H100 PCIe": (2.86, 2000, 0.05),
    "H100 SXM": (2.69, 3350, 0.15),
}
VOLUNTEER = ("volunteer", 0.0, 360)
VOLUNTEER_SHARE = 0.20
ROLLOUTS_PER_S_PER_TBPS = 1.0
JITTER = 0.15

# The learner: 256 prompts x 16 samples per 20 s step, an 8-12 s broadcast, S=4, kappa=3.
WORKLOAD = Workload(rollouts_per_step=4096, train_step_s=20.0, bcast_s=12.0, max_lag=4, kappa=3)
READING = Reading.SEQUENTIAL
MARGIN = 0.1


@dataclass
class SimWorker:
    worker: PricedWorker
    nominal_rollouts_per_s: float  # drift stays within +-30 % of this


def new_worker(rng: random.Random, ids: itertools.count) -> SimWorker:
    if rng.random() < VOLUNTEER_SHARE:
        name, price, bandwidth = VOLUNTEER
    else:
        name = rng.choices(list(GPU_TYPES), weights=[t[2] for t in GPU_TYPES.values()])[0]
        price, bandwidth, _ = GPU_TYPES[name]
    jitter = lambda: rng.uniform(1 - JITTER, 1 + JITTER)
    mu = bandwidth / 1000 * ROLLOUTS_PER_S_PER_TBPS * jitter()
    worker = PricedWorker(f"{name.replace(' ', '-').lower()}-{next(ids)}",
                          round(price * jitter(), 4), mu)
    return SimWorker(worker, mu)


def tick(pool: list[SimWorker], rng: random.Random, ids: itertools.count, size: int,
         churn: float, drift: float) -> list[SimWorker]:
    """Each worker leaves with probability `churn`; newcomers keep the pool near `size` on
    average; every throughput takes a log-normal step, kept within +-30 % of nominal."""
    kept = [w for w in pool if rng.random() >= churn]
    joins = sum(rng.random() < churn for _ in range(size))
    kept += [new_worker(rng, ids) for _ in range(joins)]
    for w in kept:
        mu = w.worker.rollouts_per_s * math.exp(rng.gauss(0, drift))
        mu = min(max(mu, 0.7 * w.nominal_rollouts_per_s), 1.3 * w.nominal_rollouts_per_s)
        w.worker = replace(w.worker, rollouts_per_s=mu)
    return kept


@dataclass
class Track:
    """Per-policy numbers over the ticks."""

    price: list[float] = field(default_factory=list)
    over_same_supply: list[float] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    supply: list[float] = field(default_factory=list)  # rollouts/s / required
    switches: list[int] = field(default_factory=list)  # on/off among workers present both ticks
    replan_s: list[float] = field(default_factory=list)
    last: Selection | None = None

    def add(self, sel: Selection, workers: list[PricedWorker], required: float,
            stayed: set[str]) -> None:
        self.price.append(sel.price_per_hour)
        same = lp_lower_bound(workers, sel.rollouts_per_s)
        self.over_same_supply.append(sel.price_per_hour / same if same else 1.0)
        self.active.append(len(sel.active))
        self.supply.append(sel.rollouts_per_s / required)
        if self.last is not None:
            self.switches.append(len((set(self.last.active) ^ set(sel.active)) & stayed))
        self.last = sel

    def over(self, bounds: list[float]) -> list[float]:
        """Cost / bound, tick by tick."""
        return [p / b if b else 1.0 for p, b in zip(self.price, bounds)]


def ms(samples: list[float], q: float) -> float:
    return 1000 * sorted(samples)[min(len(samples) - 1, int(q * len(samples)))]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="40 ticks instead of 200")
    p.add_argument("--ticks", type=int, default=200)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--churn", type=float, default=0.02, help="leave probability per tick")
    p.add_argument("--drift", type=float, default=0.02, help="log-normal throughput step")
    p.add_argument("--switch-gain", type=float, default=0.05, help="Activator price hysteresis")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def race(args: argparse.Namespace, ticks: int, activator: Activator, pool: list[SimWorker],
         rng: random.Random, ids: itertools.count, required: float
         ) -> tuple[dict[str, Track], list[float], list[SimWorker]]:
    """Every policy replans the same churning pool each tick: their tracks, the LP bound per
    tick, and the pool at the end."""
    policies = {"cost-aware": None, "no-hysteresis": choose_active,
                "fastest-first": fastest_first, "activate-all": activate_all}
    tracks = {name: Track() for name in policies}
    bounds, previous = [], set()
    for t in range(ticks):
        if t:
            pool = tick(pool, rng, ids, args.workers, args.churn, args.drift)
        workers = [w.worker for w in pool]
        present = {w.worker_id for w in workers}
        stayed, previous = present & previous, present
        bound = lp_lower_bound(workers, required * (1 + MARGIN))
        assert bound is not None, "the pool fell short of the requirement"
        bounds.append(bound)
        for name, policy in policies.items():
            start = time.perf_counter()
            sel = activator.replan(workers, required) if policy is None else \
                policy(workers, required, MARGIN)
            tracks[name].replan_s.append(time.perf_counter() - start)
            tracks[name].add(sel, workers, required, stayed)
    return tracks, bounds, pool


def print_table(tracks: dict[str, Track], bounds: list[float], keep_margin: float) -> None:
    mean = statistics.fmean
    print(f"{'policy':14s} {'$/h':>8s} {'cost/LP':>8s} {'max':>6s} {'same supply':>11s} "
          f"{'active':>6s} {'supply/req':>10s} {'switches/tick':>13s} {'ms p50':>7s} "
          f"{'ms p99':>7s}")
    for name, tr in tracks.items():
        over = tr.over(bounds)
        print(f"{name:14s} {mean(tr.price):8.2f} {mean(over):8.4f} {max(over):6.3f} "
              f"{mean(tr.over_same_supply):11.4f} {mean(tr.active):6.0f} {mean(tr.supply):10.3f} "
              f"{mean(tr.switches):13.2f} "
              f"{ms(tr.replan_s, 0.5):7.2f} {ms(tr.replan_s, 0.99):7.2f}")
    print(f"cost/LP: over the LP bound at required x {1 + MARGIN:g}; same supply: over the LP "
          f"bound at the throughput the set delivers (a kept set may sag to required x "
          f"{1 + keep_margin:g})")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    ticks = 40 if args.quick else args.ticks
    need = required_throughput(WORKLOAD, READING)
    assert need.feasible, need.reason
    required = need.rollouts_per_s
    rng, ids = random.Random(args.seed), itertools.count()
    pool = [new_worker(rng, ids) for _ in range(args.workers)]
    capacity = sum(w.worker.rollouts_per_s for w in pool)
    print(f"workload: {need.reason}; +{MARGIN:.0%} margin -> {required * (1 + MARGIN):.1f}/s "
          f"of a {capacity:.0f}/s pool of {len(pool)} workers")
    print(f"{'type':10s} {'$/h':>5s} {'GB/s':>5s} {'$/h per rollout/s':>17s}")
    for name, (price, bw, _) in [(VOLUNTEER[0], VOLUNTEER[1:] + (0,)), *GPU_TYPES.items()]:
        per_mu = price / (bw / 1000 * ROLLOUTS_PER_S_PER_TBPS)
        print(f"{name:10s} {price:5.2f} {bw:5d} {per_mu:17.3f}")

    activator = Activator(margin=MARGIN, switch_gain=args.switch_gain)
    tracks, bounds, pool = race(args, ticks, activator, pool, rng, ids, required)
    mean = statistics.fmean
    print(f"\n{ticks} ticks, {len(pool)} workers at the end, churn {args.churn:.0%}/tick, "
          f"LP bound {mean(bounds):.2f} $/h on average")
    print_table(tracks, bounds, activator.keep_margin)
    cost_aware, no_hysteresis = tracks["cost-aware"], tracks["no-hysteresis"]
    print(json.dumps({
        "bench": "activation",
        "cost_over_lp_bound": round(mean(cost_aware.over(bounds)), 4),
        "cost_over_lp_same_supply": round(mean(cost_aware.over_same_supply), 4),
        "replan_ms": round(ms(cost_aware.replan_s, 0.5), 3),
        "replan_p99_ms": round(ms(cost_aware.replan_s, 0.99), 3),
        "activate_all_over_lp": round(mean(tracks["activate-all"].over(bounds)), 4),
        "fastest_first_over_lp": round(mean(tracks["fastest-first"].over(bounds)), 4),
        "no_hysteresis_over_lp": round(mean(no_hysteresis.over(bounds)), 4),
        "no_hysteresis_over_lp_same_supply": round(mean(no_hysteresis.over_same_supply), 4),
        "switches_per_tick": round(mean(cost_aware.switches), 2),
        "no_hysteresis_switches_per_tick": round(mean(no_hysteresis.switches), 2),
        "ticks": ticks, "workers": args.workers,
    }))

if __name__ == "__main__":
    main()
