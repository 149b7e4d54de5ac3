"""`echo2-hub plan`: the documented example, its arithmetic, and bad input named by field."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from echo2p2p.hub.cli import main

ROOT = Path(__file__).resolve().parents[3]


def documented_example() -> tuple[list[str], str]:
    """The command and output under the capacity planner guide's plan-example marker."""
    page = (ROOT / "docs" / "guides" / "capacity.md").read_text()
    block = re.search(r"<!-- plan-example[^>]*-->\n```\n\$ (.+?)\n(.*?)\n```", page, re.S)
    assert block, "docs/guides/capacity.md lost its plan example"
    argv = shlex.split(block.group(1))
    assert argv[0] == "echo2-hub"
    return argv[1:], block.group(2)


def run_plan(argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.chdir(ROOT)
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out.rstrip("\n"), out.err


def test_documented_example_is_what_the_command_prints(capsys, monkeypatch):
    argv, documented = documented_example()
    code, out, _ = run_plan(argv, capsys, monkeypatch)
    assert code == 0
    assert out == documented


def test_plan_json_is_consistent(capsys, monkeypatch):
    argv, _ = documented_example()
    code, out, _ = run_plan(argv + ["--json"], capsys, monkeypatch)
    p = json.loads(out)
    assert code == 0 and p["feasible"] and p["reading"] == "sequential"
    # sequential: kappa*R / (kappa*T_train - T_bcast), by hand from the printed T_bcast, which
    # counts the publication (the version is announced once its last chunk is coded)
    kappa = p["kappa"]
    assert p["required_rollouts_per_s"] == pytest.approx(
        kappa * 512 / (kappa * p["t_train_s"] - p["bcast_s"]), rel=1e-3)
    assert 0 < p["publish_s"] < p["bcast_s"]
    cost = p["policies"]["cost-aware"]
    assert cost["rollouts_per_s"] >= 1.1 * p["required_rollouts_per_s"]
    # the LP relaxes whole workers into fractions: 3.4 % below the integer choice here
    assert p["lp_bound_per_hour"] <= cost["price_per_hour"] <= 1.05 * p["lp_bound_per_hour"]
    for other in ("activate-all", "fastest-first"):
        assert cost["price_per_hour"] <= p["policies"][other]["price_per_hour"]
    assert (9, 5) in [tuple(s) for s in p["feasible_schedules"]] and p["stale_frac"] == 0
    assert p["learner_ranks"] == 4 and p["learner_fits"] and p["least_learner_ranks"] == 2


def test_infeasible_broadcast_gives_a_verdict_not_a_number(capsys, monkeypatch):
    code, out, _ = run_plan(["plan", "--model-bytes", "16e9", "--train-step-s", "10",
                             "--max-lag", "1", "--publish-every", "1"], capsys, monkeypatch)
    assert code == 0
    assert "infeasible" in out and "raise kappa or S" in out and "policy" not in out


def plan_json(capsys, monkeypatch, *flags: str) -> dict:
    code, out, _ = run_plan(["plan", "--model-bytes", "16e9", "--json", *flags], capsys, monkeypatch)
    assert code == 0
    return json.loads(out)


def test_more_learner_ranks_shorten_t_train_and_fit_the_state(capsys, monkeypatch):
    """A step measured at 60 s on 1 rank takes 60 / 4 / 0.9^2 s on 4 (two doublings at 0.9);
    16 bytes a parameter of an 8 B model fit an 80 GB GPU from 2 ranks on, not on 1."""
    one = plan_json(capsys, monkeypatch, "--learner-memory-gb", "80")
    four = plan_json(capsys, monkeypatch, "--learner-memory-gb", "80", "--learner-ranks", "4",
                     "--train-step-ranks", "1")
    assert one["t_train_s"] == 60 and four["t_train_s"] == pytest.approx(60 / 4 / 0.81, abs=1e-3)
    assert one["learner_gb_per_rank"] == 128 and not one["learner_fits"]
    assert four["learner_gb_per_rank"] == 32 and four["learner_fits"]
    assert one["least_learner_ranks"] == four["least_learner_ranks"] == 2


def test_publication_time_is_part_of_the_broadcast(capsys, monkeypatch):
    """Gathering the shards over the interconnect and coding on the hub's cores come before the
    first chunk can leave: fewer cores or a slower interconnect lengthen T_bcast by as much."""
    base = plan_json(capsys, monkeypatch, "--learner-ranks", "4")
    few_cores = plan_json(capsys, monkeypatch, "--learner-ranks", "4", "--hub-cores", "2")
    slow_link = plan_json(capsys, monkeypatch, "--learner-ranks", "4", "--interconnect-gbps", "10")
    one_rank = plan_json(capsys, monkeypatch)
    spread = base["bcast_s"] - base["publish_s"]
    for other in (few_cores, slow_link, one_rank):
        assert other["bcast_s"] - other["publish_s"] == pytest.approx(spread, abs=0.02)
    assert few_cores["publish_s"] > base["publish_s"] > one_rank["publish_s"]
    # 3/4 of 4 bytes a parameter gathered: 9.6 s more at 10 Gbit/s than at 100
    assert slow_link["publish_s"] - base["publish_s"] == pytest.approx(
        4 * 8e9 * 0.75 * 8 * (1 / 10e9 - 1 / 100e9), abs=0.02)


def test_the_learners_memory_counts_activations_when_the_model_is_named(capsys, monkeypatch):
    """With --model the plan knows the layers: a larger micro-batch or no checkpointing costs
    memory; with only --model-bytes it says it counted the state alone."""
    def gb(*flags: str) -> float:
        code, out, _ = run_plan(["plan", "--model", "tiny", "--json", *flags], capsys, monkeypatch)
        return json.loads(out)["learner_gb_per_rank"]
    assert gb("--micro-tokens", "65536") > gb() > gb("--checkpointing")
    code, out, _ = run_plan(["plan", "--model-bytes", "16e9"], capsys, monkeypatch)
    assert "state only" in out


@pytest.mark.parametrize("flag, value, field", [
    ("--learner-efficiency", "1.5", "learner_efficiency"),
    ("--learner-ranks", "0", "learner_ranks"),
    ("--reading", "sideways", "reading"),
    ("--train-step-s", "0", "train_step_s"),
    ("--workers", "no/such.toml", "no/such.toml"),
])
def test_bad_input_is_named(capsys, monkeypatch, flag, value, field):
    code, _, err = run_plan(["plan", "--model-bytes", "1e9", flag, value], capsys, monkeypatch)
    assert code == 1 and field in err


def test_gossip_is_planned_like_the_tracker_and_an_unknown_relay_is_named(capsys, monkeypatch):
    """The hub's strategies are the plan's: gossip's T_bcast is the overlay's bound like the
    tracker's, star's is N copies from the hub; anything else names the field."""
    base = ["plan", "--model-bytes", "1e9", "--json", "--workers", "examples/workers.toml"]
    times = {}
    for relay in ("pipelined", "gossip", "star"):
        code, out, _ = run_plan(base + ["--relay", relay], capsys, monkeypatch)
        assert code == 0
        times[relay] = json.loads(out)["bcast_s"]
    assert times["gossip"] == times["pipelined"] < times["star"]
    code, _, err = run_plan(base + ["--relay", "carrier-pigeon"], capsys, monkeypatch)
    assert code == 1 and "relay" in err and "gossip" in err
