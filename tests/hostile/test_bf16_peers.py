"""Honest peers sampling in bf16 (the GPU default) are never quarantined; liars sampling in bf16
still are (issue 45, item 2).

A bf16 engine's logprobs differ from the hub's fp32 recompute (tiny model: median 1e-4 nats a
token, p99 0.04; SmolLM2-135M: 6e-3 and 0.2) far more than an fp32 engine's, and over a group
far less than the spot-check bar, the same for every engine and dtype (`hub.learning.spotcheck`:
a dtype a peer claims cannot buy it a looser one). Real peers (`PeerClient`, `--dtype
bfloat16`) against a real hub.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.worker import Rollouts

from tests.conftest import running_peers, until
from .conftest import yes
from .harness import HONEST, run_events, small_cfg, steps

BF16 = "bfloat16"
HONEST_STEPS = 12  # x 4 groups a step, every one spot-checked


async def test_honest_bf16_peer_passes_every_spot_check(tmp_path, row):
    """Every group of an honest bf16 peer is spot-checked (fraction 1) for 12 steps: none
    fails, it is never quarantined; its hello says bf16, its welcome the bar; the step records
    carry the checks' mismatch (k3 KL) by lag."""
    r = row("45-2. honest bf16 peer, every group spot-checked")
    cfg = small_cfg(tmp_path, spot_check_fraction=1.0, max_steps=HONEST_STEPS)
    async with start_hub(cfg, stream=None) as run, \
            running_peers(run.url, 1, torch_threads=1, dtype=BF16) as [peer]:
        await asyncio.wait_for(run.finished.wait(), 900)
        said = {conn.hello.dtype for conn in run.hub.core.peers.values()}
        bar = peer.welcome.spot_check_tolerance
    s = run.hub.statistics()
    kl = [rec["spot/mismatch_kl"] for rec in run.records if "spot/mismatch_kl" in rec]
    r.reaction = (f"{s.spot_checked} groups checked, {s.spot_failed} failed, "
                  f"{len(s.quarantined)} quarantined; mismatch KL max {max(kl, default=0):.1e}")
    r.hub_alive = yes(steps(run) == HONEST_STEPS)
    r.honest_training = f"yes: {peer.statistics().acked} groups acked"
    assert said == {BF16} and bar == cfg.trust.spot_check_tolerance > 0
    assert s.spot_checked >= HONEST_STEPS * cfg.grpo.prompts_per_step
    assert s.spot_failed == 0 and not s.quarantined
    assert not any(e.get("logprob_mismatch") for e in s.trust_events.values()), s.trust_events
    assert kl and all(0 < x < 1e-2 for x in kl)
    assert all(lag.isdigit() for rec in run.records for lag in rec.get("spot/mismatch_by_lag", {}))


class NearZero:
    """Every logprob claimed -1e-3 (every ratio becomes the token's probability):
    bench/spotcheck.py's "near 0" forger, which sits closest to the bar of its kind."""

    def __init__(self, honest: Rollouts):
        self.honest = honest

    def generate(self, lease, seed, welcome):
        version, out = self.honest.generate(lease, seed, welcome)
        return version, [replace(c, logprobs=[-1e-3] * len(c.logprobs)) for c in out]


class FutureTag:
    """Honest rollouts tagged one version newer than the engine held: one never published, or
    (the hub stepped meanwhile) one whose weights do not reproduce them."""

    def __init__(self, honest: Rollouts):
        self.honest = honest

    def generate(self, lease, seed, welcome):
        version, out = self.honest.generate(lease, seed, welcome)
        return version + 1, out


class TextLie:
    """Honest ids and logprobs, every text the right answer: what it decodes to is not."""

    def __init__(self, honest: Rollouts):
        self.honest = honest

    def generate(self, lease, seed, welcome):
        version, out = self.honest.generate(lease, seed, welcome)
        return version, [replace(c, text=lease.answer) for c in out]


LIARS = {"near-zero": NearZero, "future-tag": FutureTag, "text-lie": TextLie}


async def test_bf16_liars_are_caught_within_their_probation(tmp_path, row):
    """At the default spot-check rate, three liars in bf16 beside an honest bf16 peer (forged
    logprobs, a version tag never published, texts that are not their ids' decoding) are each
    quarantined before passing their probation of checks, with fewer than that many groups
    admitted; the honest peer never fails a check."""
    r = row("45-2. liars in bf16 (forged logprobs, future tag, text lie), default rate")
    cfg = small_cfg(tmp_path)
    probation = cfg.trust.spot_check_probation
    async with start_hub(cfg, stream=None) as run, \
            running_peers(run.url, 1, torch_threads=1, dtype=BF16) as [honest]:
        liars = {name: PeerClient(PeerConfig(hub_url=run.url, name=name, torch_threads=1,
                                             dtype=BF16), rollouts=lie)
                 for name, lie in LIARS.items()}
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            for liar in liars.values():
                tg.create_task(liar.run(stop))
            try:
                await until(run.hub, lambda: {q["name"] for q in run_events(run, "quarantine")}
                            >= set(LIARS), 600)
            finally:
                stop.set()
        s = run.hub.statistics()
        honest_identity = next(c.identity for c in run.hub.core.peers.values()
                               if c.hello.name == HONEST)
    caught = {q["name"]: q for q in run_events(run, "quarantine")}
    admitted = {name: liar.statistics().acked for name, liar in liars.items()}
    r.reaction = "; ".join(f"{name}: quarantined with {admitted[name]} admitted, "
                           f"{dict((k, v) for k, v in caught[name]['events'].items() if v)}"
                           for name in LIARS)
    r.hub_alive = yes(True)
    r.honest_training = f"yes: {honest.statistics().acked} groups acked"
    assert set(caught) == set(LIARS), caught
    assert caught["near-zero"]["events"]["logprob_mismatch"] >= 1
    assert caught["future-tag"]["events"]["logprob_mismatch"] >= 1  # reason "version"
    assert caught["text-lie"]["events"]["text_mismatch"] >= 1
    assert all(n < probation for n in admitted.values()), admitted
    assert honest_identity not in s.quarantined
    assert not s.trust_events.get(honest_identity, {}).get("logprob_mismatch")
