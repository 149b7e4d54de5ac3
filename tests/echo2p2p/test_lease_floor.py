"""The oldest version a lease granted now may be generated with (`echo2p2p.staleness`).

A group leased now is trained on once the batches ahead of it are consumed; the floor is the
oldest version that step may still train on. Values are worked by hand below.
"""

from hypothesis import given
from hypothesis import strategies as st

from echo2p2p.staleness import consume_step, judge, lease_min_version, Verdict


def test_nothing_ahead_is_trained_on_at_the_current_step():
    assert consume_step(step=4, training=False, outstanding=0, prompts_per_step=8) == 4


def test_a_running_step_and_whole_batches_ahead_push_it_later():
    """The running step's batch has left the queue; 8 groups ahead of 8 per step is one more."""
    assert consume_step(step=4, training=True, outstanding=0, prompts_per_step=8) == 5
    assert consume_step(step=4, training=True, outstanding=7, prompts_per_step=8) == 5
    assert consume_step(step=4, training=True, outstanding=8, prompts_per_step=8) == 6


def test_the_floor_is_that_steps_oldest_fresh_version():
    assert lease_min_version(4, True, 8, 8, max_lag=2) == 4  # consumed at 6: 6 - 2
    assert lease_min_version(0, False, 0, 8, max_lag=2) == 0  # never below version 0
    assert lease_min_version(3, False, 0, 8, max_lag=0) == 3  # S = 0: only the current one


@given(step=st.integers(0, 1000), training=st.booleans(), outstanding=st.integers(0, 100),
       per_step=st.integers(1, 16), max_lag=st.integers(0, 8))
def test_a_rollout_at_the_floor_is_fresh_when_consumed(step, training, outstanding, per_step,
                                                       max_lag):
    at = consume_step(step, training, outstanding, per_step)
    floor = lease_min_version(step, training, outstanding, per_step, max_lag=max_lag)
    assert judge(at, max(floor, at - max_lag), max_lag) is Verdict.FRESH
    assert floor == 0 or judge(at, floor - 1, max_lag) is Verdict.STALE
