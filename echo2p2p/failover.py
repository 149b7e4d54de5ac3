"""Download failover: whom a peer asks for each chunk of one version, and what it does when a
source fails. Pure: no sockets, no clock (`now` is an argument), no chunk bytes.

Theory of operation. Each chunk has an owner in the hub's relay plan: a peer's id, or `HUB`
(the hub itself, also for the chunks this peer owns). A chunk is asked of its owner. When a
peer source fails (a corrupt chunk, a stall, unreachable) it is reported to the hub once and
avoided: its chunks wait `replan_wait_s` for the hub's next plan revision (which re-deals
them), then come from the hub. The hub is the last resort and is never avoided: a failed
request to it (a busy hub queues requests) holds every hub-routed chunk for `hub_retry_s`,
then they are asked again. A hub that keeps failing (stopped, or gone) is asked less and less
often (`HubBackoff`: the pause doubles each failed round, up to HUB_RETRY_MAX_S), and the shell
says so once rather than at every retry.

Driving it: `requests(now, window)` says which requests to send (each chunk still wanted and
not asked, of its source, at most `window` at once per source), `finished` is told how each
ended, `plan` takes the hub's revisions. A request out to a peer that a revision no longer
routes its chunk through (`moved`: the hub dealt it elsewhere, as when that peer fetched
nothing of its share, `echo2p2p.seed_watch`) is withdrawn by the shell (`release`) and asked
again by the plan, rather than waited on until the stall deadline. The shell
(`echo2p2p.overlay.download.Download`) runs the requests and reads the clock;
bench/emulated_peers.py drives it the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from . import messages as m
from .relay import owners_of

HUB = "hub"  # the source name of the hub
HUB_RETRY_S = 1.0  # after a failed request to the hub, ask it again this much later
HUB_RETRY_MAX_S = 30.0  # the longest pause between rounds of requests to a failing hub
HUB_GONE_ROUNDS = 4  # failed rounds in a row (1 + 2 + 4 s of pauses) before the shell says
# the hub looks gone
HUB_WINDOW = 4  # requests for our own chunks out to the hub at once, whatever the plan's
# window (see `requests`)


class HubBackoff:
    """When to ask a failing hub again. A round is the requests out to the hub at once: the
    failures that come back while the hub is already paused belong to the round that paused it.
    The first failed round pauses `retry_s` (a busy hub that queues requests is asked again
    soon), each further one twice the last, up to HUB_RETRY_MAX_S; a chunk the hub serves ends
    the streak. Without it a stopped hub was asked (and the failure logged) twice a second."""

    def __init__(self, retry_s: float):
        self.retry_s = retry_s
        self.retry_at = float("-inf")
        self.rounds = 0  # failed rounds since the hub last served a chunk
        self.failures = 0  # failed requests, all told
        self.since: float | None = None  # when the streak began
        self.fresh = False  # whether the latest failure began a round (the shell logs rounds
        # 1 and HUB_GONE_ROUNDS when they begin, and nothing in between)

    def failed(self, now: float) -> bool:
        """A request to the hub failed at `now`; True (`fresh`) when it begins a new round."""
        self.failures += 1
        self.fresh = now >= self.retry_at
        if not self.fresh:
            return False
        self.rounds += 1
        if self.rounds == 1:
            self.since = now
        self.retry_at = now + self.pause_s
        return True

    @property
    def pause_s(self) -> float:
        """The pause after the latest failed round."""
        return min(self.retry_s * 2 ** max(self.rounds - 1, 0), max(HUB_RETRY_MAX_S, self.retry_s))

    def served(self) -> None:
        """The hub served a chunk: its next failure pauses `retry_s` again."""
        self.rounds, self.since = 0, None


@dataclass(frozen=True)
class FailoverStats:
    revision: int  # the plan revision followed (0: none yet, everything from the hub)
    failed_sources: tuple[str, ...]  # peer sources reported and avoided, first failed first
    hub_failures: int  # failed requests to the hub (each one retried)


class Failover:
    """The routing table of one download: chunk -> source, and the faults seen so far."""

    def __init__(self, n_chunks: int, me: str, *, replan_wait_s: float = 3.0,
                 hub_retry_s: float = HUB_RETRY_S):
        self.n_chunks, self.me = n_chunks, me
        self.replan_wait_s, self.hub_retry_s = replan_wait_s, hub_retry_s
        self.revision = 0
        self.owners: list[str] = [HUB] * n_chunks  # until a plan arrives
        self._failed: dict[str, float] = {}  # peer source -> when it failed
        self.hub = HubBackoff(hub_retry_s)
        self._wanted = set(range(n_chunks))  # chunks not in yet
        self._asked: dict[int, str] = {}  # chunk -> the source its request is out to
        self._load: Counter[str] = Counter()  # source -> requests out to it

    def plan(self, plan: m.RelayPlan, reachable: set[str]) -> str | None:
        """Follow a newer revision of the relay plan (chunks not yet requested follow it).
        `reachable`: the peer sources we have a usable URL for; the chunks of any other come
        from the hub. Returns None if taken or already past this revision, else why it was
        ignored (a plan that does not fit this manifest)."""
        if plan.revision <= self.revision:
            return None
        try:
            owners = owners_of(plan)
        except ValueError as exc:
            return str(exc)
        if len(owners) != self.n_chunks:
            return "wrong chunk count"
        ids = [HUB if o == m.HUB_OWNER or plan.sources[o].peer_id == self.me
               else plan.sources[o].peer_id for o in owners]
        self.revision = plan.revision
        self.owners = [i if i in reachable else HUB for i in ids]
        return None

    def route(self, index: int, now: float) -> str | None:
        """Whom to ask for chunk `index` now; None to wait (for the hub's next plan, or for the
        hub's retry time)."""
        owner = self.owners[index]
        failed_at = self._failed.get(owner)
        if failed_at is not None:
            owner = HUB if now - failed_at > self.replan_wait_s else None
        if owner == HUB and now < self.hub.retry_at:
            return None
        return owner

    def failed(self, source: str, now: float) -> bool:
        """A request to `source` failed at `now`. True when the hub must be told (the first
        fault of a peer source); the hub's own failures only delay its next request."""
        if source == HUB:
            self.hub.failed(now)
            return False
        if source in self._failed:
            return False
        self._failed[source] = now
        return True

    def want(self, indices: Iterable[int]) -> None:
        """Only `indices` are still to fetch (all, until told): the rest are in (a resumed
        download)."""
        self._wanted = set(indices) - set(self._asked)

    def requests(self, now: float, window: int) -> list[tuple[int, str]]:
        """The requests to send now, (chunk, source), lowest chunk first: every chunk still
        wanted and not asked, of whom `route` says, at most `window` out to each source at once,
        and of them at most HUB_WINDOW of the chunks the plan routes to the hub (a failed
        source's chunks, which come from the hub meanwhile, only count against `window`). Each
        is out until `finished`. A chunk lower than every one out to its peer source is asked
        even past `window`: one that came back (its source failed, a new plan routed it there)
        after the window filled with later ones. In a striped chain those later ones may only
        reach the parent after this one passed us, so the ring would wait on itself (emulated:
        64 peers, 8 leaving at once, never completed).

        That cap is the striped chain's: its plan's window (2 per hop, up to 32) is for the
        parent, whose chunks come down the ring; asked of the hub too, every member's stripe
        queued there at once (16 members: 480 requests, 12.6 s of a 20 Mbit/s hub in 64 KiB
        chunks), so a chunk could wait longer than a child's stall deadline at each first hop,
        and the children reported healthy parents and fetched the rest from the hub. In
        `bench/gossip_sweep.py`'s emulation (Download's stall rule on), 16 peers on 64 MiB went
        from 14.6 x M/B and 14.6 hub copies to 1.04 and 1.00, on 16 MiB from 1.63 to 1.16, and
        with a third of the uplinks at B/4 from 1.73 to 1.38 x the max-flow bound. 2 was
        tighter still in the emulation, but slower over real HTTP (tests/peer/test_striped_chain).
        """
        out = []
        planned = sum(s == HUB and self.owners[i] == HUB for i, s in self._asked.items())
        lowest: dict[str, int] = {}  # source -> the lowest chunk out to it
        for i, s in self._asked.items():
            lowest[s] = min(lowest.get(s, i), i)
        for index in sorted(self._wanted - self._asked.keys()):
            source = self.route(index, now)
            if source is None or (self._load[source] >= window
                                  and (source == HUB or index > lowest.get(source, index))):
                continue
            lowest[source] = min(lowest.get(source, index), index)
            if source == HUB and self.owners[index] == HUB:  # not a failed source's chunk
                if planned >= HUB_WINDOW:
                    continue
                planned += 1
            self._load[source] += 1
            self._asked[index] = source
            out.append((index, source))
        return out

    def moved(self) -> list[tuple[int, str]]:
        """(chunk, source) of each request out to a peer source the plan no longer routes that
        chunk through: to withdraw (`release`) and ask again."""
        return [(i, s) for i, s in self._asked.items() if s != HUB and self.owners[i] != s]

    def release(self, index: int, source: str) -> None:
        """Chunk `index`'s request to `source` was withdrawn, not failed: asked again by the
        plan, and nobody is reported."""
        if self._asked.get(index) == source:
            del self._asked[index]
            self._load[source] -= 1

    def asked(self, index: int) -> str | None:
        """The source chunk `index`'s request is out to; None if none is."""
        return self._asked.get(index)

    def waiting(self, now: float) -> bool:
        """Whether a chunk not asked waits for time to pass (the hub's next plan, or its retry
        time), not for a request to end: a shell that sleeps until an event wakes for it."""
        return any(self.route(i, now) is None for i in self._wanted - self._asked.keys())

    def finished(self, index: int, source: str, fault: str | None, now: float) -> bool:
        """Chunk `index`'s request to `source` ended at `now`: `fault` None, the chunk is in;
        "slow", it is in but `source` is to be avoided; else the request failed. True when the
        hub must be told of `source` (`failed`)."""
        del self._asked[index]
        self._load[source] -= 1
        if fault in (None, "slow"):
            self._wanted.discard(index)
            if source == HUB:
                self.hub.served()
        return fault is not None and self.failed(source, now)

    @property
    def complete(self) -> bool:
        """Every chunk is in."""
        return not self._wanted

    def statistics(self) -> FailoverStats:
        return FailoverStats(self.revision, tuple(self._failed), self.hub.failures)
