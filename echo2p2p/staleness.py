"""Bounded staleness: which policy versions a learner step may train on.

Theory of operation. Versions count learner updates. Version 0 is the initial policy; learner
step t (t = 0, 1, ...) starts from version t and produces version t + 1. So "the learner is at
step t" and "the learner holds version t" are the same statement, and there is no off-by-one to
get wrong between them (prime-rl's `async_level` shipped one).

A rollout generated with version x may be used by step t iff 0 <= t - x <= S, where S is the
user's `max_lag`. S = 0 is the synchronous baseline: step t uses only rollouts of version t and
the learner waits for them. The rule is checked twice: when a rollout arrives (against the step
the learner is at) and again when it is taken into a batch (it may have aged in the queue).

The hub publishes a version every `publish_every` (kappa) steps. The newest published version
lags the learner by up to kappa - 1, so kappa <= S + 1 is required, or no rollout from a
published version could ever be fresh. The paper's default is kappa = S - 1 (at least 1).
"""

from __future__ import annotations

import enum

from .errors import ConfigError


class Verdict(enum.Enum):
    """What the staleness rule says about one rollout at one learner step."""

    FRESH = "fresh"
    STALE = "stale"  # t - x > S: too old
    FUTURE = "future"  # x > t: a version the learner has not produced yet


def lag_versions(step: int, version: int) -> int:
    """How many learner updates lie between `version` and the policy at `step`."""
    return step - version


def judge(step: int, version: int, max_lag: int) -> Verdict:
    """The staleness verdict for a rollout of `version` at learner `step`."""
    lag = lag_versions(step, version)
    if lag < 0:
        return Verdict.FUTURE
    return Verdict.FRESH if lag <= max_lag else Verdict.STALE


def min_fresh_version(step: int, max_lag: int) -> int:
    """The oldest version step `step` may still train on."""
    return max(0, step - max_lag)


def consume_step(step: int, training: bool, outstanding: int, prompts_per_step: int) -> int:
    """The learner step that will train on a group leased now: the one after the batches ahead
    of it (`outstanding` groups queued, in flight or being judged) are consumed, and after the
    step running now (`training`), whose batch has already left the queue."""
    return step + int(training) + outstanding // prompts_per_step


def lease_min_version(step: int, training: bool, outstanding: int, prompts_per_step: int, *,
                      max_lag: int) -> int:
    """The oldest version a lease granted now may be generated with and still be fresh when
    its group is trained on."""
    return min_fresh_version(consume_step(step, training, outstanding, prompts_per_step), max_lag)


def default_publish_every(max_lag: int) -> int:
    """kappa = max(1, S - 1), the paper's default publication period."""
    return max(1, max_lag - 1)


def is_publish_version(version: int, publish_every: int) -> bool:
    """Whether `version` is one the hub snapshots and sends to peers."""
    return version % publish_every == 0


def latest_published(version: int, publish_every: int) -> int:
    """The newest published version when the learner holds `version`."""
    return version - version % publish_every


def lease_budget(prompts_per_step: int, max_lag: int) -> int:
    """How many prompt groups may be queued or in flight at once.

    S = 0 allows exactly one batch (anything more would be stale before it is used). S >= 1
    allows a second batch to be generated while the first is trained on: that is the overlap.
    More than two batches ahead would only age in the queue.
    """
    return prompts_per_step * (1 + min(max_lag, 1))


def check_schedule(max_lag: int, publish_every: int) -> None:
    """Raise ConfigError unless (S, kappa) lets published versions be fresh."""
    if max_lag < 0:
        raise ConfigError("max_lag", f"must be >= 0, got {max_lag}")
    if publish_every < 1:
        raise ConfigError("publish_every", f"must be >= 1, got {publish_every}")
    if publish_every > max_lag + 1:
        raise ConfigError(
            "publish_every",
            f"kappa={publish_every} > S+1={max_lag + 1}: the newest published version would "
            "be too stale to train on; lower publish_every or raise max_lag",
        )
