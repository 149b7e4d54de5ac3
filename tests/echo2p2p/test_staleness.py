"""The version convention and the bounded-staleness rule."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from echo2p2p.buffer import RolloutBuffer, ScoredGroup
from echo2p2p.errors import ConfigError
from echo2p2p.staleness import (Verdict, check_schedule, default_publish_every, is_publish_version,
                                judge, latest_published, lease_budget, min_fresh_version)


def group(version: int, lease: str = "L") -> ScoredGroup:
    return ScoredGroup(lease, "p", [1, 2], version, [], [])


def test_step_t_holds_version_t():
    """Step 0 trains version 0 into 1; a synchronous (S=0) step t takes exactly version t."""
    assert judge(0, 0, 0) is Verdict.FRESH
    assert judge(1, 0, 0) is Verdict.STALE
    assert judge(5, 5, 0) is Verdict.FRESH
    assert judge(5, 6, 0) is Verdict.FUTURE


@given(st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 20))
def test_fresh_iff_lag_within_bound(step, version, max_lag):
    """A rollout of version x is usable at step t iff 0 <= t - x <= S."""
    fresh = judge(step, version, max_lag) is Verdict.FRESH
    assert fresh == (0 <= step - version <= max_lag)
    if fresh:
        assert version >= min_fresh_version(step, max_lag)


@given(st.integers(0, 12), st.integers(1, 14), st.integers(0, 500))
def test_published_version_is_fresh_when_schedule_valid(max_lag, kappa, version):
    """With kappa <= S + 1 the newest published version is always fresh for the learner."""
    if kappa > max_lag + 1:
        with pytest.raises(ConfigError) as info:
            check_schedule(max_lag, kappa)
        assert info.value.field == "publish_every"
        return
    check_schedule(max_lag, kappa)
    published = latest_published(version, kappa)
    assert is_publish_version(published, kappa)
    assert judge(version, published, max_lag) is Verdict.FRESH


def test_default_kappa_is_paper_default():
    """kappa = max(1, S - 1)."""
    assert [default_publish_every(s) for s in range(5)] == [1, 1, 1, 2, 3]


def test_lease_budget_synchronous_is_one_batch():
    """S = 0 allows one batch in flight; S >= 1 two (generation overlaps training)."""
    assert lease_budget(8, 0) == 8
    assert lease_budget(8, 1) == lease_budget(8, 6) == 16


def test_buffer_drops_groups_that_aged_in_queue():
    """A group fresh on arrival but too old when the batch is taken is dropped and counted."""
    buf = RolloutBuffer(max_lag=1)
    for v, lease in [(0, "a"), (1, "b"), (2, "c"), (2, "d")]:
        buf.put(group(v, lease))
    assert buf.take_batch(step=2, n_groups=5) is None  # drops "a" (lag 2)
    batch = buf.take_batch(step=2, n_groups=2)
    assert [g.lease_id for g in batch] == ["b", "c"]
    stats = buf.statistics()
    assert (stats.queued, stats.admitted_total, stats.dropped_stale_total) == (1, 4, 1)
    assert buf.dropped_lags == {2: 1}  # by lag in versions, for the dashboard's histogram


def test_buffer_trains_the_oldest_versions_first():
    """Peers finish out of order: a fresh group that arrived first must not push an older one
    past S. Arrival order v3, v1, v2; one group per step at S = 2: nothing goes stale."""
    buf = RolloutBuffer(max_lag=2)
    for v, lease in [(3, "new"), (1, "old"), (2, "mid"), (1, "old2")]:
        buf.put(group(v, lease))
    assert [g.lease_id for g in buf.take_batch(step=3, n_groups=2)] == ["old", "old2"]
    assert [g.lease_id for g in buf.take_batch(step=4, n_groups=1)] == ["mid"]
    assert [g.lease_id for g in buf.take_batch(step=5, n_groups=1)] == ["new"]
    assert buf.statistics().dropped_stale_total == 0


def test_buffer_withdraws_the_groups_of_one_source():
    """The queued groups of a source found lying leave the queue, whatever their version; other
    sources' stay, in order; groups already taken or aged out are not withdrawn twice."""
    buf = RolloutBuffer(max_lag=2)
    for v, lease, source in [(0, "a", "liar"), (1, "b", "honest"), (1, "c", "liar"),
                             (2, "d", "liar"), (2, "e", "honest")]:
        buf.put(group(v, lease), source)
    assert [g.lease_id for g in buf.take_batch(step=2, n_groups=1)] == ["a"]  # trained already
    assert buf.sources() == {"b": "honest", "c": "liar", "d": "liar", "e": "honest"}
    assert [g.lease_id for g in buf.withdraw("liar")] == ["c", "d"]
    assert [g.lease_id for g in buf.groups()] == ["b", "e"]
    assert buf.withdraw("liar") == [] and buf.remove({"x", "e"})[0].lease_id == "e"
    buf.drop_stale(step=4)  # "b" (v1) ages out
    assert buf.sources() == {} and len(buf) == 0
    assert buf.statistics().admitted_total == 5  # withdrawn groups were admitted once
