"""The vLLM environment the tests drive: `.venv-vllm` (made by `.ci/vllm-env`) or the Python
named by ECHO2_VLLM_PYTHON. Without one the vLLM tests are skipped, except where
ECHO2_REQUIRE_VLLM=1 (set by `.ci/run`): there a missing environment fails them, so CI never
passes by skipping them.

Engine starts are most of these tests' time (30-50 s each on a CPU, mostly torch.compile on one
core). So the engine tests' harness session starts with the first vLLM test and runs in the
background while the peer tests run (the engine tests are moved after them), and every vLLM
process the tests start shares torch.compile's cache (`vllm_env`)."""

from __future__ import annotations

import functools
import getpass
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@functools.cache
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


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of every vLLM process the tests start: offline, a 1 GiB KV cache.
    VLLM_USE_AOT_COMPILE=0 because vLLM 0.32's AOT artifacts never load back on torch 2.13
    ("'function' object has no attribute 'finalize_loading'": every start compiles afresh);
    the engine sets it too (`echo2p2p.policy.vllm_setup`). The compile caches are torch's and
    vLLM's default places, shared by every test and run: a peer would keep them in its (here
    temporary) --model-cache, but this way the built-in and tiny-takeaway compile once (~25 s);
    test_real_peer takes them out (`OWN_CACHE`), to test the peer's own."""
    defaults = {"VLLM_CACHE_ROOT": os.path.expanduser("~/.cache/vllm"),
                "TORCHINDUCTOR_CACHE_DIR": str(Path(tempfile.gettempdir())
                                               / f"torchinductor_{getpass.getuser()}")}
    return {**defaults, **os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONUNBUFFERED": "1", "VLLM_USE_AOT_COMPILE": "0", **extra}


OWN_CACHE = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")  # what a peer sets for itself


class Harness:
    """tests/vllm/harness.py running on one spec under the vLLM environment's Python, in the
    background from its construction on; `wait_record()` waits for its results."""

    def __init__(self, python: Path, spec: dict, workdir: Path, timeout_s: float = 600):
        spec_path, self.out_path = workdir / "spec.json", workdir / "out.json"
        spec_path.write_text(json.dumps(spec))
        self.deadline = time.monotonic() + timeout_s
        self.log_path = workdir / "harness.log"  # a file: no pipe to fill while it runs
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(python), str(HERE / "harness.py"), str(spec_path), str(self.out_path)],
                cwd=workdir, env=vllm_env(PYTHONPATH=str(ROOT)), stdout=log,
                stderr=subprocess.STDOUT)

    def wait_record(self) -> dict:
        """The harness's results, once it has exited. Its log goes to the test's output when it
        fails or runs past its deadline."""
        try:
            code = self.proc.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        if code != 0:
            sys.stderr.write(self.log_path.read_text(errors="replace")[-12000:])
            why = "ran past its deadline" if code is None else f"failed with exit code {code}"
            raise AssertionError(f"the vLLM harness {why}")
        return json.loads(self.out_path.read_text())

    def stop(self) -> None:
        """End the harness if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def engine_session(vllm_py, tmp_path_factory):
    """The engine tests' harness session, started once (`test_engine.start_session`): (the
    running Harness, the hub's model at v0, v1's published state, the spec)."""
    from .test_engine import start_session  # the engine tests' own spec, started from here

    started = start_session(vllm_py, tmp_path_factory.mktemp("vllm"))
    yield started
    started[0].stop()


@pytest.fixture(scope="session", autouse=True)
def engine_session_ahead(request):
    """Starts the engine tests' harness with the first vLLM test where engine tests are to run
    (last, `pytest_collection_modifyitems`): its engine start then overlaps the peer tests'
    on the other core instead of following them."""
    wanted = any("engine_session" in item.fixturenames for item in request.session.items)
    if wanted and vllm_python() is not None:  # else the engine tests skip or fail themselves
        request.getfixturevalue("engine_session")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The vLLM tests that read the engine harness after the other vLLM tests, in the places
    the vLLM tests hold in the run (the order of the rest is kept)."""
    slots = [i for i, item in enumerate(items) if HERE in item.path.parents]
    ours = sorted((items[i] for i in slots),
                  key=lambda item: "engine_session" in item.fixturenames)  # stable
    for i, item in zip(slots, ours):
        items[i] = item
