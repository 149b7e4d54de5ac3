"""Poisoning by text (issue 11, item 1): a peer runs the honest engine and keeps its honest
token ids and logprobs, so every spot-check passes, but labels its completions with texts that
lie about them (and claims the rewards its texts earn). The hub must score the decoding of the
ids it trains on: the lie counts against the liar, and held-out accuracy with the liar present
ends within noise of the honest run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from echo2p2p.tasks import addition_reward
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.worker import Rollouts

from tests.conftest import running_peers
from .conftest import ACCURACY_STEPS, NOISE, accuracy_cfg, cell_accuracy, yes
from .harness import hub_alive, run_beside, steps


def wrong_answer(answer: str) -> str:
    return str(int(answer) + 1)


LIES = {
    # Its correct completions labelled wrong, its wrong ones labelled with the answer: the
    # rewards the hub computed from the texts were the opposite of the ids' (0.27 -> 0.02).
    "invert": lambda answer, text: (wrong_answer(answer) if addition_reward(answer, text)
                                    else answer),
    # Every completion labelled with the answer: reward 1.0, every group zero-variance.
    "always-right": lambda answer, text: answer,
}


class TextLies:
    """The honest rollouts in all but the `text` of each completion (rewards follow from it)."""

    def __init__(self, honest: Rollouts, lie):
        self.honest, self.lie = honest, lie

    def generate(self, lease, seed, welcome):
        version, out = self.honest.generate(lease, seed, welcome)
        return version, [replace(c, text=self.lie(lease.answer, c.text)) for c in out]


def text_liar(cfg: PeerConfig, lie) -> PeerClient:
    """An honest peer in all but the `text` of its samples."""
    return PeerClient(cfg, rollouts=lambda honest: TextLies(honest, lie))


@pytest.mark.parametrize("lie", sorted(LIES))
async def test_text_lies_are_caught_and_do_not_poison(lie, tmp_path, honest_baseline, row):
    """A peer whose texts lie about its token ids is quarantined and leaves accuracy as it was."""
    r = row(f"1. text lies ({lie}), spot-checks on every group")
    cfg = accuracy_cfg(str(tmp_path / "run"))
    async with start_hub(cfg, stream=None) as run, \
            running_peers(run.url, 1, torch_threads=1) as [honest]:
        liar = text_liar(PeerConfig(hub_url=run.url, name="liar", torch_threads=1), LIES[lie])
        held = await run_beside(run, liar, 240)
        trust, events = run.hub.statistics(), held.events
        liar_identity, honest_identity = held.liar, held.honest
        caught = [] if held.quarantined_at is None else [held.quarantined_at]
        alive = await hub_alive(run) and steps(run) == ACCURACY_STEPS
        acked = honest.statistics().acked
        after = ACCURACY_STEPS - caught[0] if caught else 0
        r.reaction = (f"liar: text_mismatch x{events.get('text_mismatch', 0)}, "
                      + (f"quarantined at step {caught[0]}" if caught else "NOT quarantined")
                      + f"; {run.hub.statistics().spot_checked} groups spot-checked, "
                        f"{run.hub.statistics().spot_failed} failed")
        r.hub_alive = yes(alive)
        r.honest_training = (f"yes: {after} steps after the liar's quarantine, {acked} groups acked"
                             if caught else f"{acked} groups acked (no quarantine)")
    evals = [rec["eval/accuracy"] for rec in run.records if "eval/accuracy" in rec]
    with_liar = evals[-1]
    r.accuracy = cell_accuracy(honest_baseline.final, with_liar)
    r.note = f"base {evals[0]:.3f}; liar submitted {liar.statistics().submitted} groups"

    assert events.get("text_mismatch", 0) >= 1, f"no text_mismatch against the liar: {events}"
    assert liar_identity in trust.quarantined, "the liar was not quarantined"
    assert honest_identity not in trust.quarantined, "the honest peer was quarantined"
    assert alive and after > 0 and acked > 0
    assert abs(with_liar - honest_baseline.final) <= NOISE, (honest_baseline, with_liar)
