"""Lies about a multi-turn environment (issue 15): a peer plays the real environment with the
real engine, so its token ids and logprobs are its own and pass every spot-check, but it alters
what the environment said (an observation, or a game that went on after it ended) or claims a
reward the environment did not give. The hub replays every episode: the lie is caught, counts
against the liar's trust until quarantine, and the honest peer trains on meanwhile. The same
holds for an environment written for verifiers (issue 33): examples/verifiers_guess.py, a
`vf.MultiTurnEnv` loaded by name, as prime-rl loads it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from echo2p2p.episodes import Played
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.worker import Rollouts

from tests.conftest import running_peers
from .conftest import yes
from .harness import hub_alive, run_beside, small_cfg, steps

STEPS = 6
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# environment -> (--env, what it could have answered: the made-up observation of a game over)
ENVS = {"takeaway": ("takeaway", "I took 1. pile 5: "),
        "verifiers": ("verifiers:verifiers_guess", "higher:")}


def forge_observation(played: Played, encode, fake: str) -> Played:
    """One character of the first observation changed; or, for a game over at the first move,
    the made-up answer `fake` and another move (the game went on, says the liar)."""
    ids, turns = list(played.ids), list(played.turns)
    if len(turns) > 1:
        at = turns[0]
        ids[at] = encode("i")[0] if ids[at] != encode("i")[0] else encode("j")[0]
        return replace(played, ids=ids)
    fake = encode(fake)
    first = ids[:turns[0]]
    return replace(played, ids=ids + fake + first, turns=turns + [len(fake), len(first)],
                   logprobs=played.logprobs * 2)


LIES = {
    "observation": forge_observation,
    "reward": lambda played, encode, fake: replace(played, reward=1.0),  # every game "won"
}


class EpisodeLies:
    """The honest player's rollouts in all but what they report of the environment."""

    def __init__(self, honest: Rollouts, lie, fake: str):
        self.honest, self.lie, self.fake = honest, lie, fake

    def play(self, lease, seed, welcome, env):
        version, played = self.honest.play(lease, seed, welcome, env)
        encode = self.honest.swapper.engine.decoder.encode
        return version, [self.lie(p, encode, self.fake) for p in played]


def episode_liar(cfg: PeerConfig, lie, fake: str) -> PeerClient:
    """An honest player in all but what it reports of the environment."""
    return PeerClient(cfg, rollouts=lambda honest: EpisodeLies(honest, lie, fake))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("env, lie", [("takeaway", "observation"), ("takeaway", "reward"),
                                      ("verifiers", "observation")])
async def test_environment_lies_are_caught_by_replay(env, lie, tmp_path, row, monkeypatch):
    r = row(f"15. episode lies ({lie}) in a multi-turn environment ({env}), replayed by the hub")
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as if installed; scoring workers inherit it
    name, fake = ENVS[env]
    cfg = small_cfg(tmp_path, env=name, model="tiny-takeaway", max_new_tokens=4,
                    max_steps=STEPS, spot_check_fraction=1.0)
    async with start_hub(cfg, stream=None) as run, \
            running_peers(run.url, 1, torch_threads=1) as [honest]:
        liar = episode_liar(PeerConfig(hub_url=run.url, name="liar", torch_threads=1), LIES[lie],
                            fake)
        held = await run_beside(run, liar, 300)
        trust, events = run.hub.statistics(), held.events
        alive = await hub_alive(run) and steps(run) == STEPS
        acked = honest.statistics().acked
        r.reaction = (f"liar: {({k: v for k, v in events.items() if v})}, "
                      + (f"quarantined at step {held.quarantined_at}"
                         if held.quarantined_at is not None else "NOT quarantined")
                      + f"; {run.hub.statistics().spot_checked} groups spot-checked, "
                        f"{run.hub.statistics().spot_failed} failed")
        r.hub_alive = yes(alive)
        r.honest_training = f"{acked} groups acked"
    expected = "observation_mismatch" if lie == "observation" else "reward_mismatch"
    assert events.get(expected, 0) >= 1, f"no {expected} against the liar: {events}"
    assert held.liar in trust.quarantined, "the liar was not quarantined"
    assert not any(trust.trust_events.get(held.honest, {}).values()), "the honest peer was distrusted"
    assert run.hub.statistics().spot_failed == 0, "an honest episode failed its spot-check"
    assert alive and acked > 0
