"""The run log's live lines: what the terminal shows of each step."""

from __future__ import annotations

import io

from echo2p2p.hub.view.runlog import LEGEND, RunLog


def record(step: int) -> dict:
    return {"step": step, "version": step + 1, "train/reward_mean": 0.5,
            "rollout/staleness_hist": {"0": 2, "2": 6}, "rollout/per_s": 42.25,
            "hub/learner_busy_frac": 0.5, "hub/peers": 2}


def test_the_first_line_is_the_legend_of_the_columns_then_one_line_a_step(tmp_path):
    """A legend line, once, before the first step line, says what lag a/b/c, admitted/s and
    busy are (and their 60 s window); each step is one line in those terms."""
    stream = io.StringIO()
    log = RunLog(tmp_path, {}, stream=stream)
    log.step(record(0))
    log.step(record(1))
    log.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == LEGEND and len(lines) == 3
    assert all(word in LEGEND for word in ("lag a/b/c", "versions behind", "admitted/s", "60 s"))
    assert "lag 2/0/6" in lines[1] and "admitted/s    42.2" in lines[1]


def test_a_slow_real_model_rate_keeps_two_significant_figures(tmp_path):
    """A real model's 0.43 admitted/s is "0.43" in the live line, not "0.4" nor "0.0"."""
    stream = io.StringIO()
    log = RunLog(tmp_path, {}, stream=stream)
    log.step({**record(0), "rollout/per_s": 0.43})
    log.close()
    assert "admitted/s    0.43  busy" in stream.getvalue().splitlines()[1]
