"""The real hub's (and the demo's) peak memory against the footprint it predicts at start.

Runs `echo2-hub demo` on a real model for a few steps and samples, every --every-s, the resident
memory (psutil RSS: anonymous, file-backed and shared pages, what the OOM killer counts) of the
hub process, its reward workers, and each local peer. Every sample is tagged with the hub's last
log line, so the peak is placed in a phase (loading, the base evaluation, a step, a publication,
a checkpoint, a spot-check). Reported: the hub's peak (its process and its scoring workers) and
the demo's (everything), each against the prediction the hub logs at start
(`predicted hub footprint` and `predicted demo footprint`).

    python bench/demo_footprint.py --model smollm2-135m --peers 2 --max-steps 4 \
        --eval-every 4 --timeout-s 480 --resume       # an idle 2-core machine: about 10 minutes
    python bench/demo_footprint.py --model tiny --max-steps 4            # seconds, for a check

Measured on 2 cores shared with five other jobs (load 3-4), SmolLM2-135M, 2 transformers peers,
170 s a run: neither run trained a step in that time (the 64-problem base evaluation took 3
minutes). Before any step: the hub 4.23 GB and its 2 scoring workers 0.34 (4.51 GB; the parts
present then, runtime, learner state with AdamW's moments made at the first checkpoint,
spot-checker, publication, workers, predict 4.47), each peer 1.95 GB, the demo 8.23 GB; resumed
from the v0 checkpoint: 4.33, 1.97 and 8.16 GB. The step's parts (micro-batch, allocator slack)
are not in these figures: the lead's idle-machine run above gives them.

`--resume` runs the demo a second time from the first run's checkpoint, as a resumed demo
(the checkpoint loads while the model is resident). Extra flags after `--` go to the demo.
Keep runs short on a shared machine: each real-model step takes tens of seconds on 2 cores.
Ends with one JSON line {"bench": "demo_footprint", ...}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

PREDICTED = re.compile(r"predicted (hub|demo) footprint: RAM ([0-9.]+) GB")


def kind_of(proc: psutil.Process, hub_pid: int) -> str:
    """hub (the process itself), worker (its reward and eval scorers), peer, or other."""
    if proc.pid == hub_pid:
        return "hub"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    return "peer" if "echo2p2p.peer.cli" in cmd else "worker"


def sample(hub: psutil.Process) -> dict[str, int]:
    """RSS bytes by kind, and per peer process."""
    out: dict[str, int] = {}
    try:
        procs = [hub, *hub.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            rss = proc.memory_info().rss
        except psutil.Error:
            continue
        kind = kind_of(proc, hub.pid)
        out[kind] = out.get(kind, 0) + rss
        if kind == "peer":
            out[f"peer {proc.pid}"] = rss
    return out


def run_once(args: argparse.Namespace, run_dir: Path, resume: bool) -> dict:
    command = [sys.executable, "-m", "echo2p2p.hub.cli", "demo", "--model", args.model,
               "--peers", str(args.peers), "--max-steps", str(args.max_steps),
               "--eval-every", str(args.eval_every), "--eval-problems", str(args.eval_problems),
               "--dashboard-port", "-1", *args.extra]
    command += ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hub = psutil.Process(proc.pid)
    state = {"line": "starting", "predicted": {}}
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip())
            state["line"] = line.strip()[:140]
            for kind, gb in PREDICTED.findall(line):
                state["predicted"][kind] = float(gb) * 1e9

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peaks: dict[str, tuple[int, str]] = {}
    deadline = time.monotonic() + args.timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.terminate()
            break
        now = sample(hub)
        now["hub+workers"] = now.get("hub", 0) + now.get("worker", 0)
        now["all"] = sum(v for k, v in now.items() if k in ("hub", "worker", "peer"))
        for key, rss in now.items():
            if rss > peaks.get(key, (0, ""))[0] * 1.02 and key in ("hub+workers", "all"):
                print(f"  {time.strftime('%H:%M:%S')} {key} {rss / 1e9:.2f} GB  during: "
                      f"{state['line']}", flush=True)  # a run cut short still told its peaks
            if rss > peaks.get(key, (0, ""))[0]:
                peaks[key] = (rss, state["line"])
        time.sleep(args.every_s)
    try:
        proc.wait(timeout=60)  # a clean stop checkpoints first
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=5)
    return {"rc": proc.returncode, "peaks": peaks, "predicted": state["predicted"],
            "tail": lines[-6:]}


def report(name: str, result: dict) -> dict:
    gb = 1e9
    peaks, predicted = result["peaks"], result["predicted"]
    hub = peaks.get("hub+workers", (0, ""))[0]
    everything = peaks.get("all", (0, ""))[0]
    print(f"[{name}] rc {result['rc']}")
    for key, (rss, line) in sorted(peaks.items()):
        print(f"  peak {key:12s} {rss / gb:6.2f} GB  during: {line}")
    row = {"hub_peak_bytes": hub, "demo_peak_bytes": everything,
           "predicted_hub_bytes": predicted.get("hub"), "predicted_demo_bytes": predicted.get("demo"),
           "hub_process_peak_bytes": peaks.get("hub", (0, ""))[0],
           "peer_peak_bytes": max((v for k, (v, _) in peaks.items() if k.startswith("peer ")),
                                  default=0)}
    for what, measured in (("hub", hub), ("demo", everything)):
        if predicted.get(what):
            print(f"  {what}: measured {measured / gb:.2f} GB, predicted {predicted[what] / gb:.2f} "
                  f"GB (measured / predicted {measured / predicted[what]:.2f})")
    if result["rc"]:
        print("  " + "\n  ".join(result["tail"]))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-problems", type=int, default=64,
                   help="one evaluation batch (64) holds what 200 problems hold at once")
    p.add_argument("--every-s", type=float, default=0.2)
    p.add_argument("--timeout-s", type=float, default=240.0,
                   help="per demo run: then stopped by SIGTERM (a clean stop), peaks reported")
    p.add_argument("--resume", action="store_true", help="then resume it once, measured too")
    p.add_argument("extra", nargs="*", help="more demo flags, after --")
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="demo-footprint-") as tmp:
        run_dir = Path(tmp) / "run"
        rows["first"] = report("first run", run_once(args, run_dir, resume=False))
        if args.resume:
            args.max_steps *= 2
            rows["resumed"] = report("resumed", run_once(args, run_dir, resume=True))
    print(json.dumps({"bench": "demo_footprint", "model": args.model, "peers": args.peers,
                      "max_steps": args.max_steps, **rows}))


if __name__ == "__main__":
    main()
