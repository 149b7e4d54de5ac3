"""bench/gpu_check.sh, the GPU check prepared for a lent CUDA machine: without CUDA it stops at
once with a sentence (code 2) and writes nothing; a driver without a CUDA torch is named too.
Its run on a GPU is bench/real_engines.py's, whose table is checked here on plain values."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import real_engines  # noqa: E402


def run_check(tmp_path: Path, path: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/gpu_check.sh", str(tmp_path / "out.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": path, "PYTHON": sys.executable})


def test_without_a_gpu_it_exits_at_once_saying_why(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("an NVIDIA driver is here: the script would run the check")
    done = run_check(tmp_path, "/usr/bin:/bin")
    assert done.returncode == 2 and "no NVIDIA GPU here" in done.stderr, done.stderr
    assert "needs a CUDA GPU" in done.stderr and not (tmp_path / "out.json").exists()


def test_a_driver_without_a_cuda_torch_is_named(tmp_path):
    """A stand-in nvidia-smi: the check goes on to the interpreter, which has no CUDA here."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
    (fake / "nvidia-smi").chmod(0o755)
    done = run_check(tmp_path, f"{fake}:/usr/bin:/bin")
    assert done.returncode == 2 and f"{sys.executable} has no CUDA torch" in done.stderr, \
        done.stderr
    assert not (tmp_path / "out.json").exists()


def test_the_table_puts_the_engines_side_by_side():
    """A figure not measured (no probe on the GPU check) is a dash, not an error."""
    text = real_engines.table({
        "vllm": {"run": {"engine_start_s": 41.0, "swap_s_median": 0.8, "curve": "0.14 -> 0.30"},
                 "probe": None},
        "transformers": {"run": {"engine_start_s": 6.0}, "probe": {"rollouts_per_s_per_core": 1.5}}})
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in text.splitlines()}
    assert rows["engine start, first (cold cache) s"] == ["41.0", "6.0 |"]
    assert rows["rollouts/s per core (probe)"] == ["-", "1.5 |"]
    assert rows["held-out accuracy (base -> end)"][0] == "0.14 -> 0.30"
