"""`echo2-hub plan`: the documented example, its arithmetic, and bad input named by field."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from echo2p2p.hub.cli import main

ROOT = Path(__file__).resolve().parents[2]


def documented_example() -> tuple[list[str], str]:
    """The command and output under README's plan-example marker."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- plan-example[^>]*-->\n```\n\$ (.+?)\n(.*?)\n```", readme, re.S)
    assert block, "README lost its plan example"
    argv = shlex.split(block.group(1))
    assert argv[0] == "echo2-hub"
    return argv[1:], block.group(2)


def run_plan(argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.chdir(ROOT)
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out.rstrip("\n"), out.err


def test_readme_example_is_what_the_command_prints(capsys, monkeypatch):
    argv, documented = documented_example()
    code, out, _ = run_plan(argv, capsys, monkeypatch)
    assert code == 0
    assert out == documented


def test_plan_json_is_consistent(capsys, monkeypatch):
    argv, _ = documented_example()
    code, out, _ = run_plan(argv + ["--json"], capsys, monkeypatch)
    p = json.loads(out)
    assert code == 0 and p["feasible"] and p["reading"] == "sequential"
    # sequential: kappa*R / (kappa*T_train - T_bcast), by hand from the printed T_bcast
    assert p["required_rollouts_per_s"] == pytest.approx(4 * 512 / (4 * 60 - p["bcast_s"]), rel=1e-3)
    cost = p["policies"]["cost-aware"]
    assert cost["rollouts_per_s"] >= 1.1 * p["required_rollouts_per_s"]
    assert p["lp_bound_per_hour"] <= cost["price_per_hour"] <= 1.02 * p["lp_bound_per_hour"]
    for other in ("activate-all", "fastest-first"):
        assert cost["price_per_hour"] <= p["policies"][other]["price_per_hour"]
    assert (8, 4) in [tuple(s) for s in p["feasible_schedules"]] and p["stale_frac"] == 0


def test_infeasible_broadcast_gives_a_verdict_not_a_number(capsys, monkeypatch):
    code, out, _ = run_plan(["plan", "--model-bytes", "16e9", "--train-step-s", "10",
                             "--max-lag", "1", "--publish-every", "1"], capsys, monkeypatch)
    assert code == 0
    assert "infeasible" in out and "raise kappa or S" in out and "policy" not in out


@pytest.mark.parametrize("flag, value, field", [
    ("--reading", "sideways", "reading"),
    ("--train-step-s", "0", "train_step_s"),
    ("--workers", "no/such.toml", "no/such.toml"),
])
def test_bad_input_is_named(capsys, monkeypatch, flag, value, field):
    code, _, err = run_plan(["plan", "--model-bytes", "1e9", flag, value], capsys, monkeypatch)
    assert code == 2 and field in err
