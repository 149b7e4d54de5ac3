"""A new user's start-up mistakes, made as a user makes them: `echo2-hub` and `echo2-peer` run as
subprocesses, with a port really held by another socket and real files. Each mistake is one line
on stderr naming the cause and the fix, exit code 1 (argparse's usage errors: 2), no traceback
(unless --debug), and nothing left behind. Each command fails before any model loads: seconds.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from echo2p2p.hub import cli as hub_cli
from echo2p2p.peer import cli as peer_cli
from echo2p2p.policy.model import looks_like_path

ROOT = Path(__file__).resolve().parents[3]


def run(cwd: Path, *argv: str, program: str = "echo2p2p.hub.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", program, *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def one_line(done: subprocess.CompletedProcess, prefix: str = "echo2-hub") -> str:
    """The failure's one line on stderr (asserting that it is one, prefixed, exit code 1)."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"{prefix}:"), lines
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process would hold: bound and listening on 127.0.0.1."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        yield held.getsockname()[1]


@pytest.mark.parametrize("command, flag", [("serve", "--port"), ("demo", "--dashboard-port"),
                                           ("serve", "--dashboard-port")])
def test_a_busy_port_is_one_line_and_leaves_no_run_directory(tmp_path, busy_port, command, flag):
    """A busy peers' or dashboard port fails the start before the run directory is made or the
    model loads, naming the port, the address and the flag that changes it."""
    other = ["--port", "0"] if flag != "--port" else []
    done = run(tmp_path, command, flag, str(busy_port), *other, "--run-dir",
               str(tmp_path / "run"), "--max-steps", "1")
    line = one_line(done)
    assert f"port {busy_port} on 127.0.0.1 is in use" in line and f"pass {flag} N" in line
    assert list(tmp_path.iterdir()) == []  # no run directory, no runs/


def test_a_start_that_fails_after_making_its_run_directory_removes_it(tmp_path):
    """A new run's directory (runs/ too, when the start made it) goes again when the start fails
    before serving: here the tiny model has no chat template for --prompt-format chat, which is
    found once the tokenizer has loaded, after the run directory was made."""
    line = one_line(run(tmp_path, "serve", "--prompt-format", "chat", "--port", "0",
                        "--log-level", "warning"))
    assert "'prompt_format'" in line and "chat template" in line
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback(tmp_path, busy_port):
    """--debug trades the one line for the traceback, with the same exit code."""
    done = run(tmp_path, "serve", "--port", str(busy_port), "--run-dir", str(tmp_path / "run"),
               "--debug")
    assert done.returncode == 1 and "Traceback" in done.stderr and "is in use" in done.stderr
    assert list(tmp_path.iterdir()) == []


needs_no_cuda = pytest.mark.skipif(
    __import__("torch").cuda.device_count() > 0, reason="this machine can use --device cuda")


@needs_no_cuda
@pytest.mark.parametrize("argv", [["--device", "cuda"],
                                  ["--config", str(ROOT / "examples" / "math.toml")]])
def test_cuda_on_a_cpu_only_torch_is_named_at_config_time(tmp_path, argv):
    """--device cuda (or an example config that sets it) without CUDA names the field and the
    fix before anything loads."""
    line = one_line(run(tmp_path, "serve", *argv, "--port", "0"))
    assert "'device'" in line and "--device cpu" in line
    assert list(tmp_path.iterdir()) == []


@needs_no_cuda
def test_a_peer_with_cuda_on_a_cpu_only_torch_stops_before_joining(tmp_path):
    """The peer checks --device before it dials: no hub listens at the URL given, so a peer
    that tried to join would retry instead of exiting."""
    line = one_line(run(tmp_path, "join", "127.0.0.1:9", "--device", "cuda",
                        program="echo2p2p.peer.cli"), prefix="echo2-peer")
    assert "'device'" in line and "--device cpu" in line


def test_a_missing_local_model_is_named_as_a_path(tmp_path):
    """A local path that does not exist is named as one, with what a hub id looks like,
    instead of Hugging Face's "Repo id must be in the form"."""
    line = one_line(run(tmp_path, "serve", "--model", "./my-model", "--port", "0"))
    assert "no such directory or file ./my-model" in line and "HuggingFaceTB/" in line
    assert "Repo id" not in line


@pytest.mark.parametrize("name, is_path", [
    ("./x", True), ("../models/x", True), ("/abs/x", True), ("~/x", True), ("a/b/c", True),
    ("model.gguf", True), ("dir/", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", False),
    ("gpt2", False), ("Qwen/Qwen3-0.6B", False)])
def test_what_counts_as_a_local_path(name, is_path):
    """Hugging Face ids (org/name, name) stay ids; anything only a path can look like is one."""
    assert looks_like_path(name) is is_path


@pytest.mark.parametrize("command", ["serve", "plan"])
def test_a_toml_syntax_error_names_the_file_and_line(tmp_path, command):
    bad = tmp_path / "x.toml"
    bad.write_text("[hub]\nmax_lag = 3\nlr = \n")
    line = one_line(run(tmp_path, command, "--config", "x.toml"))
    assert "x.toml: line 3" in line


def test_a_mistyped_flag_gets_the_subcommands_usage_and_a_suggestion(tmp_path):
    """argparse's usage error (exit 2), but the subcommand's short usage and the closest flag."""
    done = run(tmp_path, "serve", "--max-lagg", "3")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("usage: echo2-hub serve [options]\n")
    assert "did you mean --max-lag?" in done.stderr and len(done.stderr.splitlines()) == 2
    peer = run(tmp_path, "join", "127.0.0.1:9", "--devise", "cpu", program="echo2p2p.peer.cli")
    assert peer.returncode == 2 and "did you mean --device?" in peer.stderr


def test_a_subcommands_flag_before_the_subcommand_is_pointed_at(capsys):
    with pytest.raises(SystemExit) as exit_:
        hub_cli.main(["--debug", "serve"])
    assert exit_.value.code == 2
    assert "--debug goes after the subcommand: echo2-hub serve --debug" in capsys.readouterr().err


def test_token_files_that_are_not_there_and_a_revocation_are_said(tmp_path):
    line = one_line(run(tmp_path, "token", "list", "--file", "nosuch.json"))
    assert "no token file nosuch.json" in line and "token create" in line
    assert run(tmp_path, "token", "create", "--file", "t.json").returncode == 0
    token_id = run(tmp_path, "token", "list", "--file", "t.json").stdout.split()[0]
    done = run(tmp_path, "token", "revoke", token_id, "--file", "t.json")
    assert done.returncode == 0 and done.stdout.startswith(f"revoked {token_id} in t.json")


def test_plan_outside_the_repository_needs_no_workers_file(tmp_path):
    """Without --workers the plan still gives the throughput, and says what to pass for the
    choice of workers (examples/workers.toml is not there outside the repository)."""
    done = run(tmp_path, "plan", "--model-bytes", "1e9")
    assert done.returncode == 0, done.stderr
    assert "needs >=" in done.stdout and "pass --workers FILE" in done.stdout


@pytest.mark.parametrize("module", [hub_cli, peer_cli])
def test_help_describes_the_command_in_whole_sentences(module):
    """`--help`'s description is the docstring's first paragraph, not its first line."""
    description = module.build_parser().description
    assert description.rstrip().endswith(".") and description in module.__doc__


@pytest.mark.parametrize("made, why", [(True, "it has no config.json"),
                                       (False, "no such directory")])
def test_resume_without_a_run_says_what_is_there(tmp_path, made, why):
    """`serve --resume DIR` where no run was saved: one line saying what DIR is (an empty folder,
    or none at all) and what --resume takes; nothing is made there."""
    target = tmp_path / "old-run"
    if made:
        target.mkdir()
    line = one_line(run(tmp_path, "serve", "--resume", str(target)))
    assert f"no run to resume in {target}: {why}" in line and "--resume the run directory" in line
    assert [p.name for p in tmp_path.iterdir()] == (["old-run"] if made else [])
    assert not made or list(target.iterdir()) == []
