"""Every rejected group is counted by its reason (issue 30): forged frames from a raw peer
provoke the reasons a frame past the session's bounds can earn (one the bounds refuse closes the
connection instead: `bad_sample`), and `Hub.statistics()`, /metrics and the log say so;
the log tells the first of each reason and sums the rest, at most one line per interval."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from echo2p2p import messages as m
from echo2p2p.hub.run.start import start_hub
from echo2p2p.hub.core.rejections import RejectionLog
from echo2p2p.policy.model import build_char_tokenizer
from echo2p2p.session import Session, Side

from tests.conftest import tracker

TOK = build_char_tokenizer()


def samples(g: int, ids: list[int] | None = None) -> list[m.Sample]:
    """`g` completions spelling "1" then EOS (or `ids`)."""
    ids = ids if ids is not None else TOK.encode("1", add_special_tokens=False) + [TOK.eos_token_id]
    return [m.Sample(m.pack_ids(ids), m.pack_logprobs([-1.0] * len(ids)), "1", 0.0, "stop")
            for _ in range(g)]


class Raw:
    """A peer speaking the protocol by hand over one websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws, self.s = ws, Session(Side.PEER, 0.0)

    async def send(self, msg: m.Message) -> None:
        await self.ws.send_bytes(self.s.send(msg))

    async def next(self, kind: type) -> m.Message:
        while not isinstance(msg := self.s.receive((await self.ws.receive()).data, 0.0), kind):
            pass
        return msg

    async def join(self, leases: int) -> tuple[m.Welcome, list[m.LeaseGrant]]:
        await self.send(m.Hello("prober", "transformers", "cpu"))
        welcome = await self.next(m.Welcome)
        await self.send(m.LeaseRequest(leases))
        return welcome, [await self.next(m.LeaseGrant) for _ in range(leases)]

    async def answer(self, sub: m.RolloutSubmission) -> str:
        """Submit `sub`; the reason it was rejected for ("" if acknowledged)."""
        await self.send(sub)
        reply = await self.next((m.Ack, m.Reject))
        return "" if isinstance(reply, m.Ack) else reply.reason


async def test_each_reason_a_forged_frame_provokes_is_counted_by_it():
    async with tracker() as (hub, _key, url, _records), \
            aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        peer = Raw(ws)
        welcome, (a, b) = await peer.join(2)
        g = welcome.group_size
        said = [await peer.answer(m.RolloutSubmission(a.lease_id, 0, samples(g, [10 ** 6]))),
                await peer.answer(m.RolloutSubmission(b.lease_id, 7, samples(g))),
                await peer.answer(m.RolloutSubmission("never-granted", 0, samples(g))),
                await peer.answer(m.RolloutSubmission(a.lease_id, 0, samples(g, [10 ** 6])))]
        assert said == ["bad_tokens", "future", "unknown_lease", "bad_tokens"]
        stats = hub.statistics()
    assert stats.rejected_by == {"bad_tokens": 1, "future": 1, "unknown_lease": 1,
                                 "already_rejected": 1}
    assert sum(stats.rejected_by.values()) == stats.rejected + stats.stale_on_arrival


async def test_a_group_past_its_lease_is_counted_as_expired_in_metrics_and_the_log(hub_cfg, caplog):
    caplog.set_level(logging.INFO, logger="echo2p2p.hub.serving.server")
    cfg = hub_cfg.replace(lease_timeout_s=0.5)
    async with start_hub(cfg, stream=None) as run, aiohttp.ClientSession() as http:
        async with http.ws_connect(run.url) as ws:
            peer = Raw(ws)
            welcome, (lease,) = await peer.join(1)
            await asyncio.wait_for(run.hub.until(lambda: run.hub.statistics().leases_expired >= 1), 10)
            reason = await peer.answer(m.RolloutSubmission(lease.lease_id, 0,
                                                           samples(welcome.group_size)))
        async with http.get(f"http://127.0.0.1:{run.dashboard_port}/metrics") as response:
            text = await response.text()
    assert reason == "expired"
    assert run.hub.statistics().rejected_by == {"expired": 1}
    counted = {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
               if f.name == "echo2_groups_rejected" for s in f.samples}
    assert counted == {"expired": 1.0}
    assert [r.message for r in caplog.records if "rejected" in r.message and "expired" in r.message]


def test_the_log_tells_the_first_of_each_reason_and_sums_the_rest_once_per_interval(caplog):
    caplog.set_level(logging.INFO, logger="echo2p2p.hub.serving.server")
    told = RejectionLog(every_s=10.0)
    told.rejected("expired", "L1", "p1", now=0.0)
    for i in range(50):  # a flood within the interval: nothing more is written
        told.rejected("expired", f"L{i + 2}", "p1", now=1.0 + i / 10)
    told.rejected("stale", "L99", "p2", now=7.0)  # a new reason: told at once
    told.flush(now=9.0)  # not due yet
    assert len(caplog.records) == 2
    assert "expired" in caplog.records[0].message and "lease_timeout_s" in caplog.records[0].message
    assert "stale" in caplog.records[1].message
    told.flush(now=10.0)
    assert caplog.records[2].message.startswith("rejected 50 more groups") \
        and "expired 50" in caplog.records[2].message
    told.flush(now=30.0)  # nothing new: no line
    assert len(caplog.records) == 3
