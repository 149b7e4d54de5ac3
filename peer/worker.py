"""The peer's rollout plane: leases -> rollouts, connected or not.

`Rollouts` makes a lease's group with the engine's current version (`swapper.Swapper`, the
engine handle), under its lock, and says which version made it: the version a rollout is tagged
with is the one that generated every token of it. `RolloutWorker` turns each lease into a
rollout (wait for a fresh enough version -> generate -> score -> submit); it lives as long as
the peer, across connections, and a rollout made while the hub is away waits in the outbox,
which the next connection sends first.

Neither knows the client: they are given the engine handle, the welcome (at each adoption), a
send function (which drops what it cannot send) and the outbox. A test liar wraps `Rollouts`
(`PeerClient(rollouts=...)`): what it returns is what the worker scores and submits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from echo2p2p import episodes
from echo2p2p import messages as m
from echo2p2p.bounds import check_from_peer
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.runtime.process import loop_now
from echo2p2p.scoring.scorer import Scorer

if TYPE_CHECKING:
    from echo2p2p.adapters.environments import InstalledEnvironment
    from echo2p2p.scoring.rewards import Reward

    from .outbox import Outbox
    from .swapper import Swapper

log = logging.getLogger(__name__)


class MakesRollouts(Protocol):
    """What the worker asks for a lease's group: (version used, what was made). Called in a
    worker thread."""

    def generate(self, lease: m.LeaseGrant, seed: int, welcome: m.Welcome
                 ) -> tuple[int | None, list]: ...

    def play(self, lease: m.LeaseGrant, seed: int, welcome: m.Welcome,
             env: InstalledEnvironment) -> tuple[int | None, list[episodes.Played]]: ...


class Rollouts:
    """The honest maker of groups: the engine's current version, sampled as the welcome says."""

    def __init__(self, swapper: Swapper):
        self.swapper = swapper

    def generate(self, lease: m.LeaseGrant, seed: int, welcome: m.Welcome
                 ) -> tuple[int | None, list]:
        """Generate the lease's group with the engine's current version, under the lock."""
        w, s = welcome, self.swapper
        with s.engine_lock:
            version = s.version
            out = s.engine.generate(lease.prompt_ids, lease.group_size,
                                    temperature=w.temperature, top_p=w.top_p,
                                    max_new_tokens=w.max_new_tokens, seed=seed)
        return version, out

    def play(self, lease: m.LeaseGrant, seed: int, welcome: m.Welcome,
             env: InstalledEnvironment) -> tuple[int | None, list[episodes.Played]]:
        """Play the lease's G episodes of the run's environment (its seed: the lease's answer)
        with the engine's current version, under the lock for the whole group: every turn of
        every episode is sampled with the version the rollout is tagged with."""
        w, s = welcome, self.swapper
        engine = s.engine
        draws = itertools.count()

        def turns(contexts: list[list[int]]) -> list[episodes.Turn]:
            out = []
            for context in contexts:
                (c,) = engine.generate(context, 1, temperature=w.temperature, top_p=w.top_p,
                                       max_new_tokens=w.max_new_tokens,
                                       seed=seed * 1_000_003 + next(draws))
                out.append((c.token_ids, c.logprobs, c.text, c.finish_reason == "stop"))
            return out

        n = lease.group_size
        with s.engine_lock:
            version = s.version
            encode = episodes.in_turn(engine.decoder.encode, (w.env_turn_before, w.env_turn_after))
            played = episodes.play([env.factory() for _ in range(n)], [lease.episode_seed] * n,
                                   [lease.prompt_ids] * n, turns, encode=encode)
        return version, played


class RolloutWorker:
    """The leases held, and the loop that turns them into rollouts (`work`)."""

    def __init__(self, swapper: Swapper, rollouts: MakesRollouts, outbox: Outbox,
                 send: Callable[[m.Message], Awaitable[None]], *, score_timeout_s: float):
        self.swapper, self.rollouts, self.outbox = swapper, rollouts, outbox
        self._send = send
        self.score_timeout_s = score_timeout_s
        self.welcome: m.Welcome | None = None  # the adopted welcome: sampling, seed, bounds
        self.env: InstalledEnvironment | None = None  # the run's environment, if it has one
        self.reward: Reward | None = None  # the task's reward function (None: only the hub
        # can score)
        # Leases by (min_version, arrival): one dated for a version still to come never holds
        # up one the engine can do now (at S = 0 that version needs this very batch).
        self.leases: asyncio.PriorityQueue[tuple[int, int, m.LeaseGrant, float]] = \
            asyncio.PriorityQueue()
        self._arrivals = 0
        self.generating = 0
        self.submitted = 0
        self.tokens_generated = 0  # model tokens sampled, kept or not (the engine's work)
        self._draw = 0
        self._scorer: Scorer | None = None  # claimed rewards (`_scorer_for`)

    def adopt(self, welcome: m.Welcome, env: InstalledEnvironment | None,
              reward: Reward | None) -> None:
        """A welcome adopted: what the next rollouts are made, scored and bounded by."""
        self.welcome, self.env, self.reward = welcome, env, reward

    async def _wait_version_until(self, min_version: int, deadline: float) -> bool:
        """Wait until the engine holds a version >= min_version; False if the deadline passes."""
        version = self.swapper.version
        if version is not None and version >= min_version:
            return True
        try:
            await asyncio.wait_for(self.swapper.wait_version(min_version), deadline - loop_now())
        except TimeoutError:
            return False
        return True

    def take(self, lease: m.LeaseGrant, deadline: float) -> None:
        """Queue a granted lease, to be generated by `deadline` (the loop's clock)."""
        self._arrivals += 1
        self.leases.put_nowait((lease.min_version, self._arrivals, lease, deadline))

    def held(self) -> int:
        """Leases waiting or being generated now."""
        return self.leases.qsize() + self.generating

    def drop_leases(self) -> None:
        """Forget the leases waiting (another run's)."""
        while not self.leases.empty():
            self.leases.get_nowait()

    async def work(self) -> None:
        """Leases to rollouts, connected or not. The claimed rewards are scored in a worker
        process under a deadline (`echo2p2p.scoring.scorer`), never on the event loop."""
        while True:
            _, _, lease, deadline = await self.leases.get()
            self.generating = 1
            try:
                sub = await self._rollout(lease, deadline)
                if sub is not None:
                    self.outbox.put(sub)
                    self.submitted += 1
                    await self._send(sub)
                await self._send(m.LeaseRequest(1))  # done, too late or dropped: the next
            finally:
                self.generating = 0

    async def _rollout(self, lease: m.LeaseGrant, deadline: float) -> m.RolloutSubmission | None:
        """The lease's rollout, or None when it cannot be made in time with a fresh enough
        version (the hub re-issues it) or the hub would refuse it. A lease whose deadline (the
        latest the hub may take it) passed while it waited in the queue is not generated: the
        hub has re-issued it and would reject its group."""
        if loop_now() >= deadline:
            log.info("dropping lease %s: its deadline passed while it was queued", lease.lease_id)
            return None
        if not await self._wait_version_until(lease.min_version, deadline):
            return None
        self._draw += 1
        seed = self.welcome.seed * 1_000_003 + self._draw
        if (env := self.env) is not None:
            if lease.episode_seed is None:  # an environment's lease carries the episode's seed
                log.warning("dropping lease %s: its seed %.20r is no number", lease.lease_id,
                            lease.answer)
                return None
            try:
                version, made = await asyncio.to_thread(
                    self.rollouts.play, lease, seed, self.welcome, env)
            except Exception:  # the installed environment's bug (or a context past the
                # model's length): this lease is dropped and re-issued, the peer goes on
                log.exception("dropping lease %s: playing its episodes failed", lease.lease_id)
                return None
        else:
            version, made = await asyncio.to_thread(
                self.rollouts.generate, lease, seed, self.welcome)
        self.tokens_generated += sum(len(x.logprobs) for x in made)  # a logprob per model token
        if version is None or version < lease.min_version:
            return None
        if env is not None:  # the environment's rewards are the claims
            samples = [m.Sample(m.pack_ids(p.ids), m.pack_logprobs(p.logprobs), p.action,
                                p.reward, "stop" if p.stopped else "length",
                                episodes.pack_turns(p.turns)) for p in made]
        else:
            samples = await self._claims(lease, made)
        sub = m.RolloutSubmission(lease.lease_id, version, samples)
        try:  # what the hub would refuse by closing us (and again at every resend)
            check_from_peer(sub, self.welcome)
        except RemoteProtocolError as exc:
            log.warning("dropping rollout %s: %s", lease.lease_id, exc.reason)
            return None
        return sub

    async def _claims(self, lease: m.LeaseGrant, completions: list) -> list[m.Sample]:
        """The completions as samples, with the rewards we claim: the task's, scored in a
        worker process; 0 where only the hub can score (users' reward functions)."""
        reward = self.reward
        rewards = [0.0] * len(completions) if reward is None else (
            await self._scorer_for(reward).score([(lease.answer, c.text) for c in completions])
        ).rewards
        return [m.Sample(m.pack_ids(c.token_ids), m.pack_logprobs(c.logprobs), c.text, r,
                         c.finish_reason) for c, r in zip(completions, rewards)]

    def _scorer_for(self, reward: Reward) -> Scorer:
        """The scorer of `reward`: made on first use, and again when a welcome brings another
        task's reward function (the old one's workers are stopped)."""
        if self._scorer is None or self._scorer.reward is not reward:
            if self._scorer is not None:
                self._scorer.close()
            self._scorer = Scorer(reward, timeout_s=self.score_timeout_s,
                                  name="peer-scorer")
        return self._scorer

    def close(self) -> None:
        """Stop the scorer's worker processes (the loops are cancelled by their task group)."""
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None
