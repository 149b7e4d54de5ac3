"""README's "Your model, your data": its two commands run as written, and its defaults are true.

The commands are read out of README.md under the recipe marker, run from a directory holding
`./my-model` (a model directory written by `save_pretrained`: the built-in tiny model's, saved
afresh) and `./my-data.jsonl`, with three flags appended so a CPU finishes in seconds: a free
port for the hub (and the peer's URL on it), `--max-steps 2` and a shorter completion cap. The
defaults table is checked against the parser, whose defaults are the config's (the built-in tiny
model's), and its "your model" column against the rule that derives values from a model's size
(hub/config_presets.py): the flags it says are derived are exactly the derived fields, at the
values stated for a 1 B model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from echo2p2p.hub.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def recipe() -> tuple[list[str], list[str]]:
    """The hub's and the peer's command lines under the README's recipe marker."""
    block = re.search(r"<!-- recipe:[^>]*-->\n```sh\n(.*?)\n```", README, re.S)
    assert block, "README lost its recipe"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    hub = [shlex.split(line) for line in lines if line.startswith("echo2-hub serve ")]
    peer = [shlex.split(line) for line in lines if line.startswith("echo2-peer join ")]
    assert len(hub) == 1 and len(peer) == 1, lines
    return hub[0], peer[0]


def documented_rows() -> list[tuple[str, str, str]]:
    """(flag, default, "your model" cell) of each row of the README's table of defaults."""
    table = re.search(r"<!-- recipe-defaults[^>]*-->\n(.*?)\n\n", README, re.S)
    assert table, "README lost its table of defaults"
    return re.findall(r"^\| `(--[a-z-]+)` \| `([^`]*)` \| ([^|]*) \|", table.group(1), re.M)


def documented_defaults() -> dict[str, str]:
    return {flag: default for flag, default, _ in documented_rows()}


def flags_hook():
    """docs/hooks/flags.py, the flag reference's generator."""
    spec = importlib.util.spec_from_file_location("flags_hook", ROOT / "docs/hooks/flags.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def parser_defaults() -> dict[str, str]:
    """Each `serve` flag's default as the flag reference renders it (docs/hooks/flags.py)."""
    hook = flags_hook()
    serve = hook.subcommand("echo2-hub", "serve")
    return {flag: hook._help_and_default(action)[1].strip("`")
            for action in serve._actions for flag in action.option_strings}


def same_value(a: str, b: str) -> bool:
    """'cpu' is cpu, 1e-3 is 0.001: the help may quote or format a default either way."""
    a, b = a.strip("'\""), b.strip("'\"")
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def test_documented_defaults_are_the_parsers():
    documented, actual = documented_defaults(), parser_defaults()
    assert {"--lr", "--max-new-tokens", "--group-size", "--prompts-per-step"} <= set(documented)
    for flag, default in documented.items():
        assert same_value(actual[flag], default), (flag, actual[flag], default)


def test_documented_model_values_are_the_rule():
    """A row's "your model" cell is "the same" for a field the size rule leaves alone, else
    the rule's value for a 1 B model, in backticks."""
    from echo2p2p.hub.config_presets import derive

    serve = flags_hook().subcommand("echo2-hub", "serve")
    dests = {flag: action.dest for action in serve._actions for flag in action.option_strings}
    derived, said = derive(1_000_000_000), {}
    for flag, _, cell in documented_rows():
        if cell.strip() == "the same":
            assert dests[flag] not in derived, (flag, "is derived from the model's size")
        else:
            said[dests[flag]] = re.match(r"`([^`]*)`", cell.strip()).group(1)
    assert set(said) == set(derived), (said, derived)
    for field, value in said.items():
        assert same_value(value, str(derived[field])), (field, value, derived[field])


def test_recipe_flags_exist():
    hub, _ = recipe()
    build_parser().parse_args(hub[1:])  # an unknown flag or a bad value exits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(argv: list[str]) -> list[str]:
    """The console script as installed beside this Python (the venv's), else on PATH."""
    found = shutil.which(argv[0], path=f"{Path(sys.executable).parent}{os.pathsep}"
                                       f"{os.environ.get('PATH', '')}")
    assert found, f"{argv[0]} is not installed"
    return [found, *argv[1:]]


def write_model_and_data(where: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2p2p.policy.model import builtin_dir

    AutoModelForCausalLM.from_pretrained(builtin_dir()).save_pretrained(where / "my-model")
    AutoTokenizer.from_pretrained(builtin_dir()).save_pretrained(where / "my-model")
    rng = random.Random(0)
    with open(where / "my-data.jsonl", "w") as f:
        for _ in range(64):
            a, b = rng.randrange(10, 100), rng.randrange(10, 100)
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


@pytest.mark.system  # a hub and a peer process, as a user starts them
def test_recipe_trains_as_written(tmp_path):
    hub_argv, peer_argv = recipe()
    write_model_and_data(tmp_path)
    port = free_port()
    hub_argv = hub_argv + ["--port", str(port), "--max-steps", "2", "--max-new-tokens", "16"]
    peer_argv = [a.replace(":8765/", f":{port}/") for a in peer_argv]
    assert f":{port}/" in " ".join(peer_argv), "the peer's URL is not the hub's default port"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "hub.log", "w") as hub_log, open(tmp_path / "peer.log", "w") as peer_log:
        hub = subprocess.Popen(command(hub_argv), cwd=tmp_path, env=env, stdout=hub_log,
                               stderr=subprocess.STDOUT)
        peer = subprocess.Popen(command(peer_argv), cwd=tmp_path, env=env, stdout=peer_log,
                                stderr=subprocess.STDOUT)
        try:
            code = hub.wait(timeout=240)
        finally:
            for proc in (hub, peer):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
    log = (tmp_path / "hub.log").read_text()
    assert code == 0, log[-3000:] + (tmp_path / "peer.log").read_text()[-3000:]
    [metrics] = list((tmp_path / "runs").glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "train/reward_mean" in r]
    assert len(steps) == 2, records
    config = json.loads(next(metrics.parent.glob("config.json")).read_text())
    assert "my-model" in json.dumps(config) and "my-data.jsonl" in json.dumps(config)


def test_getting_started_shows_the_same_recipe():
    """The site's getting-started page repeats the README's recipe: the same two commands."""
    page = (ROOT / "docs" / "getting-started.md").read_text().replace("\\\n", " ")
    for argv in recipe():
        assert " ".join(argv) in " ".join(page.split()), argv[:2]


def try_it() -> tuple[list[str], float, float, int]:
    """README's "Try it": its demo command, and what it says the run shows: the base policy's
    held-out accuracy, and about what after how many learner steps."""
    section = re.search(r"## Try it\n(.*?)\n## ", README, re.S)
    assert section, "README lost its Try it section"
    command_line = re.search(r"```sh\n(.*?)\n```", section.group(1), re.S).group(1)
    demo = [shlex.split(part) for part in command_line.split("&&") if "echo2-hub" in part]
    said = re.search(r"answers (0\.\d+) of the held-out sums correctly, about (0\.\d+)\s+"
                     r"after (\d+) learner steps", section.group(1))
    assert len(demo) == 1 and said, "README's Try it lost its command or its figures"
    return demo[0], float(said.group(1)), float(said.group(2)), int(said.group(3))


@pytest.mark.system  # the demo as a user starts it: a hub and 2 peer processes, a few steps
def test_try_it_shows_what_the_readme_says(tmp_path):
    """The held-out accuracy of the base policy is the README's (greedy, a fixed held-out set),
    and after its number of steps within 0.08 of its "about" figure (three standard errors
    of a 256-problem accuracy). The terminal shows a line a step and the dashboard's address."""
    argv, base, about, steps = try_it()
    with open(tmp_path / "demo.log", "w") as out:
        done = subprocess.run(command(argv) + ["--max-steps", str(steps)], cwd=tmp_path,
                              stdout=out, stderr=subprocess.STDOUT, timeout=300,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log = (tmp_path / "demo.log").read_text()
    assert done.returncode == 0, log[-3000:]
    assert re.search(r"dashboard on http://127\.0\.0\.1:\d+/", log), log[-3000:]
    assert len(re.findall(r"^step +\d+ +v\d+ +reward", log, re.M)) == steps, log[-3000:]
    [metrics] = list((tmp_path / "runs").glob("*/metrics.jsonl"))
    records = map(json.loads, metrics.read_text().splitlines())
    evals = [(r.get("version"), r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    assert evals[0] == (0, base), evals
    assert evals[-1][0] == steps and abs(evals[-1][1] - about) <= 0.08, evals


def test_getting_started_states_the_size_rule_at_135m():
    """Getting started's "(LR and TOKENS at 135 M)" is the size rule's value for SmolLM2-135M."""
    from echo2p2p.hub.config_presets import derive

    page = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    said = re.search(r"\(([\d.e-]+) and (\d+) at 135 M\)", page)
    assert said, "getting started lost its 135 M example"
    derived = derive(135_000_000)
    assert (float(said.group(1)), int(said.group(2))) == (derived["lr"], derived["max_new_tokens"])


def serve_and_demo_flags() -> tuple[set[str], set[str]]:
    """The option strings `echo2-hub serve` and `echo2-hub demo` take, from their parsers."""
    hook = flags_hook()
    return tuple(set(hook.subcommand("echo2-hub", name)._option_string_actions)
                 for name in ("serve", "demo"))


def test_demo_takes_every_serve_flag_getting_started_says_it_takes():
    """Getting started: "`echo2-hub demo --peers N` ... stopping after `--max-steps` (N by
    default); it takes every flag `serve` takes[ but X]": true of the parsers."""
    from echo2p2p.hub.config import DEMO_DEFAULTS

    page = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    said = re.search(r"stopping after `--max-steps` \((\d+) by default\); it takes every flag "
                     r"`serve` takes(?: but ((?:`--[a-z-]+`(?:, | and )?)+)|, [^.]*)\.", page)
    assert said, "getting started lost what demo takes"
    serve, demo = serve_and_demo_flags()
    assert serve - demo == set(re.findall(r"`(--[a-z-]+)`", said.group(2) or ""))
    assert DEMO_DEFAULTS["max_steps"] == int(said.group(1))


def test_flag_reference_says_what_demo_adds_and_lacks():
    """The flag reference: "`echo2-hub demo` takes the same flags[ but X], plus Y ... for its
    local peers, and stops after N steps"."""
    from echo2p2p.hub.config import DEMO_DEFAULTS

    page = " ".join((ROOT / "docs" / "reference" / "flags.md").read_text().split())
    said = re.search(r"`echo2-hub demo` takes the same flags(?: but (.*?))?, plus (.*?) for its local "
                     r"peers, and stops after (\d+) steps", page)
    assert said, "the flag reference lost what demo takes"
    serve, demo = serve_and_demo_flags()
    flags = [set(re.findall(r"`(--[a-z-]+)", said.group(i) or "")) for i in (1, 2)]
    assert (serve - demo, demo - serve) == tuple(flags)
    assert DEMO_DEFAULTS["max_steps"] == int(said.group(3))
