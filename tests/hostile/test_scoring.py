"""A verifier bomb (issue 11, item 7): on the math task with math-verify installed, a completion
whose token ids decode to \\boxed{9^{99999999999}} keeps `verify` running for minutes against an
expression answer (against a number the math reward wants one number and never calls
math-verify, issue 42). The hub must score off its event loop, in a process it can kill, under a
deadline: that completion scores 0, the timeout is counted, and heartbeats, leases and the
honest peer go on meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from echo2p2p.messages import pack_ids, pack_logprobs

from .attackers import raw_peer
from .conftest import yes
from .harness import hub_alive, hub_and_honest_peer, mark, small_cfg, still_training

BOMB = r"\boxed{9^{99999999999}}"
HALF = r"\frac{1}{2}"
RIGHT = rf"\boxed{{{HALF}}}"
SCORE_DEADLINE_S = 1.0


class LoopLag:
    """The worst delay of a 50 ms timer on the event loop: a figure, never an assertion."""

    def __init__(self) -> None:
        self.worst_s = 0.0

    async def watch(self, period_s: float = 0.05) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(period_s)  # the sampling period, not a sync
            self.worst_s = max(self.worst_s, time.perf_counter() - start - period_s)


# Before the fix the bomb froze the one event loop this test shares with the hub for good:
# pytest-timeout's SIGALRM is then the way out (checked: it fails the test at the deadline).
@pytest.mark.timeout(120)
async def test_verifier_bomb_scores_zero_and_freezes_nothing(tmp_path, row):
    """A verifier bomb scores 0 at the scoring deadline, counted; nothing else is frozen."""
    r = row(r"7. verifier bomb: token ids decoding to \boxed{9^{99999999999}} (math task)")
    task = tmp_path / "half.jsonl"
    rows = ({"question": f"Problem {i}: what is 1 / 2?", "answer": HALF} for i in range(40))
    task.write_text("".join(json.dumps(q) + "\n" for q in rows))
    cfg = small_cfg(tmp_path, task=str(task), max_new_tokens=len(BOMB) + 2,
                    spot_check_fraction=0.0, score_timeout_s=SCORE_DEADLINE_S)
    lag = LoopLag()
    async with hub_and_honest_peer(cfg) as (run, honest), \
            raw_peer(run.url, keep_alive=True) as bomber, asyncio.TaskGroup() as tg:
        watcher = tg.create_task(lag.watch())
        welcome = await bomber.hello(name="bomber", engine="transformers")
        assert welcome is not None, bomber.reaction()
        await bomber.send("lease_request", n=1)
        lease = await bomber.wait_frame(lambda f: f["t"] == "lease")
        version = max(f["manifest"]["version"] for f in bomber.frames if f["t"] == "version")
        tok = run.tokenizer
        samples = []
        for text in [BOMB] + [RIGHT] * (lease["group_size"] - 1):
            # EOS kept, as engines keep it. Reward 1.0 claimed for all: a claim above the
            # hub's score counts against the peer, which is how this test sees the bomb's 0.
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            samples.append({"token_ids": pack_ids(ids), "text": text, "reward": 1.0,
                            "logprobs": pack_logprobs([-1.0] * len(ids)), "finish_reason": "stop"})
        timeouts_before = run.hub.statistics().scoring.timeouts
        since = mark(run, honest)
        await bomber.send("rollout", lease_id=lease["lease_id"], version=version, samples=samples)
        answer = await bomber.wait_frame(
            lambda f: f["t"] in ("ack", "reject") and f["lease_id"] == lease["lease_id"])
        r.honest_training = await still_training(run, honest, since)
        watcher.cancel()
        stats = run.hub.statistics().scoring
        events = run.hub.statistics().trust_events.get(bomber.peer_id, {})
        verdict = " ".join([answer["t"], answer.get("reason", "")]).strip()
        r.reaction = (f"rollout {verdict}; scorer timeouts "
                      f"+{stats.timeouts - timeouts_before}, worker restarts {stats.restarts}; "
                      f"bomber reward_mismatch x{events.get('reward_mismatch', 0)}")
        r.hub_alive = yes(alive := await hub_alive(run))
        r.note = f"deadline {SCORE_DEADLINE_S:.0f} s; worst loop lag {lag.worst_s * 1e3:.0f} ms"
    assert alive
    assert stats.timeouts > timeouts_before, "no scoring timeout was counted"
    # Scored 0 (so its claim of 1.0 is a lie), or its group refused unscored: one sample that
    # burns the deadline puts its peer past the per-sample scoring budget (issue 28, R3-4).
    assert events.get("reward_mismatch", 0) >= 1 or answer.get("reason") == "scoring_budget", \
        f"the bomb did not score below 1: {events}, {answer}"
