"""The adapter-cost bench measures real scoring (`bench.adapter_cost`): on tiny sizes every
sample of every arm scores OK, native and adapter agree with the episodes as played, and its
check notices when they do not."""

from __future__ import annotations

import json

import pytest

from bench import adapter_cost
from echo2p2p.completions import CompletionDecoder
from echo2p2p.policy.model import load_policy
from echo2p2p.scoring.rewards import EpisodeReplay


def test_every_arm_scores_its_samples_and_native_agrees_with_adapter(capsys):
    result = adapter_cost.main(["--groups", "2", "--rounds", "2", "--pool", "1",
                                "--cold-repeats", "0"])
    assert result["faults"] == 0, result["fault_samples"]
    assert result["agree"] is True
    for arm in adapter_cost.ARMS:
        checked, timed = result["checked"][arm], result["ms_per_group"][arm]
        assert checked["samples"] == adapter_cost.G and checked["agree"]
        assert len(checked["rewards"]) >= 2, f"{arm}: the script played one outcome only"
        assert timed["native"] > 0 and timed["adapter"] > 0 and timed["ratio"] > 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["bench"] == "adapter_cost" and last["ms_per_group"] == result["ms_per_group"]


class OffByOne(adapter_cost.NativeGuess):
    """The guessing game with another secret per seed: not the verifiers environment's."""

    def reset(self, seed: int) -> str:
        return super().reset(seed + 1)


def test_the_check_catches_a_native_that_is_not_the_adapters_game():
    _model, tokenizer = load_policy("tiny-takeaway", weights=False)
    decoder = CompletionDecoder(tokenizer)
    arm = adapter_cost.build("vf multi", 2, decoder)
    assert adapter_cost.check(arm, decoder)["agree"]
    arm.native = EpisodeReplay(OffByOne)
    checked = adapter_cost.check(arm, decoder)
    assert not checked["agree"] or checked["faults"]


@pytest.mark.system
def test_one_time_costs_come_from_fresh_processes_that_pass_the_determinism_check():
    """Each library's steps ran (a failed determinism check would fail its process)."""
    costs = adapter_cost.one_time(1)
    assert set(costs) == set(adapter_cost.COLD)
    for library, steps in adapter_cost.COLD.items():
        assert list(costs[library]) == [label for label, _ in steps if label]
    assert costs["verifiers"]["import"] > 0 and costs["gymnasium"]["check gym"] > 0
