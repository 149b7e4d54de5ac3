"""Environments written for Gymnasium and verifiers, loaded by name as they are (issue 33): their
episodes keep our contract (reset(seed) -> text, step(text) -> Step), the hub's replay catches an
altered observation whatever library the environment came from, an environment that is not a
function of its seed is refused in a sentence, and a peer needs the version the hub names."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import gymnasium
import pytest
import verifiers

from echo2p2p import episodes
from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.run.start import start_hub
from echo2p2p.policy.model import load_policy
from echo2p2p.hub.tasks.task_setup import open_setup
from echo2p2p.adapters.environments import (EnvironmentMissing, find_environment,
                                           require_environment)

from tests.conftest import running_peers
from tests.echo2p2p.policy.test_prompts import QWEN3_STYLE_TEMPLATE
from tests.hostile.harness import small_cfg

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
GUESS = "verifiers:verifiers_guess"
BLACKJACK = "gym:gym_blackjack:BlackjackText"


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch):
    """The examples' environments importable by name, as an installed package's would be."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


def encode(text: str) -> list[int]:  # a character codec: the replay's rules, not a tokenizer's
    return [ord(c) for c in text]


def decode_turn(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def played(name: str, seed: int, actions: list[str]) -> tuple[list[int], list[int], float]:
    """The ids and segment lengths of an episode played with `actions`, and its reward."""
    env = find_environment(name).factory()
    env.reset(seed)
    ids, turns, reward = [], [], 0.0
    for action in actions:
        step = env.step(action)
        ids += encode(action)
        turns.append(len(action))
        reward += step.reward
        if step.done:
            break
        ids += encode(step.observation)
        turns.append(len(step.observation))
    return ids, turns, reward


def test_a_verifiers_multi_turn_environment_is_played_step_by_step_and_scored_by_its_rubric():
    found = find_environment(GUESS)
    held, train = found.seeds
    assert (held, train) == (64, 700)  # its eval_dataset first, then its dataset
    assert found.version.endswith(f", verifiers {verifiers.__version__}")
    env = found.factory()
    assert env.max_turns == 2 and env.opening(0) == [{"role": "user", "content": "guess 1-3:"}]
    assert env.reset(0) == "guess 1-3:"  # the secret of seed 0 is 1
    step = env.step("2")
    assert step == episodes.Step("lower:", 0.0, False)
    assert env.step("1") == episodes.Step("", 1.0, True)  # found: the rubric's reward, at the end
    env.reset(0)
    assert env.step("3").observation == "lower:" and env.step("3") == episodes.Step("", 0.0, True)
    again = pickle.loads(pickle.dumps(found.factory))()  # a scoring worker loads it by name
    again.reset(1)
    assert again.step("1") == episodes.Step("higher:", 0.0, False)


def test_a_verifiers_single_turn_environment_keeps_its_system_prompt_parser_and_weights(
        monkeypatch):
    found = find_environment("verifiers:tests.envs.vf_sums")
    env = found.factory()
    assert env.max_turns == 1
    assert env.opening(0) == [{"role": "system", "content": "Add."},
                              {"role": "user", "content": "10+1="}]
    assert env.reset(0) == "Add.\n10+1="
    assert env.step("11") == episodes.Step("", 1.25, True)
    env.reset(0)
    assert env.step("12").reward == 0.25 and env.reset(0) and env.step("x").reward == 0.0


@pytest.mark.parametrize("name, seed, actions", [(GUESS, 1, ["1", "3"]),
                                                 (BLACKJACK, 103, ["1", "2"])])
def test_the_replay_catches_an_altered_observation_of_either_library(name, seed, actions):
    ids, turns, reward = played(name, seed, actions)
    assert len(turns) >= 3, "the episode needs an observation to alter"
    factory = find_environment(name).factory
    honest = episodes.replay(factory(), seed, ids, turns, decode_turn=decode_turn, encode=encode)
    assert honest == episodes.Replayed(reward)
    forged = list(ids)
    forged[turns[0]] = ord("X")  # the first observation's first character
    assert episodes.replay(factory(), seed, forged, turns, decode_turn=decode_turn,
                           encode=encode).fault == episodes.OBSERVATION


def test_a_gymnasium_text_environment_keeps_its_seed_and_ends_at_terminated():
    found = find_environment(BLACKJACK)
    assert found.version.endswith(f", gymnasium {gymnasium.__version__}")
    assert found.seeds is None
    first, again = found.factory(), pickle.loads(pickle.dumps(found.factory))()
    assert first.reset(7) == again.reset(7)
    step = first.step("2")  # stick: the hand is over
    assert step.done and step.observation == "" and step.reward in (-1.0, 0.0, 1.0)
    first.reset(7)
    assert first.step("hit me") == episodes.Step("", -2.0, True)  # the example's forfeit


@pytest.mark.parametrize("name, says", [
    ("gym:tests.envs.gym_flaky:Flaky", "is not deterministic given its seed: seed 0"),
    ("verifiers:tests.envs.vf_flaky", "is not deterministic given its seed: seed 0"),
    ("gym:tests.envs.gym_flaky:Numbers", "must observe text, but its reset(seed=0) returned 3"),
    ("gym:tests.envs.no_such_module:Env", "is not here (No module named 'tests.envs.no_such"),
    ("verifiers:no_such_environment", "Could not import 'no_such_environment'"),
])
def test_the_hub_refuses_an_environment_it_could_not_replay_in_one_sentence(name, says):
    with pytest.raises(ConfigError) as err:
        open_setup(HubConfig.from_flat(env=name))
    assert err.value.field == "env" and says in str(err.value)


def test_the_hub_serves_a_deterministic_one_and_its_rows_become_the_problems():
    setup = open_setup(HubConfig.from_flat(env=GUESS, eval_problems=8))
    assert setup.kind == "env:" + GUESS
    eval_problems = setup.task.problems("eval")
    assert len(eval_problems) == 64 and len(setup.task.problems("train")) == 700
    assert eval_problems[0].messages == [{"role": "user", "content": "guess 1-3:"}]


@pytest.mark.parametrize("name", [GUESS, BLACKJACK])
def test_a_peer_needs_the_version_the_hub_names(name):
    have = find_environment(name).version
    assert require_environment(name, have).version == have
    with pytest.raises(EnvironmentMissing, match="version 0.0.1 of the package"):
        require_environment(name, "0.0.1")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [GUESS, "verifiers:tests.envs.vf_sums", BLACKJACK])
async def test_a_real_run_trains_through_each_adapter(name, tmp_path):
    """Hub and a peer on the built-in take-away player: the peer plays each episode (every turn
    through the library's own environment), the hub's scoring workers replay it, and the
    learner steps on the rewards the replay gave, held-out episodes evaluated greedily."""
    cfg = small_cfg(tmp_path, env=name, model="tiny-takeaway", max_new_tokens=4, max_steps=3,
                    eval_every=3, eval_problems=8)
    async with start_hub(cfg, stream=None) as run, running_peers(run.url, 1, torch_threads=1):
        await run.finished.wait()
    steps = [r for r in run.records if "step" in r]
    assert len(steps) == 3 and steps[-1]["hub/score_failures_total"] == 0
    assert all(math.isfinite(r["train/reward_mean"]) for r in steps)
    assert not any(any(e.values()) for e in run.hub.statistics().trust_events.values())
    assert any(r.get("eval/accuracy") is not None for r in run.records)


@pytest.mark.timeout(300)
async def test_under_a_chat_template_observations_are_user_turns_on_both_planes(tmp_path):
    """The take-away player with a ChatML template: the hub wraps each verifiers observation
    in the template's user turn, the welcome tells the peer the same markup, and the hub's
    replay agrees with the peer's play on every episode (a peer that wrapped them otherwise
    would be refused with observation_mismatch)."""
    model, tokenizer = load_policy("tiny-takeaway")
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    cfg = small_cfg(tmp_path, env=GUESS, model=str(tmp_path / "model"), max_new_tokens=4,
                    max_steps=2, prompt_format="chat")
    async with start_hub(cfg, stream=None) as run, \
            running_peers(run.url, 1, torch_threads=1) as [peer]:
        await run.finished.wait()
    assert run.hub.setup.reward.turn == ("<|im_end|>\n<|im_start|>user\n",
                                         "<|im_end|>\n<|im_start|>assistant\n")
    assert (peer.welcome.env_turn_before, peer.welcome.env_turn_after) == run.hub.setup.reward.turn
    steps = [r for r in run.records if "step" in r]
    assert len(steps) == 2 and steps[-1]["hub/score_failures_total"] == 0
    assert not any(any(e.values()) for e in run.hub.statistics().trust_events.values())
