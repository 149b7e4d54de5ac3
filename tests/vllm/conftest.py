"""The vLLM environment the tests drive: `.venv-vllm` (made by `.ci/vllm-env`) or the Python
named by ECHO2_VLLM_PYTHON. Without one the vLLM tests are skipped, except where
ECHO2_REQUIRE_VLLM=1 (set by `.ci/run`): there a missing environment fails them, so CI never
passes by skipping them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> Path | None:
    """The vLLM environment's interpreter, if there is one with vLLM and echo2p2p importable."""
    named = os.environ.get("ECHO2_VLLM_PYTHON")
    path = Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"
    if not path.is_file():
        return None
    probe = subprocess.run([str(path), "-c", "import vllm, echo2p2p"], capture_output=True)
    return path if probe.returncode == 0 else None


@pytest.fixture(scope="session")
def vllm_py() -> Path:
    path = vllm_python()
    if path is None:
        why = "no vLLM environment: run .ci/vllm-env (or set ECHO2_VLLM_PYTHON)"
        if os.environ.get("ECHO2_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return path


def run_harness(python: Path, spec: dict, workdir: Path, timeout_s: float = 600) -> dict:
    """Run tests/vllm/harness.py on `spec` under `python`; its results. Its log goes to the test's
    output when it fails."""
    spec_path, out_path = workdir / "spec.json", workdir / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(python), str(ROOT / "tests" / "vllm" / "harness.py"),
                           str(spec_path), str(out_path)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise AssertionError(f"the vLLM harness failed with exit code {done.returncode}")
    return json.loads(out_path.read_text())
