"""Do the hub's rates agree wherever they are shown? A real demo, read from every surface.

Runs `echo2-hub demo --max-steps N` (the tiny model, two local peers, offline) and, while it
trains, reads each surface a user has: the terminal's step lines, what `echo2-hub status` shows
(its own `fetch` and `render` of /status, read as text), /status, /metrics and the dashboard's
data feed (/api/snapshot); after the run, `echo2-hub report`'s summary table. Values sampled at
different moments are compared through the step they belong to: every step figure (admitted/s,
learner busy) against the run log's record of the same step; the live figures (the capacity
model's, each peer's admitted/s and gen/s while busy) between the surfaces read back to back,
within LIVE_TOLERANCE (an admission between two reads moves them a little).

    python -m bench.rates_agree --max-steps 30

Prints the table (source -> values) and ends with one JSON line:
{"bench": "rates_agree", "step": ..., "agree": true, "disagreements": [], "sources": {...}}.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from echo2p2p.hub.view import watch
from echo2p2p.rates import rate_text

RATE = "rate"  # the places of a rate: as `rate_text` writes it (two significant figures at least)
LIVE_TOLERANCE = 0.05  # relative, plus 0.5/s: the live figures of two reads a few ms apart
SAMPLES = 3  # reads of every surface, one after another: a burst of admissions between two
# surfaces' reads of one sample moves a peer's rate more than the tolerance on a loaded box
# (60.9 against 57.3/s once in CI); a disagreement of definitions shows in every sample
STEP_LINE = re.compile(r"^step\s+(\d+)\s.*admitted/s\s+([\d.]+)\s+busy\s+([\d.]+)")
HUB = str(Path(sys.executable).with_name("echo2-hub"))  # this environment's command
KEYS = ("step", "admitted/s", "busy", "gen/s (active)", "required/s", "predicted busy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def from_status(status: dict[str, Any]) -> dict[str, Any]:
    last, capacity = status.get("last") or {}, status.get("capacity") or {}
    return {"step": last.get("step"), "admitted/s": last.get("rollout/per_s"),
            "busy": last.get("hub/learner_busy_frac"),
            "gen/s (active)": capacity.get("capacity/gen_rollouts_per_s"),
            "required/s": capacity.get("capacity/required_rollouts_per_s"),
            "predicted busy": capacity.get("capacity/predicted_busy_frac"),
            "peers": {p["name"]: (p.get("admitted_per_s"), p.get("gen_rollouts_per_s"))
                      for p in status.get("peers", {}).values()}}


def from_metrics(text: str) -> dict[str, Any]:
    values: dict[str, float] = {}
    peers: dict[str, dict[str, float]] = {}
    names: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "echo2_hub_peer_info":
                names[s.labels["peer"]] = s.labels["name"]
            elif "peer" in s.labels:
                peers.setdefault(s.labels["peer"], {})[s.name] = s.value
            else:
                values[s.name] = s.value
    return {"time_s": values.get("echo2_train_elapsed_seconds"),
            "admitted/s": values.get("echo2_admitted_rollouts_per_second"),
            "busy": values.get("echo2_learner_busy_ratio"),
            "gen/s (active)": values.get("echo2_capacity_gen_rollouts_per_second"),
            "required/s": values.get("echo2_capacity_required_rollouts_per_second"),
            "predicted busy": values.get("echo2_capacity_predicted_busy_ratio"),
            "peers": {names.get(pid, pid): (v.get("echo2_hub_peer_admitted_rollouts_per_second"),
                                            v.get("echo2_hub_peer_gen_rollouts_per_second"))
                      for pid, v in peers.items()}}


def from_snapshot(snap: dict[str, Any]) -> dict[str, Any]:
    steps, status = snap["steps"], snap["status"]
    shown = from_status(status)
    return {**shown, "step": steps["step"][-1], "admitted/s": steps["rollouts_per_s"][-1],
            "busy": steps["busy"][-1]}


def from_watch(status: dict[str, Any]) -> dict[str, Any]:
    """What `echo2-hub status` prints for `status`, read back from its text."""
    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(watch.render(status))
    text = console.export_text()
    number = r"([\d.]+|-)"
    find = lambda pattern: (m := re.search(pattern, text)) and _float(m.group(1))  # noqa: E731
    peers = {}
    for name in (p["name"] for p in status.get("peers", {}).values()):
        row = re.search(rf"^\s*{re.escape(name)}\s+\S+\s+\S+\s+{number}\s+{number}", text, re.M)
        peers[name] = (_float(row.group(1)), _float(row.group(2))) if row else (None, None)
    return {"step": from_status(status)["step"], "admitted/s": find(rf"admitted/s {number}"),
            "busy": find(rf"busy {number}"), "gen/s (active)": None, "required/s": None,
            "predicted busy": find(rf"busy \S+ \(model {number}\)"), "peers": peers, "text": text}


def _float(text: str) -> float | None:
    return None if text == "-" else float(text)


def sample(base: str) -> dict[str, dict[str, Any]]:
    """Every live surface, read back to back (the step they show is in each)."""
    status = json.loads(get(base + "/status"))
    metrics = from_metrics(get(base + "/metrics").decode())
    snap = json.loads(get(base + "/api/snapshot"))
    return {"echo2-hub status": from_watch(status), "/status": from_status(status),
            "/metrics": metrics, "dashboard feed": from_snapshot(snap)}


def terminal_steps(lines: list[str]) -> dict[int, dict[str, float]]:
    """The terminal's step lines: step -> its admitted/s and busy."""
    return {int(m.group(1)): {"admitted/s": float(m.group(2)), "busy": float(m.group(3))}
            for m in map(STEP_LINE.match, lines) if m}


def run_log(run_dir: Path) -> dict[int, dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "rollout/per_s" in r}


def report_rows(run_dir: Path) -> dict[str, str]:
    subprocess.run([HUB, "report", str(run_dir)], check=True, capture_output=True)
    page = (run_dir / "report" / "report.html").read_text()
    return {html.unescape(k): html.unescape(v)
            for k, v in re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", page)}


def from_report(rows: dict[str, str], last: dict[str, Any]) -> dict[str, Any]:
    busy, predicted = rows["learner busy fraction (last 60 s; capacity model)"].split("; ")
    required = rows["required rollouts/s (capacity model)"]
    return {"step": last["step"], "admitted/s": float(rows["admitted/s (last 60 s)"]),
            "busy": float(busy), "predicted busy": float(predicted),
            "gen/s (active)": float(rows["gen/s while busy, active peers (capacity model's input)"]),
            "required/s": None if required.startswith("none") else float(required), "peers": {}}


def from_record(r: dict[str, Any]) -> dict[str, Any]:
    return {"step": r["step"], "admitted/s": r["rollout/per_s"], "busy": r["hub/learner_busy_frac"],
            "gen/s (active)": r.get("capacity/gen_rollouts_per_s"),
            "required/s": r.get("capacity/required_rollouts_per_s"),
            "predicted busy": r.get("capacity/predicted_busy_frac"), "peers": {}}


def disagreements(live: dict[str, dict[str, Any]], terminal: dict[int, dict[str, float]],
                  records: dict[int, dict[str, Any]], report: dict[str, Any]) -> list[str]:
    """Every figure that differs from its reference: step figures from the run log's record
    of the step shown (to the places shown), live figures from /status's read."""
    faults: list[str] = []

    def differ(source: str, key: str, got: Any, want: Any, places: int | str | None) -> None:
        if got is None and want is None:
            return
        if got is None or want is None:
            faults.append(f"{source} {key}: {got} vs {want}")
        elif places == RATE and float(rate_text(want)) != got:
            faults.append(f"{source} {key}: {got} vs {want} (as rate_text writes it)")
        elif places not in (None, RATE) and round(want, places) != round(got, places):
            faults.append(f"{source} {key}: {got} vs {want} (to {places} places)")
        elif places is None and abs(got - want) > LIVE_TOLERANCE * abs(want) + 0.5:
            faults.append(f"{source} {key}: {got} vs {want} (live)")

    places = {"echo2-hub status": {"admitted/s": RATE, "busy": 2}, "/status": {}, "/metrics": {},
              "dashboard feed": {}}
    by_time = {r["time_s"]: step for step, r in records.items()}  # /metrics has no step gauge
    for source, shown in live.items():
        if shown.get("step") is None:
            shown["step"] = by_time.get(shown.get("time_s"))
        if shown["step"] not in records:
            faults.append(f"{source}: no run log record of its step ({shown.get('time_s')} s)")
            continue
        record = records[shown["step"]]
        for key in ("admitted/s", "busy"):
            differ(source, key, shown[key], from_record(record)[key],
                   places[source].get(key, 9))
        for key in ("gen/s (active)", "required/s", "predicted busy"):
            if shown[key] is not None or source != "echo2-hub status":
                differ(source, key, shown[key], live["/status"][key], None)
        for name, (admitted, gen) in live["/status"]["peers"].items():
            got = shown["peers"].get(name, (None, None))
            differ(source, f"{name} admitted/s", got[0], admitted, None)
            differ(source, f"{name} gen/s", got[1], gen, None)
    for step, line in terminal.items():
        for key, value in line.items():
            differ(f"terminal step {step}", key, value, from_record(records[step])[key],
                   RATE if key == "admitted/s" else 2)
    last = from_record(records[max(records)])
    for key in KEYS[1:]:
        want = last[key]
        differ("report", key, report[key], want, RATE if key in ("admitted/s", "gen/s (active)",
                                                                 "required/s") else 2)
    return faults


def run(max_steps: int, run_dir: Path) -> dict[str, Any]:
    """The demo, sampled while it trains; every surface's figures and what disagrees."""
    port = free_port()
    out = run_dir.with_suffix(".out")
    command = ["echo2-hub", "demo", "--max-steps", str(max_steps), "--run-dir", str(run_dir),
               "--dashboard-port", str(port), "--eval-every", "0"]
    with out.open("w") as stdout:
        demo = subprocess.Popen([HUB, *command[1:]],
                                stdout=stdout, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            while len(terminal_steps(out.read_text().splitlines())) < max_steps // 2:
                if demo.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the demo stopped or stalled:\n{out.read_text()[-2000:]}")
                time.sleep(0.1)  # polling a file another process writes
            samples = [sample(f"http://127.0.0.1:{port}")]
            for _ in range(SAMPLES - 1):  # while the demo serves: it may end meanwhile
                with contextlib.suppress(OSError):
                    samples.append(sample(f"http://127.0.0.1:{port}"))
            if demo.wait(timeout=300) != 0:
                raise RuntimeError(f"the demo failed:\n{out.read_text()[-2000:]}")
        finally:
            if demo.poll() is None:
                demo.kill()
    terminal = terminal_steps(out.read_text().splitlines())
    records = run_log(run_dir)
    report = from_report(report_rows(run_dir), records[max(records)])
    judged = [(disagreements(live, terminal, records, report), live) for live in samples]
    faults, live = next(((f, live) for f, live in judged if not f), judged[-1])
    return {"command": " ".join(command), "live": live, "terminal": terminal,
            "records": records, "report": report, "disagreements": faults}


def table(result: dict[str, Any]) -> str:
    """Source -> figures: the live reads at step K, the terminal and run log at K, the report
    and run log at the last step; then each peer's admitted/s and gen/s while busy."""
    live, records, terminal = result["live"], result["records"], result["terminal"]
    step, last = live["/status"]["step"], max(records)
    rows = [("terminal", {"step": step, **terminal[step]}),
            ("run log", from_record(records[step])), *live.items(),
            ("terminal (last)", {"step": last, **terminal[last]}),
            ("run log (last)", from_record(records[last])), ("report", result["report"])]
    shown = lambda v: "-" if v is None else f"{v:g}" if isinstance(v, int) else f"{v:.3f}"  # noqa: E731
    lines = [f"{'source':<18}" + "".join(f"{k:>16}" for k in KEYS)]
    lines += [f"{name:<18}" + "".join(f"{shown(r.get(k)):>16}" for k in KEYS) for name, r in rows]
    lines.append("")
    lines.append(f"{'peer (live)':<18}" + "".join(f"{s:>22}" for s in live))
    for name in live["/status"]["peers"]:
        lines.append(f"{name:<18}" + "".join(
            f"{'/'.join(shown(v) for v in r['peers'].get(name, (None, None))):>22}"
            for r in live.values()))
    return "\n".join(lines) + "\n(peer cells: admitted/s / gen/s while busy)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.max_steps, Path(tmp) / "run")
    print(result["command"])
    print(table(result))
    for fault in result["disagreements"]:
        print("DISAGREES:", fault)
    print(json.dumps({"bench": "rates_agree", "step": result["live"]["/status"]["step"],
                      "agree": not result["disagreements"],
                      "disagreements": result["disagreements"],
                      "sources": {k: {key: v.get(key) for key in KEYS}
                                  for k, v in result["live"].items()}}))
    return 0 if not result["disagreements"] else 1


if __name__ == "__main__":
    sys.exit(main())
