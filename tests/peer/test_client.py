"""The PeerClient's waiting functions and statistics, against a real hub on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import FrozenInstanceError, replace

import pytest

from echo2p2p.overlay.store import ChunkStore
from echo2p2p.peer import client
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.connection import Backoff
from echo2p2p.peer.worker import Rollouts

from tests.blob_versions import blob_version
from tests.conftest import tracker, until_logged
from echo2p2p.hub.core.events import VersionPublished


def relay_peer(url: str) -> PeerClient:
    """A peer that needs no model: it joins, holds and serves versions."""
    return PeerClient(PeerConfig(hub_url=url, engine="relay", listen="", name="waits"))


async def test_waits_follow_the_connection_and_the_versions_held():
    """wait_welcomed / wait_connected return once joined; wait_version(v) once v (or newer) is
    held, at once when it already is; statistics() counts the connection and the bytes."""
    async with tracker() as (hub, key, url, _):
        peer = relay_peer(url)
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(peer.run(stop))
            try:
                await asyncio.wait_for(peer.wait_welcomed(), 30)
                await asyncio.wait_for(peer.wait_connected(), 30)
                waiting = tg.create_task(peer.wait_version(1))
                hub.feed(VersionPublished(blob_version(key, 0, b"\1" * 40_000)))
                await asyncio.wait_for(peer.wait_version(0), 30)
                assert peer.version == 0 and not waiting.done()
                hub.feed(VersionPublished(blob_version(key, 1, b"\2" * 40_000)))
                await asyncio.wait_for(waiting, 30)
                await asyncio.wait_for(peer.wait_version(0), 1)  # held already: no wait
            finally:
                stop.set()
    s = peer.statistics()
    assert (s.connections, s.version, s.versions_loaded, s.submitted) == (1, 1, 0, 0)
    assert s.downloaded_bytes > 0
    with pytest.raises(FrozenInstanceError):
        s.version = 2  # type: ignore[misc]


async def test_wait_connected_waits_for_a_hub():
    """With no hub to reach, neither wait returns; the peer keeps retrying until stopped."""
    peer = PeerClient(replace(PeerConfig(hub_url="ws://127.0.0.1:9/ws", engine="relay",
                                         listen=""), reconnect_max_s=0.2))
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(peer.run(stop))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(peer.wait_connected(), 1.0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(peer.wait_welcomed(), 0.1)
        stop.set()
    assert peer.statistics().connections == 0 and peer.welcome is None


def test_backoff_doubles_with_jitter_up_to_its_cap_and_starts_over_when_reset():
    """Delays in [half, all] of 0.5, 1, 2, 4, then the cap; reset starts at 0.5 again."""
    backoff = Backoff(max_s=4.0)
    for full in (0.5, 1.0, 2.0, 4.0, 4.0, 4.0):
        assert full / 2 <= backoff.delay() <= full
    backoff.reset()
    assert 0.25 <= backoff.delay() <= 0.5


class MarkedStore(ChunkStore):
    """A chunk store a test can tell apart from the honest one."""


def test_the_parts_a_peer_is_given_stay_in_place_across_a_new_run():
    """A store maker passed in makes the fetcher's store, and its next one when a new run drops
    every version held; a rollouts wrapper passed in is what the worker asks for groups."""
    wrapped = []

    def liar(honest: Rollouts) -> str:
        wrapped.append(honest)
        return "the liar's rollouts"

    peer = PeerClient(PeerConfig(hub_url="ws://127.0.0.1:9/ws", engine="relay", listen=""),
                      chunk_store=MarkedStore, rollouts=liar)
    first = peer.fetcher.store
    peer.fetcher.drop_versions()
    assert type(first) is type(peer.fetcher.store) is MarkedStore
    assert peer.fetcher.store is not first
    assert peer.worker.rollouts == "the liar's rollouts"
    assert isinstance(wrapped[0], Rollouts) and wrapped[0].swapper is peer.swapper


async def test_the_log_says_the_first_version_then_sums_up(caplog, monkeypatch):
    """At INFO a peer says which version it holds first, then only sums up (at most every
    SUMMARY_EVERY_S, here at every heartbeat): `waiting for the first version` before it has
    one, never `vNone`; the versions after the first are DEBUG lines, and the summaries count
    them."""
    monkeypatch.setattr(client, "SUMMARY_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="echo2p2p.peer")

    def said(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno >= logging.INFO and text in r.getMessage()]

    async with tracker() as (hub, key, url, _):
        peer = PeerClient(PeerConfig(hub_url=url, engine="relay", listen="", heartbeat_s=0.05))
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(peer.run(stop))
            try:
                await until_logged(lambda: said("waiting for the first version"), 30)
                for version in range(3):
                    hub.feed(VersionPublished(blob_version(key, version, bytes([version + 1]) * 40_000)))
                    await asyncio.wait_for(peer.wait_version(version), 30)
                await until_logged(lambda: said("holding v2 ("), 30)
            finally:
                stop.set()
    [first] = said("now holding")  # at INFO, the first only
    assert first.startswith("now holding v0 (the first version, swapped in "), first
    assert not said("complete in") and not said("vNone")
    fetched = [int(n) for line in said("holding v")
               for n in re.findall(r"(\d+) versions fetched", line)]
    assert sum(fetched) == 3, said("holding v")
