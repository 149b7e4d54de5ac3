"""Forged behaviour logprobs at the default spot-check rate (issue 28, item 6): a real peer
reports every token's logprob as 0.0 (probability 1), which steers the learner's importance
ratio. At a flat 5 % rate its groups were trained for dozens of steps before a check caught it
(48 admitted), and admitted groups stayed queued after its quarantine. Now a new peer is
checked on every group while on probation, and a quarantined peer's queued groups are
withdrawn: at most a couple of its groups (forgeries the tolerance let through) are trained.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.worker import Rollouts

from tests.conftest import running_peers, until
from .conftest import ACCURACY_STEPS, NOISE, accuracy_cfg, cell_accuracy, yes
from .harness import (START_STEPS, cell_rate, hub_alive, peer_id, run_events, steps,
                      steps_per_min, wait_steps)

DEFAULT_FRACTION = HubConfig().trust.spot_check_fraction  # 0.05


class LogprobLies:
    """The honest rollouts but for their behaviour logprobs, all 0.0; notes the leases forged in
    `forged` (a lease id is granted once: those trained are the liar's groups trained)."""

    def __init__(self, honest: Rollouts, forged: list[str]):
        self.honest, self.forged = honest, forged

    def generate(self, lease, seed, welcome):
        version, out = self.honest.generate(lease, seed, welcome)
        self.forged.append(lease.lease_id)
        return version, [replace(c, logprobs=[0.0] * len(c.logprobs)) for c in out]


async def test_forged_logprobs_are_caught_before_they_are_trained(tmp_path, honest_baseline, row):
    """At the default rate, a new peer forging its logprobs is checked from its first group and
    quarantined; at most 2 of its groups are ever trained, none after its quarantine (queued
    ones are withdrawn); the honest peer is never distrusted and accuracy ends within noise."""
    r = row(f"R3-6. forged logprobs (all 0.0) at the default spot-check rate {DEFAULT_FRACTION}")
    cfg = accuracy_cfg(str(tmp_path / "run")).replace(spot_check_fraction=DEFAULT_FRACTION)
    async with start_hub(cfg, stream=None) as run, \
            running_peers(run.url, 1, torch_threads=1) as [honest]:
        await wait_steps(run, START_STEPS, 120)
        without = await steps_per_min(run)
        forged: list[str] = []
        liar = PeerClient(PeerConfig(hub_url=run.url, name="liar", torch_threads=1),
                          rollouts=lambda honest: LogprobLies(honest, forged))
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(liar.run(stop))
            try:
                # the hub handles the rollout's frame after the liar counted it: woken by that
                await until(run.hub, lambda: liar.statistics().submitted >= 1, 120)
                with_liar = await steps_per_min(run)
                await asyncio.wait_for(run.finished.wait(), 300)
                liar_identity = run.hub.peer_views()[peer_id(run, "liar")].identity
                honest_identity = run.hub.peer_views()[peer_id(run, "test-0")].identity
            finally:
                stop.set()
        alive = await hub_alive(run) and steps(run) == ACCURACY_STEPS
        trust = c = run.hub.statistics()
        acked = honest.statistics().acked
    caught = [q for q in run_events(run, "quarantine") if q["identity"] == liar_identity]
    step_records = [rec for rec in run.records if "rollout/leases" in rec]
    trained = {lease for rec in step_records for lease in rec["rollout/leases"]}
    liar_trained = trained & set(forged)
    late = [lease for rec in step_records if caught and rec["step"] > caught[0]["step"]
            for lease in rec["rollout/leases"] if lease in forged]
    evals = [rec["eval/accuracy"] for rec in run.records if "eval/accuracy" in rec]
    events = trust.trust_events.get(liar_identity, {})
    withdrawn = caught[0].get("groups_withdrawn", 0) if caught else 0
    r.reaction = (f"liar: logprob_mismatch x{events.get('logprob_mismatch', 0)}, "
                  + (f"quarantined at step {caught[0]['step']}, {withdrawn} queued groups "
                     "withdrawn" if caught else "NOT quarantined")
                  + f"; {liar.statistics().acked} of its groups admitted, {len(liar_trained)} "
                    f"trained; {c.spot_checked} checked, {c.spot_failed} failed of "
                    f"{c.admitted_groups} admitted")
    r.hub_alive = yes(alive)
    r.honest_training = (f"yes: {ACCURACY_STEPS - caught[0]['step']} steps after the liar's "
                         f"quarantine, {acked} groups acked" if caught
                         else f"{acked} groups acked (no quarantine)")
    r.steps_per_min = cell_rate(without, with_liar)
    r.accuracy = cell_accuracy(honest_baseline.final, evals[-1])
    r.note = (f"'with' over the 3 steps after the liar's first submission (every group of a new "
              f"peer checked); liar submitted {liar.statistics().submitted} groups")

    assert caught, "the liar was not quarantined"
    assert events.get("logprob_mismatch", 0) >= 1, events
    assert honest_identity not in trust.quarantined and honest_identity not in trust.trust_events
    assert len(liar_trained) <= 2, f"{len(liar_trained)} forged groups trained: {liar_trained}"
    assert not late, f"the liar's groups trained after its quarantine: {late}"
    assert alive and acked > 0
    assert abs(evals[-1] - honest_baseline.final) <= NOISE, (honest_baseline, evals[-1])
