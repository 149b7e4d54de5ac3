"""A vLLM peer process for real: it joins a hub from another directory, builds its engine from
the hub's signed model files alone (a local lab model it never sees), loads every version in
place while generation goes on, and the hub's own recompute of every rollout agrees."""

from __future__ import annotations

import asyncio

import pytest

from echo2p2p.hub.run.start import start_hub
from tests.conftest import wait_first
from tests.peer.test_model_from_hub import make_lab_model

from .conftest import vllm_env

pytestmark = pytest.mark.vllm

STEPS = 4


async def vllm_peer_until_done(vllm_py, run, log_path, cwd=None, extra=()) -> str:
    """A vLLM peer process joined to `run` until the run finishes (or the peer exits); its log."""
    with open(log_path, "wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            str(vllm_py), "-m", "echo2p2p.peer.cli", "join", run.url, "--name", "vllm-peer",
            "--engine", "vllm", "--device", "cpu", "--listen", "", "--log-level", "info", *extra,
            cwd=cwd, env=vllm_env(), stdout=log_file, stderr=log_file)
    try:
        await wait_first(run.finished.wait(), proc.wait(), timeout_s=600)
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()
    return log_path.read_text(errors="replace")


async def test_a_vllm_peer_trains_a_lab_model_it_never_sees(vllm_py, hub_cfg, tmp_path,
                                                            monkeypatch):
    """Every admitted group is spot-checked under the version it claims with a tolerance of
    1e-3 nats (an fp32 vLLM agrees to ~1e-6; a group made with the version before its tag
    differs by a median 8e-3 on the built-in model, hub/learning/spotcheck.py): so each rollout carries the version that made it, also those whose
    generation was in flight when a new version arrived (the swap waits for it, and the
    generation finishes on the old version). The peer swapped versions in place several times."""
    make_lab_model(tmp_path / "lab" / "finetune")
    monkeypatch.chdir(tmp_path / "lab")
    volunteer = tmp_path / "volunteer"
    volunteer.mkdir()
    log_path = tmp_path / "peer.log"
    cfg = hub_cfg.replace(model="finetune", max_steps=STEPS, spot_check_fraction=1.0,
                  spot_check_tolerance=1e-3, lr=3e-3)
    async with start_hub(cfg, stream=None) as run:
        log = await vllm_peer_until_done(vllm_py, run, log_path, cwd=volunteer,
                                         extra=("--model-cache", str(tmp_path / "cache")))
        c = run.hub.statistics()
        assert run.finished.is_set(), log[-4000:]
        steps = [r for r in run.records if "rollout/staleness_hist" in r]
    assert len(steps) == STEPS
    # Every admitted group was checked first (fraction 1); a check may finish before its
    # admission is counted, so the two can differ by the groups being judged when we look.
    assert c.spot_failed == 0 and c.spot_checked >= c.admitted_groups >= STEPS * 4, vars(c)
    used = {r["step"] - int(lag) for r in steps for lag in r["rollout/staleness_hist"]}
    assert len(used) >= 2, used  # rollouts of several versions: the peer swapped in place
    assert "fetched from the hub" in log and "vllm" in log.lower()


def test_a_missing_vllm_is_one_sentence_at_start_up(capsys):
    """Where vLLM is not installed (the test process's own Python), `--engine vllm` stops the
    peer before it connects, naming the flag and the fix; the demo names a missing --peer-python."""
    import importlib.util

    from echo2p2p.hub.cli import main as hub_main
    from echo2p2p.peer.cli import main as peer_main

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this Python")
    assert peer_main(["join", "127.0.0.1:9", "--engine", "vllm"]) == 1
    err = capsys.readouterr().err
    assert "'engine'" in err and ".ci/vllm-env" in err and "Traceback" not in err
    assert hub_main(["demo", "--engine", "vllm", "--peer-python", "/no/python"]) == 1
    assert "no such file: /no/python" in capsys.readouterr().err


async def test_a_vllm_peer_plays_multi_turn_episodes_the_hub_replays(vllm_py, hub_cfg, tmp_path):
    """The built-in environment on a vLLM peer: every episode's turns are sampled by vLLM,
    replayed by the hub (none refused) and spot-checked under its tag at 1e-3 nats (model
    tokens only: observation tokens carry no logprob)."""
    cfg = hub_cfg.replace(env="takeaway", model="tiny-takeaway", max_new_tokens=4,
                  max_steps=2, spot_check_fraction=1.0, spot_check_tolerance=1e-3)
    log_path = tmp_path / "peer.log"
    async with start_hub(cfg, stream=None) as run:
        log = await vllm_peer_until_done(vllm_py, run, log_path)
        c = run.hub.statistics()
        assert run.finished.is_set(), log[-4000:]
    assert c.rejected == 0 and c.spot_failed == 0, vars(c)
    assert c.spot_checked >= c.admitted_groups >= 2 * cfg.grpo.prompts_per_step, vars(c)
    assert sum(run.hub.statistics().trust_events.get(i, {}).get("observation_mismatch", 0)
               for i in run.hub.statistics().trust_events) == 0
