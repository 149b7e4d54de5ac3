"""The synchronous baseline: its defaults are the hub's (`train_sync`'s keyword defaults and
`python -m bench.sync_baseline`'s flags read `HubConfig`, so a bare baseline run is the S = 0
twin of a bare hub), and it scores held-out completions as the hub does."""

from __future__ import annotations

import inspect

import pytest

from echo2p2p.config import as_dict
from bench import sync_baseline
from echo2p2p.hub.config import HubConfig

SHARED = ("model", "lr", "prompts_per_step", "group_size", "max_new_tokens", "eval_problems",
          "eval_every", "temperature", "top_p", "weights_dtype", "score_timeout_s", "seed")


@pytest.mark.parametrize("knob", SHARED)
def test_train_sync_defaults_are_the_hubs(knob):
    """train_sync's keyword default for each knob the hub has equals HubConfig's."""
    param = inspect.signature(sync_baseline.train_sync).parameters[knob]
    assert param.default is not inspect.Parameter.empty, f"{knob} has no default"
    assert param.default == as_dict(HubConfig())[knob]


def test_command_line_defaults_are_the_hubs():
    """The command line with only --steps parses to HubConfig's value for every shared knob,
    prompt rendering included, with the hub's types."""
    args = vars(sync_baseline.parser().parse_args(["--steps", "3"]))
    hub = as_dict(HubConfig())
    for knob in (*SHARED, "prompt_format", "system_prompt", "chat_template_args"):
        assert args[knob] == hub[knob], knob
        assert type(args[knob]) is type(hub[knob]), knob
    assert args["steps"] == 3


def test_command_line_flags_still_override_the_defaults():
    """An explicit flag wins over the hub's default, parsed to the field's type."""
    args = sync_baseline.parser().parse_args(["--steps", "1", "--lr", "3e-4", "--group-size", "4",
                                          "--weights-dtype", "float32"])
    assert (args.lr, args.group_size, args.weights_dtype) == (3e-4, 4, "float32")


def test_held_out_accuracy_is_scored_for_real():
    """The shipped base answers part of the held-out set right, and the baseline's evaluation
    counts it: its scorer gets what the learner's evaluation hands it (not 0 for every
    completion, as when the reward is called with the wrong key)."""
    records = sync_baseline.train_sync(steps=1, prompts_per_step=2, group_size=4, eval_every=1,
                                   eval_problems=64)
    assert 0.05 < records[0]["eval_accuracy_initial"] < 1.0
    assert 0.0 < records[0]["reward_mean"] <= 1.0
