"""Shared fixtures: a small hub config and real in-process peers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

# Tests never download: a hub id that is not on disk must fail at once, not after network retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echo2p2p import signing
from echo2p2p.completions import CompletionDecoder
from echo2p2p.tasks import AdditionTask
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.serving.app import serve
from echo2p2p.hub.serving.server import Hub, TokenizedProblem
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig


# Directories of system tests: whole runs in several processes or long real training. They are
# marked `system`, which the default run leaves out (pyproject.toml) and `pytest -m system` runs.
SYSTEM_DIRS = ("chaos", "hostile", "vllm")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the slow-marked tests")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks
def pytest_collection_modifyitems(config, items):
    system = [Path(__file__).parent / name for name in SYSTEM_DIRS]
    for item in items:
        if any(d in item.path.parents for d in system):
            item.add_marker(pytest.mark.system)
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with pytest --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def hub_cfg(tmp_path) -> HubConfig:
    """The built-in model and task, small batches, an ephemeral port, a temp run dir."""
    return HubConfig.from_flat(port=0, prompts_per_step=4, group_size=4, eval_every=0, eval_problems=32,
                     run_dir=str(tmp_path / "run"), torch_threads=1, seed=1)


@contextlib.asynccontextmanager
async def running_peers(url: str, n: int = 1, engines: list | None = None,
                        **overrides) -> AsyncIterator[list[PeerClient]]:
    """`n` real peers joined to `url`, stopped on exit."""
    stop = asyncio.Event()
    peers = [PeerClient(replace(PeerConfig(hub_url=url, name=f"test-{i}"), **overrides),
                        engine=engines[i] if engines else None) for i in range(n)]
    async with asyncio.TaskGroup() as tg:
        for p in peers:
            tg.create_task(p.run(stop))
        try:
            yield peers
        finally:
            stop.set()


class Records(list):
    """The records a hub logs (pass `records.append` as its `on_event`), with a wait for one.
    Appended to on the event loop, as the hub logs."""

    def __init__(self) -> None:
        super().__init__()
        self._added = asyncio.Event()  # replaced at each record: a pulse

    def append(self, record: dict) -> None:
        super().append(record)
        self._added.set()
        self._added = asyncio.Event()

    def first(self, event: str, **fields) -> dict | None:
        """The first record of `event` with these field values, if logged yet."""
        return next((r for r in self if r.get("event") == event
                     and all(r.get(k) == v for k, v in fields.items())), None)

    async def wait_for(self, event: str, timeout_s: float = 60.0, **fields) -> dict:
        """The first record of `event` with these field values, once logged."""
        async with asyncio.timeout(timeout_s):
            while (found := self.first(event, **fields)) is None:
                await self._added.wait()
        return found


async def wait_versions(peers: list[PeerClient], version: int, timeout_s: float = 60.0) -> None:
    """Return once every peer's engine (a relay's store) holds `version` or a newer one."""
    async with asyncio.timeout(timeout_s):
        await asyncio.gather(*(p.wait_version(version) for p in peers))


async def wait_first(*waits: Awaitable, timeout_s: float = 60.0) -> None:
    """Return once the first of `waits` is done (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        assert done, "nothing awaited was done in time"
        for task in done:
            task.result()  # its error, if it raised
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def tracker(setup=None, **overrides) -> AsyncIterator[tuple[Hub, bytes, str, Records]]:
    """A hub with no learner, on 16 KiB chunks: it only admits peers, announces versions and
    plans their broadcast, and scores rollouts by the built-in tokenizer; a tracker
    (`relay="pipelined"`) unless `overrides` name another relay. `setup(hub)` runs before it
    serves. Yields (hub, signing key, ws URL, the records it logged)."""
    from echo2p2p.policy.model import build_char_tokenizer

    cfg = HubConfig.from_flat(port=0, chunk_bytes=16 << 10, relay="pipelined").replace(**overrides)
    key = signing.new_private_key()
    task = AdditionTask()
    problems = [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]]
    records = Records()
    hub = Hub(cfg, "run", task, problems, key, on_event=records.append,
              decode=CompletionDecoder(build_char_tokenizer()))
    if setup is not None:
        setup(hub)
    scheme = "wss" if cfg.network.tls_cert else "ws"
    async with serve(hub, "127.0.0.1", 0) as port:
        yield hub, key, f"{scheme}://127.0.0.1:{port}/ws", records


@contextlib.asynccontextmanager
async def serving(app: web.Application, runner: web.AppRunner | None = None
                  ) -> AsyncIterator[int]:
    """`app` served on 127.0.0.1 port 0 (by `runner`, default a plain AppRunner), stopped on
    exit; yields the bound port."""
    runner = runner or web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


def markdown_table(cells: list[tuple[str, ...]]) -> list[str]:
    """A header row and data rows of strings as the lines of an aligned markdown table."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def _described(condition) -> str:
    """What `condition` checks, for a failure message: its source line where it has one."""
    try:
        return inspect.getsource(condition).strip()
    except (OSError, TypeError):
        return repr(condition)


async def until(source, condition, timeout_s: float = 60.0) -> None:
    """Return once `condition()` holds, looked at again after each event `source` reports
    (`source.until`: a `Hub`'s, after each event it handles: a frame, a judged submission, a
    step, a publication, a lease expiry, a record; a peer's `Links`', a `Swapper`'s): no
    polling. Fails after `timeout_s`, saying what was awaited."""
    try:
        async with asyncio.timeout(timeout_s):
            await source.until(condition)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s:g} s: {_described(condition)}") from None


async def peer_until(peer: PeerClient, condition, timeout_s: float = 60.0) -> None:
    """`until` on `peer`'s state: looked at again after each event from the hub it handles
    and each version it takes (`Swapper.until`)."""
    await until(peer.swapper, condition, timeout_s)


async def within(awaitable: Awaitable, timeout_s: float = 60.0, what: str = "") -> object:
    """`awaitable`'s result, failing (not hanging) if it takes over `timeout_s`: for a wait on
    one of a peer's events, saying what was awaited."""
    try:
        async with asyncio.timeout(timeout_s):
            return await awaitable
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s:g} s: {what or awaitable!r}") from None


class Pulse:
    """A test's own event, fired by the test's code at each change it makes (a wrapped
    callback that counts, a fake server that hears a frame), with a wait for a condition on
    what changed: no polling."""

    def __init__(self) -> None:
        self._fired = asyncio.Event()

    def fire(self) -> None:
        self._fired.set()

    async def until(self, condition, timeout_s: float = 60.0) -> None:
        """Return once `condition()` holds, looked at again after each `fire`; fails after
        `timeout_s`, saying what was awaited."""
        try:
            async with asyncio.timeout(timeout_s):
                while not condition():
                    await self._fired.wait()
                    self._fired.clear()
        except TimeoutError:
            raise AssertionError(f"not within {timeout_s:g} s: {_described(condition)}") from None


async def until_logged(condition, timeout_s: float = 60.0) -> None:
    """Return once `condition()` holds, looked at again after each record logged (what a test
    reads from `caplog`, e.g. a line a peer says): no polling. Fails after `timeout_s`."""
    loop, pulse = asyncio.get_running_loop(), Pulse()

    class Fire(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            loop.call_soon_threadsafe(pulse.fire)  # a part may log from a worker thread

    handler = Fire()
    logging.getLogger().addHandler(handler)
    try:
        await pulse.until(condition, timeout_s)
    finally:
        logging.getLogger().removeHandler(handler)


async def wait_until(condition, timeout_s: float = 60.0) -> None:
    """Poll a condition that no event reports (another object's counters), with a deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
