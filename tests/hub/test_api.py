"""The Python API (`echo2p2p.hub.Run`): the CLI's fields and defaults, and users' own rewards
and rows driving a real hub with real peers."""

from __future__ import annotations


import pytest

from echo2p2p.errors import ConfigError
from echo2p2p.hub import Run
from echo2p2p.hub.cli import build_parser, load_config
from echo2p2p.hub.config import DEMO_DEFAULTS, HubConfig
from echo2p2p.hub.run.start import start_hub
from echo2p2p.tasks import RecordsTask

from tests.conftest import running_peers, within

QUARTER = 0.25


def quarter(prompt: str, completion: str, row: dict) -> float:
    """The same reward for everything: what the hub trained on tells whose reward it used."""
    return QUARTER


def fragile(prompt: str, completion: str, row: dict) -> float:
    """Adds nothing, but raises on a hedged answer (the tiny base hedges often)."""
    if "?" in completion:
        raise ValueError("a hedge")
    return 0.0


def row_score(prompt: str, completion: str, row: dict) -> float:
    return float(row["score"])


def test_run_takes_the_cli_fields_with_the_same_defaults():
    """One source of defaults: `Run()` is `serve` with no flags, `Run(**demo)` is `demo`."""
    assert Run().config == HubConfig() == load_config(build_parser().parse_args(["serve"]))
    demo = load_config(build_parser().parse_args(["demo"]), DEMO_DEFAULTS)
    assert Run(**DEMO_DEFAULTS).config == demo
    assert Run(max_lag=3, lr=1e-4).config == HubConfig().replace(max_lag=3, lr=1e-4)


@pytest.mark.parametrize("fields, field", [
    ({"max_lag": -1}, "max_lag"), ({"group_size": 1}, "group_size"),
    ({"no_such_knob": 1}, "no_such_knob"), ({"reward_weights": "1"}, "reward_weights"),
    ({"env": "takeaway", "task": "examples/sums.jsonl"}, "env"),
])
def test_a_bad_field_is_a_config_error_naming_it(fields, field):
    with pytest.raises(ConfigError) as err:
        Run(**fields)
    assert err.value.field == field


def test_rows_become_a_task_with_a_fixed_split_and_their_rows_reach_the_reward():
    rows = [{"prompt": f"{i}+0=", "answer": str(i), "score": i / 100} for i in range(100)]
    setups = [Run(dataset=rows, reward=row_score, seed=seed, eval_problems=20).setup()
              for seed in (0, 1)]
    task = setups[0].task
    assert isinstance(task, RecordsTask) and setups[0].kind == "custom"
    assert len(task.problems("eval")) == 20 and len(task.problems("train")) == 80
    assert [p.id for p in task.problems("eval")] == [p.id for p in setups[1].task.problems("eval")]
    problem = task.problems("train")[0]
    assert setups[0].reward(problem, "anything") == problem.row["score"]


def test_a_reward_name_that_cannot_load_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot import"):
        Run(reward="no_such_module:f").setup()


@pytest.mark.timeout(300)
async def test_a_user_reward_scores_a_real_run_and_peers_claims_are_not_held_against_them(tmp_path):
    """Peers cannot score a user's functions (they never leave the hub): they claim 0, the hub
    scores with the functions, and nobody is distrusted for the difference. A function that
    raises makes its sample score 0, counted in the run log, and the run goes on."""
    run = Run(reward=[quarter, fragile], port=0, prompts_per_step=4, group_size=4, eval_every=0,
              max_steps=3, run_dir=str(tmp_path / "run"), torch_threads=1)
    async with start_hub(run.config, setup=run.setup()) as hub_run, \
            running_peers(hub_run.url, 1, torch_threads=1) as [peer]:
        await hub_run.finished.wait()
        await within(peer.wait_welcomed(), 30, "the peer's welcome")
        assert peer.welcome.task == "custom" and peer.worker.reward is None
    steps = [r for r in hub_run.records if "step" in r]
    assert len(steps) == 3
    assert steps[-1]["hub/score_failures_total"] > 0
    assert all(0 < r["train/reward_mean"] <= QUARTER for r in steps)  # 0.25 or, raised, 0
    assert not any(any(e.values()) for e in hub_run.hub.statistics().trust_events.values())


@pytest.mark.system
def test_a_script_that_configured_no_logging_is_told_the_dashboard_url(tmp_path):
    """`Run(...).demo()` from a plain script prints "dashboard on http://..." on stdout, as the
    CLI's log does (a script's own logging would show it instead)."""
    import subprocess
    import sys

    script = ("from echo2p2p.hub import Run\n"
              "if __name__ == '__main__':\n"
              f"    Run(max_steps=1, eval_every=0, run_dir={str(tmp_path / 'run')!r}).demo(peers=1)\n")
    (tmp_path / "script.py").write_text(script)
    done = subprocess.run([sys.executable, str(tmp_path / "script.py")], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line for line in done.stdout.splitlines()
            if line.startswith("dashboard on http://127.0.0.1:")], done.stdout
