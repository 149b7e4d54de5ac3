"""The hub and real peers over real websockets on 127.0.0.1: training, staleness, bad input, churn."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import replace

import aiohttp
import msgpack

from echo2p2p import messages as m
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.policy.engines import TransformersEngine

from tests.conftest import running_peers


async def test_two_peers_train_and_receive_versions(hub_cfg):
    """Hub + 2 peers: every step trains on fresh groups and each peer ends on a recent version."""
    cfg = hub_cfg.replace(max_steps=6, max_lag=2)
    async with start_hub(cfg, stream=None) as run, running_peers(run.url, 2) as peers:
        await asyncio.wait_for(run.finished.wait(), 120)
        await asyncio.wait_for(asyncio.gather(*(p.wait_version(4) for p in peers)), 60)
    steps = [r for r in run.records if "step" in r]
    assert [r["step"] for r in steps] == list(range(6))
    assert all(int(lag) <= cfg.staleness.max_lag for r in steps for lag in r["rollout/staleness_hist"])
    assert all(p.statistics().acked > 0 for p in peers)
    logged = [json.loads(line) for line in (run.runlog.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "step" in r] == list(range(6))
    assert 0 < steps[-1]["hub/learner_busy_frac"] <= 1


class StragglerEngine:
    """The real engine, but each generation returns only after the learner moved S + 1 versions
    past the step it started at, so its rollout is certain to arrive stale."""

    def __init__(self, run, max_lag: int):
        self.inner = TransformersEngine("tiny")
        self.tokenizer = self.inner.tokenizer
        self.run = run
        self.max_lag = max_lag

    def load_weights(self, state):
        self.inner.load_weights(state)

    def generate(self, prompt_ids, n, **kw):
        started = self.run.hub.core.step
        out = self.inner.generate(prompt_ids, n, **kw)
        deadline = time.monotonic() + 60
        while (self.run.hub.core.step <= started + self.max_lag and not self.run.finished.is_set()
               and time.monotonic() < deadline):
            time.sleep(0.02)  # waiting on the learner's progress, in the engine's own thread
        return out


async def test_slow_peer_rollouts_never_exceed_the_staleness_bound(hub_cfg):
    """S = 1 with one straggler: admitted lag is always <= S, and its stale rollouts are counted."""
    cfg = hub_cfg.replace(max_steps=8, max_lag=1, lease_timeout_s=30)  # the straggler's expire
    async with start_hub(cfg, stream=None) as run:
        engines = [None, StragglerEngine(run, cfg.staleness.max_lag)]
        async with running_peers(run.url, 2, engines=engines) as peers:
            await asyncio.wait_for(run.finished.wait(), 180)
    steps = [r for r in run.records if "step" in r]
    assert len(steps) == 8
    assert all(int(lag) <= 1 for r in steps for lag in r["rollout/staleness_hist"])
    dropped = steps[-1]["rollout/stale_on_arrival_total"] + steps[-1]["rollout/stale_in_queue_total"]
    assert dropped >= 1
    assert peers[1].statistics().rejected.get("stale", 0) >= 1


def frame(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


BAD_INPUTS = [
    ("random bytes", [b"\xc1\x93\x00garbage"], m.CLOSE_PROTOCOL_ERROR, "not msgpack"),
    ("not a map", [frame([1, 2, 3])], m.CLOSE_PROTOCOL_ERROR, "not a map"),
    ("wrong shape", [frame({"p": m.BASE_PROTOCOL, "t": "hello", "name": 5, "engine": "x", "device": "cpu"})],
     m.CLOSE_PROTOCOL_ERROR, "hello.name"),
    ("unknown type", [frame({"p": m.BASE_PROTOCOL, "t": "teleport"})], m.CLOSE_UNKNOWN_TYPE, "teleport"),
    ("protocol version", [frame({"p": 99, "t": "hello"})], m.CLOSE_BAD_PROTOCOL_VERSION, "99"),
    ("over-size frame", [b"\x00" * ((4 << 20) + 1)], m.CLOSE_TOO_BIG, "exceeds"),
    ("text frame", ["hello"], m.CLOSE_UNSUPPORTED_DATA, "text frames"),
    ("rollout before hello", [m.encode(m.RolloutSubmission("L1", 0, []))],
     m.CLOSE_UNEXPECTED_MESSAGE, "unexpected rollout"),
]


async def close_after(url: str, frames: list) -> tuple[int, str, str | None]:
    """Send `frames`, then read until the hub closes: (close code, close reason, goodbye reason)."""
    goodbye = None
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        for f in frames:
            await (ws.send_str(f) if isinstance(f, str) else ws.send_bytes(f))
        while True:
            msg = await ws.receive(timeout=30)
            if msg.type is aiohttp.WSMsgType.BINARY:
                decoded = m.decode(msg.data)
                if isinstance(decoded, m.Goodbye):
                    goodbye = decoded.reason
            elif msg.type is aiohttp.WSMsgType.CLOSE:
                return msg.data, msg.extra, goodbye
            else:
                return ws.close_code, "", goodbye


async def test_bad_input_closes_only_that_connection(hub_cfg):
    """Each kind of bad frame gets its own close code and reason; training goes on meanwhile."""
    cfg = hub_cfg.replace(max_steps=5)
    async with start_hub(cfg, stream=None) as run, running_peers(run.url, 1):
        results = await asyncio.gather(*(close_after(run.url, frames) for _, frames, _, _ in BAD_INPUTS))
        await asyncio.wait_for(run.finished.wait(), 120)
    for (name, _, code, reason), (got_code, got_reason, goodbye) in zip(BAD_INPUTS, results):
        assert got_code == code, name
        assert reason in got_reason and reason in goodbye, name
    assert run.hub.statistics().closed_for_protocol == len(BAD_INPUTS)
    assert len([r for r in run.records if "step" in r]) == 5


async def test_duplicate_and_unknown_submissions_are_answered_not_admitted(hub_cfg):
    """Resubmitting a completed lease is acked as duplicate; an unknown lease id is rejected."""
    # Its logprobs are made up, and a new peer's groups are all spot-checked: checks off here.
    async with start_hub(hub_cfg.replace(max_steps=0, spot_check_fraction=0.0), stream=None) as run:
        async with aiohttp.ClientSession() as http, http.ws_connect(run.url) as ws:
            from echo2p2p.session import Session, Side

            s = Session(Side.PEER, 0.0)
            await ws.send_bytes(s.send(m.Hello("raw", "transformers", "cpu")))
            welcome = s.receive((await ws.receive()).data, 0.0)
            await ws.send_bytes(s.send(m.LeaseRequest(1)))
            while not isinstance(msg := s.receive((await ws.receive()).data, 0.0), m.LeaseGrant):
                pass
            sample = m.Sample(m.pack_ids([5]), m.pack_logprobs([-1.0]), msg.answer, 1.0, "stop")
            rollout = m.RolloutSubmission(msg.lease_id, 0, [sample] * welcome.group_size)
            replies = []
            for r in (rollout, rollout, replace(rollout, lease_id="L-nope")):
                await ws.send_bytes(s.send(r))
                while not isinstance(reply := s.receive((await ws.receive()).data, 0.0), (m.Ack, m.Reject)):
                    pass
                replies.append(reply)
    assert replies[0] == m.Ack(msg.lease_id, duplicate=False)
    assert replies[1] == m.Ack(msg.lease_id, duplicate=True)
    assert replies[2] == m.Reject("L-nope", "unknown_lease")
    assert run.hub.statistics().admitted_groups == 1


async def test_peer_rejoins_a_restarted_hub(hub_cfg):
    """When the hub goes away and comes back on the same port, the peer reconnects and works."""
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        async with start_hub(hub_cfg.replace(max_steps=2), stream=None) as run:
            peer = PeerClient(PeerConfig(hub_url=run.url, name="rejoin", reconnect_max_s=1.0))
            tg.create_task(peer.run(stop))
            await asyncio.wait_for(run.finished.wait(), 120)
        async with start_hub(hub_cfg.replace(max_steps=2, port=run.port), stream=None) as run2:
            await asyncio.wait_for(run2.finished.wait(), 120)
        stop.set()
    assert peer.statistics().connections == 2
    assert run2.hub.statistics().admitted_groups >= 2 * hub_cfg.grpo.prompts_per_step


async def test_hub_trains_a_model_from_a_local_directory_on_a_jsonl_task(hub_cfg, tmp_path):
    """--model DIR and --task FILE.jsonl go through the same loaders as the built-ins."""
    from echo2p2p.policy.model import load_policy

    model, tokenizer = load_policy("tiny")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    rows = [json.dumps({"question": f"{a}+{a}=", "answer": str(2 * a)}) for a in range(60)]
    (tmp_path / "sums.jsonl").write_text("\n".join(rows) + "\n")
    cfg = hub_cfg.replace(model=str(tmp_path / "model"), task=str(tmp_path / "sums.jsonl"),
                  max_steps=2)
    async with start_hub(cfg, stream=None) as run, running_peers(run.url, 1) as peers:
        await asyncio.wait_for(run.finished.wait(), 120)
    assert run.hub.setup.task.kind == "math"
    assert peers[0].welcome.model == str(tmp_path / "model")
    assert [r["step"] for r in run.records if "step" in r] == [0, 1]


async def test_synchronous_mode_trains_only_on_the_current_version(hub_cfg):
    """S = 0: every group step t trains on was generated by version t itself."""
    cfg = hub_cfg.replace(max_steps=4, max_lag=0)
    async with start_hub(cfg, stream=None) as run, running_peers(run.url, 2):
        await asyncio.wait_for(run.finished.wait(), 120)
    steps = [r for r in run.records if "step" in r]
    assert [r["rollout/staleness_hist"] for r in steps] == [{"0": cfg.grpo.prompts_per_step}] * 4


def masked_frame(payload: bytes) -> bytes:
    """A client-to-server binary websocket frame (RFC 6455 section 5.2), masked as required."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x82]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_peer_that_stops_reading_is_closed_and_training_goes_on(hub_cfg):
    """A peer that joins, keeps sending heartbeats but never reads is cut off by the send
    deadline; the real peer keeps training meanwhile."""
    cfg = hub_cfg.replace(max_steps=0, peer_timeout_s=2.0)
    async with start_hub(cfg, stream=None) as run, running_peers(run.url, 1):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up fast
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", run.port))
        await loop.sock_sendall(sock, (
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{run.port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        await loop.sock_sendall(sock, masked_frame(m.encode(m.Hello("stuck", "transformers", "cpu"))))
        await asyncio.wait_for(run.hub.until(lambda: len(run.hub.peer_views()) == 2), 60)
        stuck = next(p for p in run.hub.peer_views().values() if p.name == "stuck")
        # Versions travel over HTTP now, so the hub sends this peer only small frames: shrink
        # the hub's buffers for it so that they fill within a few publications (the hub's end
        # of this socket, which no public face hands out: reached privately, here only).
        transport = run.hub._conns.by_peer[stuck.peer_id].transport
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        steps_then = run.hub.core.step
        try:
            while stuck.peer_id in run.hub.peer_views():  # heartbeats keep it from looking silent
                await loop.sock_sendall(sock, masked_frame(m.encode(m.Heartbeat())))
                await asyncio.sleep(0.2)  # the stuck peer's own pace, not a synchronisation
        except ConnectionError:
            pass  # the hub closed it while we were still writing
        finally:
            sock.close()
        await asyncio.wait_for(run.hub.until(lambda: run.hub.core.step >= steps_then + 3), 60)
    assert stuck.peer_id not in run.hub.peer_views()
    assert run.hub.statistics().cut_off == 1


class NaNEngine:
    """The real engine, whose first `bad` generations carry a NaN behaviour logprob."""

    def __init__(self, bad: int):
        self.inner = TransformersEngine("tiny")
        self.tokenizer = self.inner.tokenizer
        self.bad = bad

    def load_weights(self, state):
        self.inner.load_weights(state)

    def generate(self, prompt_ids, n, **kw):
        out = self.inner.generate(prompt_ids, n, **kw)
        if self.bad > 0:
            self.bad -= 1
            out[0] = replace(out[0], logprobs=[float("nan")] + list(out[0].logprobs[1:]))
        return out


async def test_a_peer_drops_a_rollout_the_hub_would_refuse_instead_of_looping(hub_cfg):
    """A rollout whose engine produced a NaN logprob would close the connection at the hub (and
    again at every resend from the outbox): the peer drops it and asks for another lease, so it
    stays connected and its good rollouts are admitted."""
    cfg = hub_cfg.replace(max_steps=3, lease_timeout_s=10)  # a dropped lease expires soon
    async with start_hub(cfg, stream=None) as run:
        async with running_peers(run.url, 1, engines=[NaNEngine(bad=2)]) as (peer,):
            await asyncio.wait_for(run.finished.wait(), 120)
            # A rollout may still be on its way when the learner stops: the hub, still
            # serving, answers it (it leases no more once its budget is full). Checked here:
            # one granted just before may still be generated as the peers stop.
            await asyncio.wait_for(run.hub.until(lambda: not peer.outbox.pending()), 60)
    assert peer.statistics().connections == 1 and run.hub.statistics().closed_for_protocol == 0
    assert peer.statistics().acked >= cfg.grpo.prompts_per_step * 3
