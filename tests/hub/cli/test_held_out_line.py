"""The line serve and demo end with, `held-out reward: vA x -> vB y`: a resumed run's covers the
whole run, as its run log does (issue 31, item 7), not only what the resumed process trained."""

from __future__ import annotations

from echo2p2p.hub.run import held_out_line
from echo2p2p.hub.view.runlog import RunLog


def step(n: int, accuracy: float | None = None) -> dict:
    record = {"step": n, "version": n + 1, "time_s": 0.5 * (n + 1)}
    return record if accuracy is None else {**record, "eval/accuracy": accuracy}


def test_a_resumed_runs_line_goes_from_the_base_policy_to_the_last_evaluation(tmp_path):
    """Two processes append to one run log, as serve and `serve --resume` do; the second one's
    own records hold only its evaluation at v20, the log also the base one and v10's."""
    first = RunLog(tmp_path, {}, stream=None)
    first.event({"event": "eval", "version": 0, "eval/accuracy": 0.25})
    for n in range(12):
        first.step(step(n, 0.777 if n == 9 else None))
    first.close()
    resumed = RunLog(tmp_path, {}, stream=None)
    resumed.event({"event": "resume", "version": 12, "time_s": 6.0})
    own = [step(n, 0.797 if n == 19 else None) for n in range(12, 20)]
    for record in own:
        resumed.step(record)
    resumed.close()
    assert held_out_line(tmp_path, own) == (f"held-out reward: v0 0.250 -> v20 0.797 (+0.547); "
                                            f"run log in {tmp_path}/metrics.jsonl")


def test_before_any_step_the_line_is_the_processs_own(tmp_path):
    """Stopped before the first step was logged (the run log has no step to read): the base
    evaluation this process made; no evaluation at all: no line."""
    log = RunLog(tmp_path, {}, stream=None)
    base = {"event": "eval", "version": 0, "eval/accuracy": 0.25}
    log.event(base)
    log.close()
    assert held_out_line(tmp_path, [base]).startswith("held-out reward: v0 0.250 -> v0 0.250 ")
    assert held_out_line(tmp_path, []) is None
