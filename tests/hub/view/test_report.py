"""`echo2-hub report RUN_DIR`: the figures of a real run as PNGs and one self-contained page;
a malformed run log line is skipped and counted, a run log without a step is an error."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from echo2p2p.hub import cli
from echo2p2p.hub.run.start import start_hub

from tests.conftest import running_peers

FIGURES = ("reward", "staleness", "utilization", "propagation", "cost")


def report(*args: str) -> subprocess.CompletedProcess:
    """The real CLI, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "echo2p2p.hub.cli", "report", *args],
                          capture_output=True, text=True, timeout=120)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's signature and IHDR chunk; AssertionError if it is none."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.timeout(120)
async def test_the_report_of_a_real_run_draws_every_figure_into_one_page(hub_cfg, tmp_path):
    """12 steps of a real hub and two paid peers, evaluated every 4: every PNG is a real
    picture, report.html carries each of them inline, names the run and sums it up."""
    cfg = hub_cfg.replace(max_steps=12, eval_every=4, eval_problems=8, dashboard_port=-1)
    async with start_hub(cfg, stream=None) as run:
        async with running_peers(run.url, 2, price_per_hour=3.6):
            await run.finished.wait()
    done = report(cfg.run.run_dir, "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "out" / "report.html").read_text()
    for name in FIGURES:
        png = (tmp_path / "out" / f"{name}.png").read_bytes()
        width, height = png_size(png)
        assert 800 <= width <= 2000 and 300 <= height <= 1000 and 10_000 < len(png) < 1_000_000
        assert f"data:image/png;base64,{base64.b64encode(png).decode()}" in page
        assert str(tmp_path / "out" / f"{name}.png") in done.stdout
    assert f"echo2p2p run {run.hub.core.run_id}</title>" in page
    assert "<th>steps</th><td>12 (last version 12)</td>" in page
    best = max(r["eval/accuracy"] for r in run.records if "eval/accuracy" in r)
    assert f"<th>best held-out accuracy</th><td>{best:.3f}" in page
    assert "src=\"http" not in page and "<script" not in page  # self-contained, nothing to load


def step_record(step: int, **values) -> dict:
    """A step record of the run log's shape, with the keys the report reads."""
    return {"step": step, "version": step + 1, "time_s": 0.5 * (step + 1),
            "train/reward_mean": 0.1 * step, "rollout/staleness_hist": {"0": 3, "1": 1},
            "rollout/per_s": 40.0, "hub/learner_busy_frac": 0.5,
            "capacity/predicted_busy_frac": 0.6, "cost/usd_total": 0.01 * step,
            "cost/usd_per_hour": 3.6, "rollout/stale_on_arrival_total": step, **values}


def write_run(run_dir: Path, lines: list[str]) -> Path:
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"run_id": "handmade", "max_lag": 1}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_malformed_lines_are_skipped_counted_and_noted(tmp_path, capsys):
    """A cut line and a JSON array are skipped, counted on stderr and in the page; a value
    that is not a number (a string, NaN) is left out of its figure, not a crash."""
    lines = [json.dumps(step_record(0)), '{"step": 1, "version": 2, "train/rew', "[1, 2]",
             json.dumps(step_record(1, **{"train/reward_mean": "high"})),
             json.dumps(step_record(2)).replace('"hub/learner_busy_frac": 0.5',
                                                '"hub/learner_busy_frac": NaN'),
             json.dumps({"event": "eval", "version": 0, "eval/accuracy": 0.25})]
    run_dir = write_run(tmp_path / "run", lines)
    assert cli.main(["report", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert "skipped 2 malformed line(s)" in err and "the first: line 2" in err
    page = (run_dir / "report" / "report.html").read_text()
    assert "2 malformed line(s) of metrics.jsonl skipped" in page
    assert "<th>steps</th><td>3 (last version 3)</td>" in page
    assert "<th>best held-out accuracy</th><td>0.250 (v0)</td>" in page
    assert all(png_size((run_dir / "report" / f"{n}.png").read_bytes()) for n in FIGURES)


@pytest.mark.parametrize("lines", [
    [json.dumps({"event": "eval", "version": 0, "eval/accuracy": 0.2}), "not json"], None],
    ids=["events only", "no run log"])
def test_a_run_dir_without_steps_is_an_error_naming_the_file(tmp_path, lines, capsys):
    """Nothing to draw: exit 1 and one line naming metrics.jsonl; nothing is written."""
    run_dir = write_run(tmp_path / "run", lines) if lines else tmp_path / "empty"
    assert cli.main(["report", str(run_dir)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and str(run_dir / "metrics.jsonl") in err
    assert not (run_dir / "report").exists()


def test_without_matplotlib_it_says_which_extra_to_install(tmp_path, monkeypatch, capsys):
    """matplotlib is an optional extra: without it the command names the pip install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    run_dir = write_run(tmp_path / "run", [json.dumps(step_record(0))])
    assert cli.main(["report", str(run_dir)]) == 1
    assert "pip install 'echo2p2p[report]'" in capsys.readouterr().err


def test_a_resumed_run_counts_each_step_once_and_all_its_time(tmp_path, capsys):
    """Steps logged again after a resume replace the first ones; the wall time adds up both
    processes' learner loops (each record's time_s restarts with its process)."""
    first = [step_record(i) for i in range(3)]  # time_s 0.5, 1.0, 1.5
    again = [step_record(i, time_s=60.0 * (i - 2)) for i in range(2, 5)]  # 0, 60, 120 s
    lines = [json.dumps(r) for r in first] + [json.dumps({"event": "resume", "version": 2})]
    run_dir = write_run(tmp_path / "run", lines + [json.dumps(r) for r in again])
    assert cli.main(["report", str(run_dir)]) == 0
    page = (run_dir / "report" / "report.html").read_text()
    assert "<th>steps</th><td>5 (last version 5)</td>" in page
    assert "<th>wall time (learner loop)</th><td>2.0 min</td>" in page  # (1.5 + 120) s
