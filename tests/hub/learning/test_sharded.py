"""The learner on two ranks (FSDP2 over gloo, launched by torchrun): the same weights as one
process, checkpoints across rank counts, a whole run, a rank that dies, and bad launches.

Tolerance of "the same weights": every element within 2e-5 of the single process after 4
steps at lr 1e-3 (2 % of one step; the weights move by 4e-3, the ranks by at most 3e-6 from
it: float sums in another order, which Adam's division by sqrt(v) amplifies where a gradient
is near 0). Step statistics agree to 1e-4 relative (ratio_max reaches 100: exp() magnifies
logprob rounding), greedy completions exactly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.hub.learning import sharded_steps

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
WEIGHT_TOL = 2e-5

pytestmark = pytest.mark.system  # torchrun launches ranks: processes, minutes in all


def on_two_ranks(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "two.pt"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2",
                           str(ROOT / "tests/hub/learning/sharded_steps.py"), str(out), *args],
                          env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def assert_same(a: dict, b: dict) -> None:
    """`b` ended where `a` did, and its steps (the last of `a`'s, if it resumed) agree."""
    assert sorted(a["weights"]) == sorted(b["weights"])
    for name, w in a["weights"].items():
        assert (w - b["weights"][name]).abs().max().item() <= WEIGHT_TOL, name
    for x, y in zip(a["stats"][-len(b["stats"]):], b["stats"], strict=True):
        for k in ("loss", "grad_norm", "clip_frac", "kl", "ratio_mean", "ratio_max", "tokens"):
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-7), k
        tallies = x["off_policy"], y["off_policy"]  # summed over micro-batches and ranks
        assert tallies[0]["versions"] == tallies[1]["versions"]
        assert all(torch.allclose(tallies[0][k], tallies[1][k], rtol=1e-4) for k in ("sums", "maxes"))
    assert a["texts"] == b["texts"]


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The 4 steps on this process, uninterrupted: what every rank count must end at. Made
    once (the steps are seeded, and the tests only read it)."""
    return sharded_steps.run(None)


def test_two_ranks_train_as_one_process(tmp_path, one_process):
    """4 off-policy steps with the ratio clip, KL and gradient clipping active: 2 ranks end
    where one process does."""
    two = on_two_ranks(tmp_path)
    w0 = sharded_steps.initial_weights()
    moved = max((w - w0[name]).abs().max().item() for name, w in one_process["weights"].items())
    assert moved > 100 * WEIGHT_TOL  # the comparison is not between two idle models
    assert all(s["clip_frac"] > 0 and s["grad_norm"] > 0.5 for s in one_process["stats"])
    assert all(s["kl"] > 0 for s in one_process["stats"][1:])
    assert_same(one_process, two)


def test_activation_checkpointing_on_two_ranks_changes_nothing(tmp_path, one_process):
    """Recomputing each layer's activations in the backward (FSDP gathers the layer again)
    gives the same steps."""
    assert_same(one_process, on_two_ranks(tmp_path, "--checkpointing", "on"))


def test_a_checkpoint_resumes_on_another_rank_count(tmp_path, one_process):
    """Saved on 2 ranks, resumed on 1, and the other way round: both end where 4 uninterrupted
    steps do (the AdamW moments and step count came back too)."""
    on_two_ranks(tmp_path, "--save", str(tmp_path / "two-ranks"))
    assert_same(one_process, sharded_steps.run(None, load=str(tmp_path / "two-ranks")))
    sharded_steps.run(None, save=str(tmp_path / "one-rank"))
    assert_same(one_process, on_two_ranks(tmp_path, "--load", str(tmp_path / "one-rank")))


def hub_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "echo2p2p.hub.cli", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_two_rank_demo_learns(tmp_path):
    """`echo2-hub demo --nproc-per-node 2`: hub and peers on rank 0, the learner on both,
    held-out accuracy rising as in the single-process demo."""
    done = subprocess.run(hub_command("demo", "--nproc-per-node", "2", "--peers", "2",
                                      "--max-steps", "20", "--run-dir", str(tmp_path)),
                          env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "learner rank 1 of 2" in done.stderr
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/accuracy"] for r in evals if "eval/accuracy" in r]
    assert len(accuracy) == 3 and accuracy[-1] > accuracy[0] + 0.15, accuracy


def steps_logged(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if "step" in r and "event" not in r]


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_dead_rank_stops_the_run_and_it_resumes_on_one(tmp_path):
    """SIGKILL to rank 1 mid-run: rank 0 says what happened and how to resume; `serve
    --resume` on a single process continues from the checkpoint, no step lost or repeated."""
    port = free_port()
    serve = subprocess.Popen(hub_command("serve", "--nproc-per-node", "2", "--port", str(port),
                                         "--torch-threads", "1", "--run-dir", str(tmp_path)),
                             env=ENV, stderr=subprocess.PIPE, text=True)
    peer = subprocess.Popen([sys.executable, "-m", "echo2p2p.peer.cli", "join",
                             f"ws://127.0.0.1:{port}/ws", "--torch-threads", "1",
                             "--log-level", "warning"], env=ENV)
    try:
        wait_for(lambda: len(steps_logged(tmp_path)) >= 3, 180, "3 steps")
        rank1 = [p for p in _children(serve.pid) if b"RANK=1\0" in _environ(p)]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        _, err = serve.communicate(timeout=60)
    finally:
        serve.kill()
    assert serve.returncode != 0
    # whichever comes first: the collective that fails, or torchrun's SIGTERM
    told = "a learner rank failed" in err or "learner rank 0 stopped by the launcher" in err
    assert told and f"echo2-hub serve --resume {tmp_path}`" in err, err[-3000:]
    before = steps_logged(tmp_path)
    try:
        done = subprocess.run(hub_command("serve", "--resume", str(tmp_path), "--port", str(port),
                                          "--max-steps", str(before[-1]["version"] + 2)),
                              env=ENV, capture_output=True, text=True, timeout=180)
    finally:
        peer.terminate()
        peer.wait()
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resumed = next(r for r in records if r.get("event") == "resume")
    after = steps_logged(tmp_path)[len(before):]
    assert after and after[0]["step"] == resumed["version"] <= before[-1]["version"]
    assert [r["step"] for r in after] == list(range(after[0]["step"], after[-1]["step"] + 1))


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out + [g for c in out for g in _children(c)]


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def bad_launch(env: dict, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(hub_command("serve", "--max-steps", "1", *flags),
                          env={**ENV, **env}, capture_output=True, text=True, timeout=120)


def test_a_rank_count_that_does_not_divide_the_batch_is_refused():
    done = bad_launch({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"})
    assert done.returncode == 1
    assert "prompts_per_step" in done.stderr and "multiple of 3" in done.stderr


def test_a_rank_that_cannot_reach_the_rendezvous_says_so():
    port = free_port()  # nobody listens there
    done = bad_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                      "--learner-timeout-s", "3")
    assert done.returncode == 1
    assert f"could not reach the rendezvous at 127.0.0.1:{port} within 3 s" in done.stderr


def test_ranks_with_different_configs_are_refused_before_training(tmp_path):
    """Two ranks started by hand (as on two nodes) with different --lr: both refuse, naming
    the field, before any step."""
    port = str(free_port())
    ranks = [subprocess.Popen(hub_command("serve", "--lr", lr, "--run-dir", str(tmp_path)),
                              env={**ENV, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                              stderr=subprocess.PIPE, text=True)
             for r, lr in enumerate(("1e-3", "2e-3"))]
    for proc in ranks:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert "'lr'" in err and "rank 0's" in err, err[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()
