"""A quarantined peer's admitted groups still queued are withdrawn before the learner takes
them, counted, logged, and journaled: a hub resumed from the journal does not bring them back."""

from __future__ import annotations

import aiohttp

from echo2p2p import messages as m
from echo2p2p.completions import CompletionDecoder
from echo2p2p.hub.learning.durable import Checkpoints, read_journal
from echo2p2p.hub.serving.server import Hub, TokenizedProblem
from echo2p2p.policy.model import build_char_tokenizer
from echo2p2p.session import Session, Side

from tests.conftest import tracker


async def join(http: aiohttp.ClientSession, url: str, name: str):
    ws = await http.ws_connect(url)
    session = Session(Side.PEER, 0.0)
    await ws.send_bytes(session.send(m.Hello(name, "transformers", "cpu")))
    welcome = session.receive((await ws.receive()).data, 0.0)
    return ws, session, welcome


async def submit(ws, session: Session, claim: float, group_size: int) -> m.Message:
    """Take one lease and answer it with a wrong completion claiming reward `claim`."""
    await ws.send_bytes(session.send(m.LeaseRequest(1)))
    while not isinstance(msg := session.receive((await ws.receive()).data, 0.0), m.LeaseGrant):
        pass
    # Token 5 of the built-in tokenizer is "\n": the text is the decoding of the ids, no sum.
    sample = m.Sample(m.pack_ids([5]), m.pack_logprobs([-1.0]), "\n", claim, "stop")
    await ws.send_bytes(session.send(m.RolloutSubmission(msg.lease_id, 0, [sample] * group_size)))
    while not isinstance(reply := session.receive((await ws.receive()).data, 0.0), (m.Ack, m.Reject)):
        pass
    return reply


async def test_quarantine_withdraws_the_liars_queued_groups_for_good(tmp_path):
    """A peer with 3 honest and 2 forged-reward groups queued is quarantined by its third forged
    reward: its 5 queued groups leave the buffer, the honest peer's stays; the counter and the
    quarantine record say 5; replaying the journal into a fresh hub leaves them out."""
    async with tracker(prompts_per_step=64, group_size=2) as (hub, _, url, records):
        state = hub.checkpoint(Checkpoints(tmp_path).journal(0))
        async with aiohttp.ClientSession() as http:
            ws, s, welcome = await join(http, url, "forger")
            honest_ws, hs, _ = await join(http, url, "honest")
            kept = await submit(honest_ws, hs, 0.0, welcome.group_size)
            fair = [await submit(ws, s, 0.0, welcome.group_size) for _ in range(3)]
            forged = [await submit(ws, s, 1.0, welcome.group_size) for _ in range(3)]
            assert [type(r) for r in fair + forged] == [m.Ack] * 5 + [m.Reject]
            await ws.close()
            await honest_ws.close()
        assert [g.lease_id for g in hub.statistics().queue] == [kept.lease_id]
        assert hub.statistics().withdrawn_groups == 5
        hub.checkpoint(None)  # closes the journal
    quarantine = [r for r in records if r.get("event") == "quarantine"]
    assert len(quarantine) == 1 and quarantine[0]["groups_withdrawn"] == 5
    journal = list(read_journal(tmp_path / "checkpoints" / "journal-000000.log"))
    assert [r[1] for r in journal if r[0] == "withdraw"] == [
        [r.lease_id for r in fair + forged[:2]]]
    task = hub.setup.task
    problems = [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]]  # the tracker's
    fresh = Hub(hub.core.cfg, "run", task, problems, decode=CompletionDecoder(build_char_tokenizer()))
    fresh.restore(state, journal)
    assert [g.lease_id for g in fresh.statistics().queue] == [kept.lease_id]
    assert fresh.statistics().queue_sources == {
        kept.lease_id: hub.statistics().queue_sources[kept.lease_id]}
