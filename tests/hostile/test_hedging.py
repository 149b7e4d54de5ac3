"""Rewards that pay for hedging (issue 42, item 7). reasoning-gym's decimal scorer gave
`len(gold) / len(answer)` when the gold was inside the answer (on rg:chain_sum, the smollm2
preset's task: the gold with a digit appended 0.655, `<answer>g g+1</answer>` 0.389, digit soup
up to 0.2, a wrong answer 0), and math-verify credited "84 + 80 = 84 + 80" against 164: a policy
could learn to hedge, or to echo the question. A raw peer sends such completions through the
wire, beside the exact answer, and the hub's admitted rewards for them must be 0.

Nothing trains here (no honest peer: the hub needs 4 groups a step), so the attacker's
admitted group stays in the learner's queue, where its rewards are read.
"""

from __future__ import annotations

import json

import pytest

from echo2p2p.hub.run.start import start_hub
from echo2p2p.messages import pack_ids, pack_logprobs

from .attackers import raw_peer
from .conftest import yes
from .harness import hub_alive, small_cfg

PRESET_SUMS = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
GROUP = 8
MAX_NEW_TOKENS = 64


def rg_hedges(gold: str) -> list[str]:
    """The exact answer, then seven completions that hedge around it (numeric `gold`)."""
    n = int(gold)
    return [gold, f"{gold}7", f"<answer>{gold} {n + 1}</answer>", f"{n + 1} or {gold}",
            f"{n - 1} {gold} {n + 1}", "0123456789", f"\\boxed{{{n + 1}}} \\boxed{{{gold}}}",
            f"The answer is {gold}, or maybe {n + 1}"]


def echoes(question: str, gold: str) -> list[str]:
    """The answer worked and boxed, then six that echo the question or hedge."""
    n = int(gold)
    return [f"{question} = {gold}", f"\\boxed{{{gold}}}", f"{question} = {question}", question,
            f"\\boxed{{{question}}}", f"{question} = \\boxed{{{question}}}",
            f"{gold} or {n + 1}", f"{n - 1} {gold} {n + 1}"]


async def admitted_rewards(run, make_texts) -> tuple[list[str], list[float], dict]:
    """One lease answered by a raw peer with `make_texts(lease)` (claiming 0.0 for each: a claim
    below the hub's score costs nothing); the texts and the rewards the hub admitted them with,
    and the hub's answer to the rollout."""
    async with raw_peer(run.url, keep_alive=True) as attacker:
        welcome = await attacker.hello(name="hedger", engine="transformers")
        assert welcome is not None, attacker.reaction()
        await attacker.send("lease_request", n=1)
        lease = await attacker.wait_frame(lambda f: f["t"] == "lease")
        assert lease["group_size"] == GROUP
        version = max(f["manifest"]["version"] for f in attacker.frames if f["t"] == "version")
        texts, tok, samples = make_texts(lease), run.tokenizer, []
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            samples.append({"token_ids": pack_ids(ids), "text": text, "reward": 0.0,
                            "logprobs": pack_logprobs([-1.0] * len(ids)),
                            "finish_reason": "stop"})
        await attacker.send("rollout", lease_id=lease["lease_id"], version=version,
                            samples=samples)
        answer = await attacker.wait_frame(
            lambda f: f["t"] in ("ack", "reject") and f["lease_id"] == lease["lease_id"])
    queued = [g for g in run.hub.statistics().queue if g.lease_id == lease["lease_id"]]
    return texts, (list(queued[0].rewards) if queued else []), answer


def paid(texts: list[str], rewards: list[float]) -> str:
    """The table's account: what each hedge was paid."""
    return ", ".join(f"{t!r} {r:.3g}" for t, r in zip(texts, rewards))


@pytest.mark.timeout(180)
async def test_rg_hedges_earn_nothing(tmp_path, row):
    """On rg:chain_sum (the preset's task and difficulty) the exact answer scores 1 and every
    hedge of it 0 in the group the hub admits."""
    pytest.importorskip("reasoning_gym")
    r = row("42-7a. rg hedges: gold + digit, two or three answers, digit soup, disagreeing "
            "boxes (rg:chain_sum)")
    cfg = small_cfg(tmp_path, task="rg:chain_sum", task_args=PRESET_SUMS, group_size=GROUP,
                    max_new_tokens=MAX_NEW_TOKENS, spot_check_fraction=0.0, eval_problems=8)
    async with start_hub(cfg, stream=None) as run:
        texts, rewards, answer = await admitted_rewards(
            run, lambda lease: rg_hedges(lease["answer"]))
        r.reaction = f"rollout {answer['t']}; admitted rewards: {paid(texts, rewards)}"
        r.hub_alive = yes(alive := await hub_alive(run))
        r.honest_training = "- (no honest peer: the group stays queued to be read)"
        r.note = "hedges scored by the generator's full credit or nothing"
    assert alive and answer["t"] == "ack", answer
    assert rewards == [1.0] + [0.0] * (GROUP - 1), paid(texts, rewards)


@pytest.mark.timeout(180)
async def test_echoed_sums_earn_nothing(tmp_path, row):
    """On a math task of two-digit sums, the answer worked or boxed scores 1; the question
    echoed back (which math-verify evaluates to the gold) and hedges score 0."""
    pytest.importorskip("math_verify")
    r = row("42-7b. echoed sums: '84 + 80 = 84 + 80' and hedges against 164 (math task)")
    sums = [(a, b) for a in range(11, 99, 7) for b in range(13, 99, 9)]
    task = tmp_path / "sums.jsonl"
    task.write_text("".join(json.dumps({"question": f"{a} + {b}", "answer": str(a + b)}) + "\n"
                            for a, b in sums))
    cfg = small_cfg(tmp_path, task=str(task), group_size=GROUP, max_new_tokens=MAX_NEW_TOKENS,
                    spot_check_fraction=0.0)
    async with start_hub(cfg, stream=None) as run:
        texts, rewards, answer = await admitted_rewards(
            run, lambda lease: echoes(lease["prompt"].splitlines()[0], lease["answer"]))
        r.reaction = f"rollout {answer['t']}; admitted rewards: {paid(texts, rewards)}"
        r.hub_alive = yes(alive := await hub_alive(run))
        r.honest_training = "- (no honest peer: the group stays queued to be read)"
        r.note = "the final answer committed to: one number against a numeric gold"
    assert alive and answer["t"] == "ack", answer
    assert rewards == [1.0, 1.0] + [0.0] * (GROUP - 2), paid(texts, rewards)
