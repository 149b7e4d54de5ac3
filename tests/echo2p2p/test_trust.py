"""Trust: scores and sticky quarantine (pure), and a reward forger quarantined by a live hub."""

from __future__ import annotations

import aiohttp
import pytest

from echo2p2p import messages as m
from echo2p2p.session import Session, Side
from echo2p2p.trust import TrustBook, TrustPolicy, check_fraction

from tests.conftest import tracker


def test_penalties_quarantine_below_the_threshold_and_for_good():
    """Penalties add up to quarantine below the threshold; checked rollouts earn a little back,
    capped at 1; quarantine is for good."""
    book = TrustBook(TrustPolicy(threshold=0.5))
    assert not book.record("a", "reward_mismatch")  # 0.8
    assert not book.record("a", "text_mismatch")  # 0.6
    for _ in range(30):
        book.good("a")
    assert book.score("a") == pytest.approx(0.9)  # credit 0.01 each, capped at 1
    assert not book.record("a", "logprob_mismatch")  # 0.6
    assert book.record("a", "logprob_mismatch")  # 0.3: quarantined now
    assert not book.record("a", "false_report")  # already quarantined
    for _ in range(200):
        book.good("a")
    assert book.quarantined == {"a"} and book.score("a") < 0.5  # no way back
    assert book.score("b") == 1.0 and book.events["a"]["logprob_mismatch"] == 2
    assert book.record("c", "bad_chunk")  # the hub's own proof of a corrupt chunk: at once
    with pytest.raises(ValueError, match="unknown trust event"):
        book.record("a", "rudeness")
    with pytest.raises(ValueError, match="threshold"):
        TrustPolicy(threshold=0)


async def submit(ws, session: Session, claim: float, group_size: int) -> m.Message:
    """Take one lease and answer it with a wrong completion claiming reward `claim`."""
    await ws.send_bytes(session.send(m.LeaseRequest(1)))
    while not isinstance(msg := session.receive((await ws.receive()).data, 0.0),
                         (m.LeaseGrant, m.Reject)):
        pass
    if isinstance(msg, m.Reject):
        return msg
    # Token 5 of the built-in tokenizer is "\n": the text is the decoding of the ids, as the
    # hub checks, and no sum.
    sample = m.Sample(m.pack_ids([5]), m.pack_logprobs([-1.0]), "\n", claim, "stop")
    await ws.send_bytes(session.send(m.RolloutSubmission(msg.lease_id, 0, [sample] * group_size)))
    while not isinstance(reply := session.receive((await ws.receive()).data, 0.0), (m.Ack, m.Reject)):
        pass
    return reply


async def test_reward_forger_is_quarantined_and_its_prompts_go_back():
    """Three forged rewards (1.0 for a wrong answer) put a peer below 0.5: its next rollout is
    rejected as quarantined, its prompt re-queued, no more leases, and the run log says so.
    An honest zero claim for the same wrong answer costs nothing."""
    async with tracker(prompts_per_step=64, group_size=2) as (hub, _, url, records):
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            s = Session(Side.PEER, 0.0)
            await ws.send_bytes(s.send(m.Hello("forger", "transformers", "cpu")))
            welcome = s.receive((await ws.receive()).data, 0.0)
            honest = [await submit(ws, s, 0.0, welcome.group_size) for _ in range(3)]
            assert all(isinstance(r, m.Ack) for r in honest)
            forged = [await submit(ws, s, 1.0, welcome.group_size) for _ in range(3)]
            assert [type(r) for r in forged] == [m.Ack, m.Ack, m.Reject]
            assert forged[-1].reason == "quarantined"
            assert hub.statistics().open_leases == 0 and hub.statistics().requeued_leases >= 1
            # Ask for leases, then resubmit an old lease: its (duplicate) ack comes after the
            # hub handled the request, and no lease came before it.
            await ws.send_bytes(s.send(m.LeaseRequest(4)))
            sample = m.Sample(m.pack_ids([5]), m.pack_logprobs([-1.0]), "\n", 0.0, "stop")
            old = m.RolloutSubmission(honest[0].lease_id, 0, [sample] * welcome.group_size)
            await ws.send_bytes(s.send(old))
            reply = s.receive((await ws.receive()).data, 0.0)
            assert isinstance(reply, m.Ack) and reply.duplicate
            assert not hub.peer_views()[welcome.peer_id].open_leases
    quarantine = [r for r in records if r.get("event") == "quarantine"]
    assert len(quarantine) == 1 and quarantine[0]["events"]["reward_mismatch"] == 3
    assert quarantine[0]["name"] == "forger"


def test_check_fraction_is_every_rollout_on_probation_then_falls_to_the_base():
    """A new identity is checked on every rollout for `probation` passes, then on due/passed of
    them, never below the base; a trust event lengthens the probation; checks off stay off."""
    assert check_fraction(0, 0, 0.05, 8) == check_fraction(7, 0, 0.05, 8) == 1.0
    assert check_fraction(16, 0, 0.05, 8) == 0.5
    assert check_fraction(10_000, 0, 0.05, 8) == 0.05
    assert check_fraction(16, 1, 0.05, 8) == 1.0  # one event: 16 passes to earn
    assert check_fraction(64, 1, 0.05, 8) == 0.25
    assert check_fraction(5, 0, 0.0, 8) == 0.0  # spot-checks off
    assert check_fraction(5, 3, 1.0, 8) == 1.0
    assert check_fraction(0, 0, 0.05, 0) == 0.05  # no probation: the plain base


def test_a_trust_event_starts_probation_over():
    """Passed checks count towards probation; an event resets them (and lengthens it), a
    quarantined identity earns nothing; the record survives a checkpoint."""
    book = TrustBook(TrustPolicy(probation_checks=4))
    assert book.check_fraction("a", 0.1) == 1.0
    for _ in range(8):
        book.good("a")
    assert book.check_fraction("a", 0.1) == 0.5 and book.passed == {"a": 8}
    book.record("a", "reward_mismatch")
    assert book.check_fraction("a", 0.1) == 1.0 and "a" not in book.passed
    for _ in range(16):
        book.good("a")
    assert book.check_fraction("a", 0.1) == 0.5  # due 4 x (1 + 1 event)
    restored = TrustBook(TrustPolicy(probation_checks=4))
    restored.restore(book.state())
    assert restored.check_fraction("a", 0.1) == 0.5
    book.record("b", "bad_chunk")
    book.good("b")
    assert "b" not in book.passed
    old = book.state()
    del old["passed"]  # a checkpoint from before probation: everyone starts on probation
    restored.restore(old)
    assert restored.check_fraction("a", 0.1) == 1.0
