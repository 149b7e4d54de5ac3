"""The peer's rollout plane: the engine's version, the swapper, and leases -> rollouts.

Two loops live as long as the peer, across connections: the swapper loads a complete version
(staged by the fetcher) into the engine between two generations — the swap is atomic and
generation goes on with the old weights while a download is under way — and the worker turns
each lease into a rollout (wait for a fresh enough version -> generate -> score -> submit,
tagged with the version actually used). A rollout made while the hub is away waits in the
outbox, which the next connection sends first.

The engine is only ever touched under `engine_lock` (a thread lock: generation and loading run
in worker threads so the event loop keeps reading the socket). This module never opens a
connection: what it sends goes through the client's `send`, dropped when there is none.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any

from echo2p2p import episodes
from echo2p2p import messages as m
from echo2p2p.bounds import check_from_peer
from echo2p2p.errors import RemoteProtocolError
from echo2p2p.scoring.scorer import Scorer

if TYPE_CHECKING:
    from .client import PeerClient

log = logging.getLogger(__name__)


class Worker:
    """Holds the engine's version and the leases; reads the client's engine, welcome and reward
    (a welcome may replace them) and calls its `_generate` (a subclass may wrap it)."""

    def __init__(self, peer: PeerClient):
        self.peer = peer
        self.version: int | None = None  # what the engine holds now
        self.engine_lock = threading.Lock()
        self.staged: tuple[int, dict] | None = None  # (version, state) for the swapper
        self._staged_event = asyncio.Event()
        self._version_changed = asyncio.Event()  # replaced at each change: a pulse
        self.leases: asyncio.Queue[tuple[m.LeaseGrant, float]] = asyncio.Queue()
        self.generating = 0
        self.loaded = self.submitted = 0
        self.tokens_generated = 0  # model tokens sampled, kept or not (the engine's work)
        self._draw = 0
        self._scorer: Scorer | None = None  # claimed rewards (`_scorer_for`)

    # --- the version the engine holds ----------------------------------------------------

    def set_version(self, version: int | None) -> None:
        """The engine (or, for a relay, the store) now holds `version`; wakes every waiter."""
        self.version = version
        self._changed()

    def _changed(self) -> None:
        self._version_changed.set()
        self._version_changed = asyncio.Event()

    def stage(self, version: int, state: dict) -> None:
        """Hand a complete version to the swapper (a newer one staged first replaces it)."""
        self.staged = (version, state)
        self._staged_event.set()

    async def wait_version(self, min_version: int) -> None:
        """Return once the engine holds a version >= `min_version`."""
        while self.version is None or self.version < min_version:
            await self._version_changed.wait()

    async def _wait_version_until(self, min_version: int, deadline: float) -> bool:
        """Wait until the engine holds a version >= min_version; False if the deadline passes."""
        if self.version is not None and self.version >= min_version:
            return True
        try:
            await asyncio.wait_for(self.wait_version(min_version), deadline - _now())
        except TimeoutError:
            return False
        return True

    def held(self) -> int:
        """Leases waiting or being generated now."""
        return self.leases.qsize() + self.generating

    def drop_leases(self) -> None:
        """Forget the leases waiting (another run's)."""
        while not self.leases.empty():
            self.leases.get_nowait()

    # --- the swapper ---------------------------------------------------------------------

    async def swap_versions(self) -> None:
        while True:
            await self._staged_event.wait()
            self._staged_event.clear()
            staged, self.staged = self.staged, None
            if staged is None:
                continue
            await asyncio.to_thread(self._load, *staged)
            self._changed()
            await self.peer.send(m.VersionHeld(staged[0]))

    def _load(self, version: int, state: dict) -> None:
        with self.engine_lock:
            self.peer.engine.load_weights(state)
            self.version = version
        self.loaded += 1
        log.debug("now generating with v%d", version)

    # --- the worker ----------------------------------------------------------------------

    def generate(self, lease: m.LeaseGrant, seed: int) -> tuple[int | None, list]:
        """Generate the lease's group with the engine's current version, under the lock."""
        w = self.peer.welcome
        with self.engine_lock:
            version = self.version
            out = self.peer.engine.generate(lease.prompt_ids, lease.group_size,
                                            temperature=w.temperature, top_p=w.top_p,
                                            max_new_tokens=w.max_new_tokens, seed=seed)
        return version, out

    def play(self, lease: m.LeaseGrant, seed: int) -> tuple[int | None, list[episodes.Played]]:
        """Play the lease's G episodes of the run's environment (its seed: the lease's answer)
        with the engine's current version, under the lock for the whole group: every turn of
        every episode is sampled with the version the rollout is tagged with."""
        peer, w = self.peer, self.peer.welcome
        engine, env = peer.engine, peer.env
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
        with self.engine_lock:
            version = self.version
            played = episodes.play([env.factory() for _ in range(n)], [int(lease.answer)] * n,
                                   [lease.prompt_ids] * n, turns, engine.decoder.encode)
        return version, played

    async def work(self) -> None:
        """Leases to rollouts, connected or not. The claimed rewards are scored in a worker
        process under a deadline (`echo2p2p.scoring.scorer`), never on the event loop."""
        while True:
            lease, deadline = await self.leases.get()
            self.generating = 1
            try:
                sub = await self._rollout(lease, deadline)
                if sub is not None:
                    self.peer.outbox.put(sub)
                    self.submitted += 1
                    await self.peer.send(sub)
                await self.peer.send(m.LeaseRequest(1))  # done, too late or dropped: the next
            finally:
                self.generating = 0

    async def _rollout(self, lease: m.LeaseGrant, deadline: float) -> m.RolloutSubmission | None:
        """The lease's rollout, or None when it cannot be made in time with a fresh enough
        version (the hub re-issues it) or the hub would refuse it."""
        peer = self.peer
        if not await self._wait_version_until(lease.min_version, deadline):
            return None
        self._draw += 1
        seed = peer.welcome.seed * 1_000_003 + self._draw
        if peer.env is not None:
            if not lease.answer.isdigit():  # an environment's lease carries the episode's seed
                log.warning("dropping lease %s: its seed %.20r is no number", lease.lease_id,
                            lease.answer)
                return None
            try:
                version, made = await asyncio.to_thread(peer._play, lease, seed)
            except Exception:  # the installed environment's bug (or a context past the
                # model's length): this lease is dropped and re-issued, the peer goes on
                log.exception("dropping lease %s: playing its episodes failed", lease.lease_id)
                return None
        else:
            version, made = await asyncio.to_thread(peer._generate, lease, seed)
        self.tokens_generated += sum(len(x.logprobs) for x in made)  # a logprob per model token
        if version is None or version < lease.min_version:
            return None
        if peer.env is not None:  # the environment's rewards are the claims
            samples = [m.Sample(m.pack_ids(p.ids), m.pack_logprobs(p.logprobs), p.action,
                                p.reward, "stop" if p.stopped else "length",
                                episodes.pack_turns(p.turns)) for p in made]
        else:
            samples = await self._claims(lease, made)
        sub = m.RolloutSubmission(lease.lease_id, version, samples)
        try:  # what the hub would refuse by closing us (and again at every resend)
            check_from_peer(sub, peer.welcome)
        except RemoteProtocolError as exc:
            log.warning("dropping rollout %s: %s", lease.lease_id, exc.reason)
            return None
        return sub

    async def _claims(self, lease: m.LeaseGrant, completions: list) -> list[m.Sample]:
        """The completions as samples, with the rewards we claim: the task's, scored in a
        worker process; 0 where only the hub can score (users' reward functions)."""
        reward = self.peer.reward
        rewards = [0.0] * len(completions) if reward is None else (
            await self._scorer_for(reward).score([(lease.answer, c.text) for c in completions])
        ).rewards
        return [m.Sample(m.pack_ids(c.token_ids), m.pack_logprobs(c.logprobs), c.text, r,
                         c.finish_reason) for c, r in zip(completions, rewards)]

    def _scorer_for(self, reward: Any) -> Scorer:
        """The scorer of `reward`: made on first use, and again when a welcome brings another
        task's reward function (the old one's workers are stopped)."""
        if self._scorer is None or self._scorer.reward is not reward:
            if self._scorer is not None:
                self._scorer.close()
            self._scorer = Scorer(reward, timeout_s=self.peer.cfg.score_timeout_s,
                                  name="peer-scorer")
        return self._scorer

    def close(self) -> None:
        """Stop the scorer's worker processes (the loops are cancelled by their task group)."""
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None


def _now() -> float:
    return asyncio.get_running_loop().time()
