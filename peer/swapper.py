"""The peer's engine handle: the engine, the version it holds, and the swapper that changes it.

`Swapper` is the one thing that changes the engine's weights and the one that tells the hub what
the peer holds (`VersionHeld`): after each swap, for a relay (no engine: its store holds the
version) as soon as the fetcher has it, and at the start of every connection (`announce`). The
fetcher stages a complete version; the swap loop loads it between two generations, so the swap
is atomic and generation goes on with the old weights while a download is under way.

`build_engine` makes one (a worker thread's job: importing torch takes seconds).
The engine is only ever touched under `engine_lock` (a thread lock: generation and loading run
in worker threads so the event loop keeps reading the socket). This module knows nothing of
leases, downloads or connections: what it sends goes through the `send` it is given.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from echo2p2p import messages as m

if TYPE_CHECKING:
    from echo2p2p.policy.engines import Engine

    from .config import PeerConfig

log = logging.getLogger(__name__)


class Swapper:
    """The engine (None until one is built), its lock, and the version it holds (for a relay:
    the newest complete one in the store)."""

    def __init__(self, engine: Engine | None, send: Callable[[m.Message], Awaitable[None]]):
        self.engine = engine
        self.engine_lock = threading.Lock()
        self.version: int | None = None
        self.loaded = 0  # versions swapped into the engine
        self._send = send
        self._staged: tuple[int, dict | None] | None = None  # (version, state) for the loop
        self._staged_event = asyncio.Event()
        self._changes = asyncio.Event()  # replaced at each change: a pulse

    def set_engine(self, engine: Engine) -> None:
        """A new engine, built for a welcome: it holds no version of ours."""
        self.engine = engine
        self._set_version(None)

    def drop(self) -> None:
        """Forget the version held and the one staged (another run's, or a resumed hub's)."""
        self._set_version(None)
        self._staged = None

    def stage(self, version: int, state: dict | None) -> None:
        """Hand a complete version to the swap loop (a newer one staged first replaces it);
        `state` None: nothing to load (a relay holds the version in its store)."""
        self._staged = (version, state)
        self._staged_event.set()

    async def wait_version(self, min_version: int) -> None:
        """Return once the engine holds a version >= `min_version`."""
        await self.until(lambda: self.version is not None and self.version >= min_version)

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds, looked at again at each `changed`: each version
        change here, and each event from the hub the client handles (so a condition on any of
        the peer's state is waited on, not polled)."""
        while not condition():
            await self._changes.wait()

    async def announce(self) -> None:
        """Tell the hub what we hold (a new connection's first word)."""
        if self.version is not None:
            await self._send(m.VersionHeld(self.version))

    async def swap_versions(self) -> None:
        """The swap loop, across connections: load what is staged, then say we hold it."""
        while True:
            await self._staged_event.wait()
            self._staged_event.clear()
            staged, self._staged = self._staged, None
            if staged is None:
                continue
            version, state = staged
            first = self.version is None
            started = time.monotonic()
            if state is None:
                self.version = version
            else:
                await asyncio.to_thread(self._load, version, state)
            # INFO for the first version only: one a step is DEBUG, the client sums them up.
            log.log(logging.INFO if first else logging.DEBUG, "now holding v%d (%sswapped in "
                    "%.2f s)", version, "the first version, " if first else "",
                    time.monotonic() - started)
            self.changed()
            await self._send(m.VersionHeld(version))

    def _load(self, version: int, state: dict) -> None:
        with self.engine_lock:
            self.engine.load_weights(state)
            self.version = version
        self.loaded += 1

    def _set_version(self, version: int | None) -> None:
        self.version = version
        self.changed()

    def changed(self) -> None:
        """Wake `until`'s waiters."""
        self._changes.set()
        self._changes = asyncio.Event()


def build_engine(cfg: PeerConfig, source: str) -> Engine:
    """Import torch and the engine, then build it from `source` (the verified model directory,
    or the built-in's name): for a worker thread, since the first import alone takes seconds
    (tens of them on a loaded machine) and would stall the event loop. A vLLM engine keeps its
    compile cache beside the model files (`vllm_cache_dir`) and sets its threads before torch
    is imported (`echo2p2p.policy.vllm_setup`)."""
    started = time.monotonic()
    if cfg.engine == "vllm":  # OMP_NUM_THREADS counts only if set before torch is imported
        from echo2p2p.policy.vllm_setup import prepare

        prepare(cache_dir=vllm_cache_dir(cfg), threads=cfg.torch_threads,
                on_cpu=cfg.device == "cpu")
    from echo2p2p.policy.engines import make_engine

    if cfg.engine == "vllm":
        engine = make_engine("vllm", source, cfg.device, dtype=cfg.dtype or "auto",
                             cache_dir=vllm_cache_dir(cfg), threads=cfg.torch_threads)
    else:
        if cfg.torch_threads:
            import torch

            torch.set_num_threads(cfg.torch_threads)
        engine = make_engine(cfg.engine, source, cfg.device, dtype=cfg.engine_dtype)  # --dtype
    log.info("%s engine ready in %.0f s", cfg.engine, time.monotonic() - started)
    return engine


async def wait_built(building: asyncio.Future, kind: str) -> Engine:
    """The engine once `building` (`build_engine` in a worker thread) has it, saying every
    BUILD_NOTICE_S how long the start of a `kind` engine has taken so far: a vLLM engine's first
    start compiles the model, minutes on a CPU, and the peer said nothing meanwhile.
    `asyncio.wait` never cancels what it waits on: a connection lost meanwhile leaves the build
    running, for the next connection to wait on."""
    started = time.monotonic()
    while not (await asyncio.wait({building}, timeout=BUILD_NOTICE_S))[0]:
        log.info("still starting the %s engine: %.0f s so far%s", kind,
                 time.monotonic() - started, VLLM_FIRST_START if kind == "vllm" else "")
    return building.result()


BUILD_NOTICE_S = 30.0  # how often a peer says its engine is still starting
VLLM_FIRST_START = " (a first start compiles the model; a restart loads it from the cache)"


def vllm_cache_dir(cfg: PeerConfig) -> Path:
    """Where a vLLM peer keeps vLLM's compile cache: beside its model files (`--model-cache`),
    so a restart loads the compiled model instead of compiling it again (minutes on a CPU)."""
    return cfg.model_cache_dir / "vllm"
