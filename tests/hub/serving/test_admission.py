"""The hub scores what it trains on: each sample's token ids, decoded as the engines decode."""

from __future__ import annotations

import asyncio

import json

import aiohttp
import pytest

from echo2p2p import messages as m
from echo2p2p.completions import CompletionDecoder
from echo2p2p.session import Session, Side
from echo2p2p.tasks import MathTask, addition_reward
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.serving.app import serve
from echo2p2p.hub.serving.server import Hub, TokenizedProblem
from echo2p2p.hub.run.start import start_hub
from echo2p2p.policy.engines import TransformersEngine
from echo2p2p.policy.model import build_char_tokenizer

from tests.conftest import running_peers, tracker

TOK = build_char_tokenizer()


def completion(text: str, claimed: str, reward: float = 0.0) -> m.Sample:
    """A sample whose ids spell `text` (then EOS) and which claims to say `claimed`."""
    ids = TOK.encode(text, add_special_tokens=False) + [TOK.eos_token_id]
    return m.Sample(m.pack_ids(ids), m.pack_logprobs([-1.0] * len(ids)), claimed, reward, "stop")


async def answer_one_lease(url: str, make_samples,
                           meanwhile=None) -> tuple[m.Message, m.LeaseGrant]:
    """Join `url` raw, take one lease, answer it with `make_samples(lease, group_size)`; await
    `meanwhile()`, if given, after submitting and before reading the answer."""
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        s = Session(Side.PEER, 0.0)
        await ws.send_bytes(s.send(m.Hello("liar", "transformers", "cpu")))
        welcome = s.receive((await ws.receive()).data, 0.0)
        await ws.send_bytes(s.send(m.LeaseRequest(1)))
        while not isinstance(lease := s.receive((await ws.receive()).data, 0.0), m.LeaseGrant):
            pass
        samples = make_samples(lease, welcome.group_size)
        await ws.send_bytes(s.send(m.RolloutSubmission(lease.lease_id, 0, samples)))
        if meanwhile is not None:
            await meanwhile()
        while not isinstance(reply := s.receive((await ws.receive()).data, 0.0), (m.Ack, m.Reject)):
            pass
        return reply, lease


async def welcomed(url: str) -> m.Welcome:
    """A second peer's hello, answered: the hub's event loop is serving."""
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        s = Session(Side.PEER, 0.0)
        await ws.send_bytes(s.send(m.Hello("bystander", "transformers", "cpu")))
        return s.receive((await ws.receive()).data, 0.0)


async def test_texts_that_lie_about_their_ids_are_scored_from_the_ids():
    """A right answer labelled wrong scores 1, a wrong one labelled right 0: the admitted
    group carries the rewards of the decoded ids, and one text_mismatch counts against the peer."""
    def lies(lease: m.LeaseGrant, g: int) -> list[m.Sample]:
        wrong = str(int(lease.answer) + 1)
        return ([completion(lease.answer, claimed=wrong), completion(wrong, claimed=lease.answer)]
                + [completion(lease.answer, lease.answer, 1.0)] * (g - 2))

    async with tracker() as (hub, _key, url, _records):
        reply, lease = await answer_one_lease(url, lies)
        (group,) = hub.statistics().queue
    assert reply == m.Ack(lease.lease_id)
    decoded = [CompletionDecoder(TOK).from_wire(s.packed_ids).text for s in group.samples]
    assert group.rewards == [addition_reward(lease.answer, t) for t in decoded]
    assert group.rewards[:2] == [1.0, 0.0]
    (events,) = hub.statistics().trust_events.values()
    assert events["text_mismatch"] == 1 and events["reward_mismatch"] == 0


async def test_ids_no_engine_emits_are_refused_before_decoding():
    """Out-of-vocabulary ids, and ids after the EOS, get Reject "bad_tokens"; nothing is
    admitted, the prompt goes back, and the hub serves on."""
    def out_of_vocab(lease: m.LeaseGrant, g: int) -> list[m.Sample]:
        bad = m.Sample(m.pack_ids([5, 2**32 - 1]), m.pack_logprobs([-1.0, -1.0]), "", 0.0, "length")
        return [bad] + [completion(lease.answer, lease.answer, 1.0)] * (g - 1)

    def after_eos(lease: m.LeaseGrant, g: int) -> list[m.Sample]:
        eos = TOK.eos_token_id
        ids = TOK.encode(lease.answer, add_special_tokens=False) + [eos, 20, 21]
        hidden = m.Sample(m.pack_ids(ids), m.pack_logprobs([-1.0] * len(ids)), lease.answer,
                          1.0, "stop")
        return [hidden] + [completion(lease.answer, lease.answer, 1.0)] * (g - 1)

    async with tracker() as (hub, _key, url, _records):
        replies = [(await answer_one_lease(url, make))[0] for make in (out_of_vocab, after_eos)]
        assert [r.reason for r in replies] == ["bad_tokens", "bad_tokens"]
        stats = hub.statistics()
        assert stats.admitted_groups == 0 and not stats.queue and stats.requeued_leases == 2


def test_the_engines_texts_are_the_hubs_decoding():
    """Every completion the honest engine samples, stopped or capped, has the text the hub
    decodes from its ids."""
    engine = TransformersEngine("tiny")
    decode = CompletionDecoder(engine.tokenizer)
    prompt = engine.tokenizer.encode("12+34=", add_special_tokens=False)
    out = engine.generate(prompt, 32, temperature=1.5, top_p=1.0, max_new_tokens=6, seed=3)
    assert {c.finish_reason for c in out} == {"stop", "length"}
    assert all(decode.from_wire(m.pack_ids(c.token_ids)).text == c.text for c in out)


async def test_an_honest_peer_never_mismatches(hub_cfg):
    """A real hub and a real honest peer for a few steps: no text_mismatch, no lie of any kind."""
    async with start_hub(hub_cfg.replace(max_steps=3)) as run:
        async with running_peers(run.url, 1):  # a lie stalls training: stop waiting at once
            await asyncio.wait_for(run.hub.until(
                lambda: run.finished.is_set() or run.hub.statistics().trust_events), 120)
    assert run.hub.statistics().trust_events == {}
    assert run.hub.statistics().admitted_groups >= 3 * hub_cfg.grpo.prompts_per_step


@pytest.mark.timeout(120)
async def test_a_verifier_that_never_returns_does_not_stall_the_hub():
    """A math completion that hangs math-verify: while it is scored (nothing admitted yet) the
    hub welcomes a new peer; at the deadline it scores 0, the rest of its group is scored
    right, and the timeout is counted."""
    pytest.importorskip("math_verify")
    # expression answers: against a number the math reward never calls math-verify
    lines = [json.dumps({"question": f"1 / {i}", "answer": f"\\frac{{1}}{{{i}}}"})
             for i in range(2, 6)]
    task = MathTask.from_lines(lines, eval_size=1)
    cfg = HubConfig.from_flat(port=0, group_size=4, max_new_tokens=64, score_timeout_s=10.0)
    problems = [TokenizedProblem(p, [1]) for p in task.problems("train")]
    hub = Hub(cfg, "run", task, problems, decode=CompletionDecoder(TOK))
    bystander: list[tuple[m.Message, int]] = []  # (its welcome, groups admitted by then)

    def bombed(lease: m.LeaseGrant, g: int) -> list[m.Sample]:
        right = rf"\boxed{{{lease.answer}}}"
        return ([completion(r"\boxed{9^{99999999999}}", r"\boxed{9^{99999999999}}")]
                + [completion(right, right, 1.0)] * (g - 1))

    async def meet_a_bystander() -> None:
        bystander.append((await welcomed(url), hub.statistics().admitted_groups))

    async with serve(hub, "127.0.0.1", 0) as port:
        url = f"ws://127.0.0.1:{port}/ws"
        reply, lease = await answer_one_lease(url, bombed, meanwhile=meet_a_bystander)
        (group,) = hub.statistics().queue
    ((welcome, admitted_by_then),) = bystander
    assert isinstance(welcome, m.Welcome) and admitted_by_then == 0
    assert reply == m.Ack(lease.lease_id)
    assert group.rewards == [0.0, 1.0, 1.0, 1.0]
    assert hub.statistics().scoring.timeouts == 1


def test_a_reward_that_runs_programs_holds_the_answers():
    """The code reward, by name or as the function, makes the hub hold its answers; others not."""
    from echo2p2p.scoring.code import code_tests
    from echo2p2p.scoring.rewards import RewardFunctions, exact_match, load_reward

    from echo2p2p.hub.tasks.task_setup import TaskSetup

    def setup(*funcs):
        return TaskSetup(task=None, reward=RewardFunctions(list(funcs)), kind="custom")

    assert setup(load_reward("code_tests")).runs_programs
    assert setup(exact_match, code_tests).runs_programs
    assert not setup(exact_match).runs_programs
