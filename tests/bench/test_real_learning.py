"""bench/real_learning.py: its statistics (binomial stderr, time to accuracy, the S = 0 / S = 2
ratio), its flags are the hub's own, and (system tier) the whole bench on the tiny model ends
with the JSON line the issue names."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import real_learning as bench
from echo2p2p.hub.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("model", "task", "base_acc", "final_acc", "eval_n", "stderr", "minutes", "steps",
        "trl_final_acc", "sync_vs_async_time_ratio", "mismatch_kl_mean")


def test_binomial_stderr():
    """sqrt(p(1-p)/n): 0.5 on 100 problems is 0.05; 0 and 1 have none; no problems is nan."""
    assert bench.binomial_stderr(0.5, 100) == pytest.approx(0.05)
    assert bench.binomial_stderr(0.3, 200) == pytest.approx(math.sqrt(0.21 / 200))
    assert bench.binomial_stderr(0.0, 50) == 0.0 == bench.binomial_stderr(1.0, 50)
    assert math.isnan(bench.binomial_stderr(0.5, 0))


def test_time_to_accuracy_takes_the_first_evaluation_after_the_base():
    """The base evaluation never counts, even when it is above the target."""
    curve = [(0, 0.0, 0.5), (4, 2.0, 0.3), (8, 4.0, 0.45), (12, 6.0, 0.5)]
    assert bench.time_to_accuracy(curve, 0.45) == 4.0
    assert bench.time_to_accuracy(curve, 0.3) == 2.0
    assert bench.time_to_accuracy(curve, 0.6) is None


def test_sync_vs_async_ratio():
    """Target = the lower final accuracy; ratio = minutes of S = 0 over minutes of S = 2."""
    s0 = [(0, 0.0, 0.30), (4, 4.0, 0.33), (8, 8.0, 0.40)]
    s2 = [(0, 0.0, 0.30), (4, 2.0, 0.36), (8, 4.0, 0.42)]
    assert bench.sync_vs_async(s0, s2) == (0.40, pytest.approx(8.0 / 4.0))
    flat = [(0, 0.0, 0.30), (4, 2.0, 0.30)]
    assert bench.sync_vs_async(flat, s2) == (None, None)  # no gain over the base: no target


def test_mean_of_reads_the_mean_key_not_its_max():
    records = [{"train/mismatch_kl": 0.1, "train/mismatch_kl_max": 9.0},
               {"train/mismatch_kl": 0.3, "train/mismatch_kl_max": 9.0}]
    assert bench.mean_of(records, "mismatch_kl") == pytest.approx(0.2)
    assert bench.mean_of([{"train/loss": 1.0}], "mismatch_kl") is None


def test_hyper_parameters_are_flags_of_the_demo():
    """Every HYPER entry reaches `echo2-hub demo` as the field of the same name, both arms."""
    mode = dict(bench.MODES["quick"])
    for lag in (bench.HYPER["max_lag"], 0):
        flags = bench.hub_flags("tiny", "addition", "", 3, mode, lag)
        args = vars(build_parser().parse_args(["demo", *flags]))
        for key, value in {**bench.HYPER, "max_lag": lag}.items():
            assert float(args[key]) == pytest.approx(float(value)), key
        assert int(args["max_steps"]) == 3 and int(args["eval_problems"]) == mode["eval_n"]


@pytest.mark.system
def test_the_bench_on_the_tiny_model_ends_with_its_json_line(tmp_path):
    """Two steps of each arm (ours S = 2, S = 0, TRL) on the tiny model: one JSON line with
    every key the issue names, curves from the base on, accuracies in [0, 1]."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "bench/real_learning.py", "--quick", "--model", "tiny", "--task",
         "addition", "--steps", "2", "--eval-every", "1", "--eval-n", "8", "--peers", "1",
         "--set", "group_size=2", "--set", "prompts_per_step=2", "--set", "max_new_tokens=8",
         "--set", "lr=1e-3", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout[-2000:]
    result = json.loads(lines[0])
    assert json.loads(out.read_text()) == result
    assert set(KEYS) <= set(result)
    assert result["steps"] == 2 and result["eval_n"] == 8
    for key in ("base_acc", "final_acc", "trl_final_acc"):
        assert 0.0 <= result[key] <= 1.0, key
    for arm in ("curve_s2", "curve_s0", "curve_trl"):
        assert [step for step, _, _ in result[arm]] == [0, 1, 2], arm


def test_the_gpu_script_fails_fast_without_cuda(tmp_path):
    """Without CUDA the GPU bench exits 2 at once, saying it needs a GPU, and writes nothing."""
    if shutil.which("nvidia-smi"):
        pytest.skip("an NVIDIA driver is here: the script would run the bench")
    done = subprocess.run(["bash", "bench/gpu_real_learning.sh", str(tmp_path / "out.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 2 and "needs a GPU" in done.stderr
    assert not (tmp_path / "out.json").exists()


def test_plot_draws_the_three_arms(tmp_path):
    """The full mode's figure is written from the JSON line's curves."""
    pytest.importorskip("matplotlib")
    out = {"model": "m", "task": "t", "eval_n": 8, "curve_s2": [(0, 0.0, 0.2), (4, 1.0, 0.4)],
           "curve_s0": [(0, 0.0, 0.2), (4, 2.0, 0.35)], "curve_trl": [(0, 0.0, 0.2), (4, 3.0, 0.3)]}
    bench.plot(out, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000
