"""Hub-signed manifests: a peer assembles only what the hub's key vouches for."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.errors import RemoteProtocolError, SnapshotError
from echo2p2p.session import Session, Side
from echo2p2p.snapshot import build_snapshot
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig

from tests.conftest import serving

MANIFEST, CHUNKS = build_snapshot(3, [("w", "float32", [4], bytes(range(16)))], chunk_bytes=8)


def test_signature_covers_every_chunk_digest():
    """A valid signature verifies; changing one chunk digest or the key makes it fail."""
    key = signing.new_private_key()
    pub = signing.public_key(key)
    sig = signing.sign_manifest(key, MANIFEST)
    signing.verify_manifest(pub, MANIFEST, sig)
    bad_chunk = replace(MANIFEST.chunks[0], digest=b"\0" * 32)
    tampered = replace(MANIFEST, chunks=[bad_chunk, *MANIFEST.chunks[1:]])
    with pytest.raises(SnapshotError):
        signing.verify_manifest(pub, tampered, sig)
    with pytest.raises(SnapshotError):
        signing.verify_manifest(signing.public_key(signing.new_private_key()), MANIFEST, sig)


async def test_peer_refuses_a_hub_whose_key_is_not_the_pinned_one(hub_cfg):
    """With --hub-key pinned to another key the peer hangs up right after the welcome."""
    other = signing.public_key(signing.new_private_key()).hex()
    async with start_hub(hub_cfg.replace(max_steps=0), stream=None) as run:
        peer = PeerClient(PeerConfig(hub_url=run.url, hub_key=other))
        async with aiohttp.ClientSession() as http:
            with pytest.raises(RemoteProtocolError, match="pinned"):
                await peer.serve_connection(http)
        pinned = PeerClient(PeerConfig(hub_url=run.url, hub_key=run.hub.core.hub_key.hex()))
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(pinned.run(stop))
            try:  # the signed v0 arrives, verifies and is swapped in
                await asyncio.wait_for(pinned.wait_version(0), 60)
            except TimeoutError:
                raise AssertionError("v0 never swapped in") from None
            finally:
                stop.set()
    assert pinned.version == 0


@contextlib.asynccontextmanager
async def fake_hub(handler):
    """A websocket route /ws on 127.0.0.1 served by `handler`; yields its URL."""
    app = web.Application()
    app.router.add_get("/ws", handler)
    async with serving(app) as port:
        yield f"ws://127.0.0.1:{port}/ws"


async def test_peer_rejects_an_unsigned_manifest():
    """A hub that announces a manifest its key did not sign gets the connection closed."""
    key = signing.new_private_key()
    closed: list[tuple[int, str]] = []

    async def impostor(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        s = Session(Side.HUB, 0.0)
        hello = s.receive((await ws.receive()).data, 0.0)
        proof = signing.sign_welcome(key, hello.nonce, "run", "p1", hello.peer_key)
        await ws.send_bytes(s.send(m.Welcome("p1", "run", "tiny", "addition", 3, 1, 2, 1.0, 1.0,
                                             4, 0, signing.public_key(key), proof=proof)))
        await ws.send_bytes(s.send(m.VersionAnnouncement(
            MANIFEST, m.RelayPlan(MANIFEST.version, None, 1, [], b"\xff" * 4 * len(MANIFEST.chunks)),
            b"\0" * 64)))
        async for _ in ws:
            pass
        closed.append((ws.close_code, ""))
        return ws

    async with fake_hub(impostor) as url, aiohttp.ClientSession() as http:
        peer = PeerClient(PeerConfig(hub_url=url))
        assert await peer.serve_connection(http)  # welcomed, then it hangs up on the manifest
    assert closed == [(m.CLOSE_PROTOCOL_ERROR, "")]
    assert peer.version is None


@pytest.mark.parametrize("signer", ["none", "other key", "other nonce"])
async def test_pinned_peer_refuses_an_impostor_that_echoes_the_hub_key(signer):
    """A hub that welcomes with the real hub's public key but cannot sign the peer's fresh
    nonce with it (no proof, another key's, or a proof replayed from another hello) is refused
    by a peer pinning that key: the handshake fails and nothing is adopted."""
    real = signing.new_private_key()

    async def impostor(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        s = Session(Side.HUB, 0.0)
        hello = s.receive((await ws.receive()).data, 0.0)
        proof = {"none": b"",
                 "other key": signing.sign_welcome(signing.new_private_key(), hello.nonce, "run",
                                                   "p1", hello.peer_key),
                 "other nonce": signing.sign_welcome(real, b"\1" * 32, "run", "p1",
                                                     hello.peer_key)}[signer]
        await ws.send_bytes(s.send(m.Welcome("p1", "run", "tiny", "addition", 3, 1, 2, 1.0, 1.0,
                                             4, 0, signing.public_key(real), proof=proof)))
        async for _ in ws:
            pass
        return ws

    async with fake_hub(impostor) as url, aiohttp.ClientSession() as http:
        peer = PeerClient(PeerConfig(hub_url=url, hub_key=signing.public_key(real).hex()))
        with pytest.raises(RemoteProtocolError, match="cannot prove"):
            await peer.serve_connection(http)
    assert peer.welcome is None and peer.swapper.engine is None
