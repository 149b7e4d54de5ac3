"""The peer's swapper and worker around a real engine: a version that arrives while a group is
being generated waits for it, and the group keeps the version that made it."""

from __future__ import annotations

import asyncio
import threading

import torch

from echo2p2p import messages as m
from echo2p2p.peer.swapper import Swapper
from echo2p2p.peer.worker import Rollouts
from echo2p2p.policy.engines import TransformersEngine
from echo2p2p.policy.model import build_tiny_model

WELCOME = m.Welcome("p1", "run", "tiny", "addition", 0, 2, 4, 1.0, 1.0, 4, 7)


class ContendedLock:
    """An engine lock that says when someone had to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited = threading.Event()

    def __enter__(self) -> ContendedLock:
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


class GatedEngine:
    """A real engine whose generation, once started, holds on until `gate` is set, and which
    counts weight loads that land during a generation."""

    def __init__(self, inner: TransformersEngine, gate: threading.Event) -> None:
        self.inner, self.gate, self.tokenizer = inner, gate, inner.tokenizer
        self.started = threading.Event()
        self.generating = False
        self.loads_during_generation = 0

    def generate(self, *args, **kwargs):
        self.generating = True
        self.started.set()
        try:
            assert self.gate.wait(60), "nobody tried to swap during the generation"
            return self.inner.generate(*args, **kwargs)
        finally:
            self.generating = False

    def load_weights(self, state) -> None:
        self.loads_during_generation += self.generating
        self.inner.load_weights(state)


async def test_a_version_arriving_mid_generation_waits_and_the_group_keeps_its_version():
    """The swapper asks for the engine while a generation holds it (the generation goes on
    only once it has): the load happens after, the group is tagged with the old version, and
    the next one is made with the new version."""
    inner = TransformersEngine("tiny")
    lock = ContendedLock()
    engine = GatedEngine(inner, lock.waited)
    said: list[m.Message] = []

    async def send(msg: m.Message) -> None:
        said.append(msg)

    swapper = Swapper(engine, send)
    swapper.engine_lock = lock
    rollouts = Rollouts(swapper)
    ids = inner.tokenizer.encode("12+34=", add_special_tokens=False)
    lease = m.LeaseGrant("L1", "p", "12+34=", ids, "46", 4, 60.0, 0)
    new = {k: v.to(torch.bfloat16) for k, v in
           build_tiny_model(inner.tokenizer, seed=1).state_dict().items() if k != "lm_head.weight"}
    swapping = asyncio.create_task(swapper.swap_versions())
    try:
        swapper.stage(0, None)  # the engine's own weights are v0: nothing to load
        await swapper.wait_version(0)
        generation = asyncio.create_task(asyncio.to_thread(rollouts.generate, lease, 1, WELCOME))
        assert await asyncio.to_thread(engine.started.wait, 60)
        swapper.stage(1, new)  # arrives mid-generation
        version, completions = await generation
        await swapper.wait_version(1)
        assert lock.waited.is_set() and engine.loads_during_generation == 0
        assert version == 0 and len(completions) == 4
        again, _ = await asyncio.to_thread(rollouts.generate, lease, 2, WELCOME)
        assert again == 1
        assert said == [m.VersionHeld(0), m.VersionHeld(1)]  # the swapper says what it holds
    finally:
        swapping.cancel()
