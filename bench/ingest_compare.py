"""Hub ingest of several source trees, interleaved: each tree's own `bench/ingest.py`, each in
an environment of its own, so a before/after figure compares two hubs and not one hub twice.

With the project installed editable, `PYTHONPATH=<other tree>` swaps only `echo2p2p/`:
`echo2p2p.hub` (the `hub/` folder, a package-dir mapping) still loads from the installed
checkout (FIELD-NOTES, 2026-12-07). So every TREE here has its own virtual environment at
TREE/.venv, with the project installed editable from TREE; each run uses that interpreter, in
TREE, and reports which `echo2p2p.hub.__file__` it imported. To set one up (seconds; the
dependencies installed already are reused):

    git worktree add --detach /work/wt-d44a67b d44a67b
    python -m venv --system-site-packages /work/wt-d44a67b/.venv
    /work/wt-d44a67b/.venv/bin/pip install -q --no-deps -e /work/wt-d44a67b

Then, on an otherwise idle machine (the first tree is the baseline of every ratio):

    python bench/ingest_compare.py /work/wt-d44a67b . [--rounds 3] [--seconds 4] [--peers 64]

Round r runs every tree once, in an order rotated by r (a drift in time weighs on each tree
alike). A run is `TREE/.venv/bin/python TREE/bench/ingest.py --seconds S --peers N`, invoked
through `runpy` so that it can say at exit which hub it imported (the bench itself is run as
its own `__main__`, unchanged). For each run it prints admitted rollouts/s (saturation), p99
submit-to-ack latency (half load), the scorer's pipe round trips per group, and the ratios to
the first tree in the same round; then, per tree, medians and the ratios of medians against
the issue-42 target (>= 0.9x the rollouts/s, <= 1.5x the p99); then one JSON line:
{"bench": "ingest_compare", "trees": [...], "rollouts_per_s_ratio": {...},
 "p99_ack_ratio": {...}, "runs": [...]}. A run that fails or prints no result is shown as
such and left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

# Runs TREE's bench as its own __main__ and says at exit which hub it imported.
RUNNER = """import atexit, json, runpy, sys
bench = sys.argv[1]
sys.argv = sys.argv[1:]
@atexit.register
def said():
    hub = sys.modules.get("echo2p2p.hub")
    print(json.dumps({"hub_file": getattr(hub, "__file__", None)}), flush=True)
runpy.run_path(bench, run_name="__main__")
"""
ROUND_TRIPS = re.compile(r"(\d+) groups in (\d+) round trips")
MIN_ROLLOUTS_RATIO, MAX_P99_RATIO = 0.9, 1.5  # issue 42, item 8


def run_once(tree: Path, args: argparse.Namespace) -> dict:
    """One run of `tree`'s bench in `tree`'s environment: its JSON line, the hub it imported,
    and the scorer's round trips per group (None where the bench does not say)."""
    python = tree / ".venv" / "bin" / "python"
    cmd = [str(python), "-c", RUNNER, str(tree / "bench" / "ingest.py"),
           "--seconds", str(args.seconds), "--peers", str(args.peers)]
    try:
        done = subprocess.run(cmd, cwd=tree, capture_output=True, timeout=args.timeout_s)
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, code = exc.stdout or b"", exc.stderr or b"", "timeout"
    out = out.decode(errors="replace")
    found: dict = {"tree": str(tree), "exit": code}
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("bench") == "ingest":
                found["result"] = record
            elif "hub_file" in record:
                found["hub_file"] = record["hub_file"]
    if (trips := ROUND_TRIPS.search(out)) and int(trips.group(1)):
        found["round_trips_per_group"] = int(trips.group(2)) / int(trips.group(1))
    if "result" not in found:
        found["tail"] = (out + err.decode(errors="replace"))[-600:]
    return found


def figure(run: dict, key: str) -> float | None:
    value = run.get("result", {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median(values: list[float | None]) -> float | None:
    """The median of the values there are (None: none)."""
    there = [v for v in values if v is not None]
    return statistics.median(there) if there else None


def show(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def compare(trees: list[Path], args: argparse.Namespace) -> list[dict]:
    """Every round, every tree once (rotated order); each run printed as it ends."""
    print(f"{'round':<6}{'tree':<28}{'rollouts/s':>11}{'p99 ack ms':>12}{'trips/group':>12}"
          f"{'x rollouts':>11}{'x p99':>8}  hub imported")
    runs = []
    for r in range(args.rounds):
        order = trees[r % len(trees):] + trees[:r % len(trees)]
        this_round = {}
        for tree in order:
            run = {**run_once(tree, args), "round": r}
            this_round[tree] = run
            runs.append(run)
        base = this_round[trees[0]]
        for tree in trees:
            run = this_round[tree]
            run["rollouts_ratio"] = ratio(figure(run, "rollouts_per_s"),
                                          figure(base, "rollouts_per_s"))
            run["p99_ratio"] = ratio(figure(run, "p99_ack_ms"), figure(base, "p99_ack_ms"))
            print(f"{r + 1:<6}{tree.name[:27]:<28}{show(figure(run, 'rollouts_per_s'), '.0f'):>11}"
                  f"{show(figure(run, 'p99_ack_ms'), '.1f'):>12}"
                  f"{show(run.get('round_trips_per_group'), '.2f'):>12}"
                  f"{show(run['rollouts_ratio'], '.2f'):>11}{show(run['p99_ratio'], '.2f'):>8}"
                  f"  {run.get('hub_file', '?')}", flush=True)
            if "result" not in run:
                print(f"      no result (exit {run['exit']}): {run.get('tail', '')!r}")
    return runs


def summary(trees: list[Path], runs: list[dict], args: argparse.Namespace) -> dict:
    """Medians per tree and the ratios of medians to the first tree's, printed and returned."""
    medians = {}
    for tree in trees:
        mine = [run for run in runs if run["tree"] == str(tree)]
        medians[str(tree)] = {
            "rollouts_per_s": median([figure(run, "rollouts_per_s") for run in mine]),
            "p99_ack_ms": median([figure(run, "p99_ack_ms") for run in mine]),
            "round_trips_per_group": median([run.get("round_trips_per_group") for run in mine])}
    base = medians[str(trees[0])]
    rollouts = {t: ratio(m["rollouts_per_s"], base["rollouts_per_s"]) for t, m in medians.items()}
    p99 = {t: ratio(m["p99_ack_ms"], base["p99_ack_ms"]) for t, m in medians.items()}
    print(f"\nmedians of {args.rounds} round(s), {args.peers} peers, {args.seconds:g} s a phase "
          f"(target against {trees[0].name}: rollouts/s >= {MIN_ROLLOUTS_RATIO}x, "
          f"p99 ack <= {MAX_P99_RATIO}x)")
    for tree in trees[1:] if len(trees) > 1 else trees:
        t, m = str(tree), medians[str(tree)]
        met = (rollouts[t] is not None and rollouts[t] >= MIN_ROLLOUTS_RATIO
               and p99[t] is not None and p99[t] <= MAX_P99_RATIO)
        print(f"  {tree.name}: {show(m['rollouts_per_s'], '.0f')} rollouts/s "
              f"({show(rollouts[t], '.2f')}x), p99 ack {show(m['p99_ack_ms'], '.1f')} ms "
              f"({show(p99[t], '.2f')}x), {show(m['round_trips_per_group'], '.2f')} round trips "
              f"a group; {'meets' if met else 'misses'} the target")
    print(f"  {trees[0].name}: {show(base['rollouts_per_s'], '.0f')} rollouts/s, p99 ack "
          f"{show(base['p99_ack_ms'], '.1f')} ms, {show(base['round_trips_per_group'], '.2f')} "
          f"round trips a group")
    return {"medians": medians, "rollouts_per_s_ratio": rollouts, "p99_ack_ratio": p99}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", type=Path,
                   help="source trees, each with TREE/.venv; the first is the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--peers", type=int, default=64)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    args = p.parse_args(argv)
    trees = [tree.resolve() for tree in args.trees]
    missing = [str(t) for t in trees if not (t / ".venv" / "bin" / "python").exists()
               or not (t / "bench" / "ingest.py").exists()]
    if missing:
        sys.exit(f"no TREE/.venv/bin/python or TREE/bench/ingest.py in {missing}: see "
                 f"`python {sys.argv[0]} --help` for the recipe")
    runs = compare(trees, args)
    result = summary(trees, runs, args)
    print(json.dumps({"bench": "ingest_compare", "trees": [str(t) for t in trees],
                      "rounds": args.rounds, "seconds": args.seconds, "peers": args.peers,
                      **result, "runs": [{k: v for k, v in run.items() if k != "tail"}
                                         for run in runs]}))


if __name__ == "__main__":
    main()
