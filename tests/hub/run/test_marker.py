"""After a kill: the run dir's RUNNING marker outlives a hub that died without a word, and the
next start in that run dir says what happened, the checkpoint a resume goes back to and the
exact command; a hub that ends in any way Python sees leaves no marker."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from echo2p2p.hub import Run
from echo2p2p.hub.run.marker import MARKER, running, unclean_notice
from echo2p2p.hub.run.start import start_hub

HOW = "echo2-hub demo --resume runs/r"


def dead_pid() -> int:
    """The id of a process that has exited (and was reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_the_marker_goes_when_the_hub_ends_in_any_way_python_sees(tmp_path):
    with running(tmp_path, HOW):
        facts = json.loads((tmp_path / MARKER).read_text())
        assert facts["resume"] == HOW and facts["pid"] > 0
    assert not (tmp_path / MARKER).exists()
    with pytest.raises(RuntimeError), running(tmp_path, HOW):
        raise RuntimeError("a bug, with its traceback")
    assert not (tmp_path / MARKER).exists()
    assert unclean_notice(tmp_path, 3) is None  # stopped cleanly: nothing to say


def test_a_marker_left_by_a_dead_hub_says_what_happened_and_how_to_resume(tmp_path):
    (tmp_path / MARKER).write_text(json.dumps({"pid": dead_pid(), "started": "15:00",
                                               "resume": HOW}))
    notice = unclean_notice(tmp_path, 14)
    assert "did not stop cleanly" in notice and "OOM killer" in notice
    assert "its last checkpoint, v14" in notice and notice.endswith(f"resume with: {HOW}")
    assert "left no checkpoint" in unclean_notice(tmp_path, None)


async def test_the_next_start_in_a_killed_runs_dir_warns(tmp_path, caplog):
    """A start (here a resume) in the run dir of a hub killed without a word logs the notice
    before it loads anything, with the last checkpoint's version and the command."""
    run_dir = tmp_path / "run"
    run = Run(port=0, run_dir=str(run_dir), max_steps=0, eval_every=0, torch_threads=1)
    cfg, sources = run.resolved()
    async with start_hub(cfg, sources=sources):
        pass  # v0 published and checkpointed
    (run_dir / MARKER).write_text(json.dumps({"pid": dead_pid(), "started": "15:00",
                                              "resume": HOW}))
    with caplog.at_level(logging.WARNING, logger="echo2p2p.hub.run.start"):
        async with start_hub(cfg, sources=sources, resume=True):
            pass
    said = [r.getMessage() for r in caplog.records if "did not stop cleanly" in r.getMessage()]
    assert len(said) == 1 and "v0" in said[0] and HOW in said[0]
