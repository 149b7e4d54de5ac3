"""Where every admitted rollout and every granted prompt went, from a run's evidence.

An admitted group (the hub acked it, so its peer forgot it) must end up trained on, still queued
for the learner, or dropped by the staleness rule; a granted prompt must end up admitted, or
still pending or leased. Across a hub kill, the killed incarnation's steps past the version its
successor resumed at were lost with it and done again, so they do not count as trained.

Pure functions over `harness` readers' output; nothing here touches a process.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .harness import FinalState, HubLog


@dataclass(frozen=True)
class Incarnation:
    """One hub process's life: its debug log, its step records, the newest produced version
    whose step still counts (None: all; a killed hub: the version its successor resumed at),
    and the groups its checkpoint and journal hold as admitted (a killed hub: `FinalState.queued`
    as the kill left it). The hub journals an admission before it logs it, so a kill between
    the two leaves a group admitted, restored and trained that no log line admitted."""

    log: HubLog
    steps: list[dict]
    counts_upto: int | None = None
    journaled: frozenset[str] = frozenset()

    def trained(self) -> list[str]:
        return [lease for r in self.steps
                if self.counts_upto is None or r["version"] <= self.counts_upto
                for lease in r["rollout/leases"]]


@dataclass(frozen=True)
class Accounting:
    admitted: set[str]
    trained: set[str]
    queued: set[str]
    dropped: set[str]
    admitted_lost: set[str]  # admitted, and neither trained, queued, dropped as stale nor withdrawn
    granted_problems: set[int]
    groups_lost: set[int]  # granted, and neither admitted, pending nor leased at the end
    trained_twice: set[str]  # counted steps that took the same group twice
    reissued: int  # prompts granted more than once (an expired, released or rejected lease)


def account(lives: list[Incarnation], final: FinalState) -> Accounting:
    granted: dict[str, int] = {}
    admitted: set[str] = set()
    dropped: set[str] = set()
    trained: Counter[str] = Counter()
    grants_per_problem: Counter[int] = Counter()
    for life in lives:
        granted.update({lease: problem for lease, (problem, _) in life.log.granted.items()})
        grants_per_problem.update(problem for problem, _ in life.log.granted.values())
        admitted |= life.log.admitted.keys() | life.journaled
        dropped |= life.log.dropped | life.log.withdrawn  # taken out of the queue, logged
        trained.update(life.trained())
    unknown = admitted - granted.keys()
    assert not unknown, f"admitted leases never granted in any log: {sorted(unknown)[:5]}"
    admitted_lost = admitted - trained.keys() - final.queued - dropped
    outstanding = final.pending | set(final.open.values())
    groups_lost = set(granted.values()) - {granted[lease] for lease in admitted} - outstanding
    return Accounting(admitted, set(trained), final.queued, dropped, admitted_lost,
                      set(granted.values()), groups_lost,
                      {lease for lease, n in trained.items() if n > 1},
                      sum(n > 1 for n in grants_per_problem.values()))
