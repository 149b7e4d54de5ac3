"""Admission decisions as values: which of duplicate, unknown lease, quarantined, forged
version, stale, unscorable or "score it" one submission gets, and in which order they apply."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from echo2p2p.admission import Action, Decision, decide_submission
from echo2p2p.leases import Completion

FRESH = dict(outcome=Completion.NEW, lease_open=True, quarantined=False, unpublished=False,
             step=5, version=5, max_lag=2, can_score=True)


def decide(**changes) -> Decision:
    return decide_submission(**{**FRESH, **changes})


def test_a_fresh_submission_of_an_open_lease_is_scored():
    assert decide() == Decision(Action.SCORE)
    assert decide(version=3) == Decision(Action.SCORE)  # lag 2 == S: still fresh


def test_a_duplicate_is_acknowledged_again_whatever_else_holds():
    """A resent rollout of a completed lease is acked, even from a quarantined peer."""
    assert decide(outcome=Completion.DUPLICATE, lease_open=False, quarantined=True,
                  unpublished=True).action is Action.ACK_DUPLICATE


@pytest.mark.parametrize("outcome", [Completion.UNKNOWN, Completion.EXPIRED])
def test_no_open_lease_is_rejected_with_the_lease_books_word(outcome):
    assert decide(outcome=outcome, lease_open=False) == Decision(Action.REJECT, outcome.value)


def test_a_rejected_lease_is_rejected_again_for_its_reason_not_acked():
    """A resubmission of a rejected lease hears the first rejection, even from a quarantined
    peer; one made while the first is judged waits for that verdict (no false "duplicate")."""
    assert decide(outcome=Completion.REJECTED, lease_open=False, quarantined=True,
                  rejected_for="bad_tokens") == Decision(Action.REJECT, "bad_tokens")
    assert decide(outcome=Completion.JUDGING, lease_open=False) == Decision(Action.HOLD)


def test_quarantine_comes_before_the_version_checks():
    assert decide(quarantined=True, unpublished=True, version=0) == \
        Decision(Action.REFUSE, "quarantined")


def test_a_version_never_published_is_forged_even_when_fresh_looking():
    assert decide(unpublished=True, version=9) == Decision(Action.FORGED, "version")


@pytest.mark.parametrize("version, why", [(2, "stale"), (6, "future")])
def test_the_staleness_rule_turns_away_old_and_future_versions(version, why):
    assert decide(version=version) == Decision(Action.STALE, why)


def test_a_hub_without_a_decoder_refuses_what_it_would_score():
    assert decide(can_score=False) == Decision(Action.REFUSE, "unscorable")
    assert decide(can_score=False, version=0).action is Action.STALE  # staleness first


@given(outcome=st.sampled_from(list(Completion)), quarantined=st.booleans(),
       unpublished=st.booleans(), step=st.integers(0, 20), version=st.integers(0, 25),
       max_lag=st.integers(0, 4), can_score=st.booleans())
def test_every_input_gets_exactly_the_first_rule_that_applies(outcome, quarantined, unpublished,
                                                              step, version, max_lag, can_score):
    """A model of the rule order written here: the decision is the first that applies."""
    lease_open = outcome is Completion.NEW
    got = decide_submission(outcome, lease_open=lease_open, quarantined=quarantined,
                            unpublished=unpublished, step=step, version=version,
                            max_lag=max_lag, can_score=can_score, rejected_for="bad_tokens")
    if outcome is Completion.DUPLICATE:
        want = Action.ACK_DUPLICATE
    elif outcome is Completion.JUDGING:
        want = Action.HOLD
    elif not lease_open:
        want = Action.REJECT
    elif quarantined:
        want = Action.REFUSE
    elif unpublished:
        want = Action.FORGED
    elif not 0 <= step - version <= max_lag:
        want = Action.STALE
    elif not can_score:
        want = Action.REFUSE
    else:
        want = Action.SCORE
    assert got.action is want
    assert (got.reason == "") == (want in (Action.ACK_DUPLICATE, Action.HOLD, Action.SCORE))
