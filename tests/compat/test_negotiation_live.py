"""Protocol negotiation on real sockets (127.0.0.1): a peer of protocol 2 (a hello with no
`protocol`, as the previous release sends it) served in 2; this release's peer agreeing 3, told
it is a leaf; a protocol-1 hello refused with the one sentence; this release's `echo2-peer join`
against a hub that refuses it (it prints the sentence and exits 1) and against a hub that does
not answer `protocol` (it speaks 2); gossip links agreeing their version in the upgrade, with a
dialler or an acceptor that sends no header (an older release's) and with one too old."""

from __future__ import annotations

import os

import aiohttp
import msgpack
from aiohttp import web

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.frames import decode_frame, encode_frame
from echo2p2p.negotiation import FEATURES_HEADER, LEAF_NOTICE, PROTOCOL_HEADER, Speaks, refusal
from echo2p2p.overlay import link as lk
from echo2p2p.overlay.links import answer_of
from echo2p2p.overlay.tickets import TICKET_HEADER
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.connection import HubConnection, connect
from echo2p2p.peer_protocol import PeerProtocol

from tests.blob_versions import blob_version
from tests.conftest import Pulse, serving, tracker, until
from tests.peer.test_gossip import admitted
from tests.peer.test_join_errors import assert_gave_up, join
from tests.peer.test_overlay import CHUNK, Peers, joined
from echo2p2p.hub.core.events import VersionPublished

OLD_HELLO = {"p": 2, "t": "hello", "name": "old", "engine": "relay", "device": "cpu",
             "price_per_hour": 0.0, "listen_addr": None, "token": "", "nonce": b"", "peer_key": b""}


def unpack(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


async def close_of(ws) -> tuple[int, str, list[dict]]:
    """Read until the hub closes: (close code, close reason, the frames before it)."""
    frames = []
    while (msg := await ws.receive(timeout=30)).type is aiohttp.WSMsgType.BINARY:
        frames.append(unpack(msg.data))
    return msg.data, msg.extra, frames


async def test_a_protocol_2_peer_is_served_in_2():
    """A hello with no `protocol`: the welcome is framed 2 and names 2, no features, no leaf
    notice; the hub reads its frames of 2, and one of 3 closes it with 4000."""
    async with tracker() as (hub, key, url, _), aiohttp.ClientSession() as http, \
            http.ws_connect(url) as ws:
        await ws.send_bytes(msgpack.packb(OLD_HELLO, use_bin_type=True))
        welcome = unpack(await ws.receive_bytes(timeout=30))
        assert (welcome["p"], welcome["t"], welcome["protocol"]) == (2, "welcome", 2)
        assert welcome["features"] == [] and welcome["leaf"] is False
        await ws.send_bytes(m.encode(m.Heartbeat(), 2))
        await ws.send_bytes(m.encode(m.LeaseRequest(1), 3))
        code, reason, frames = await close_of(ws)
        assert code == 4000 and "unsupported protocol version 3, expected 2" in reason
        assert all(f["p"] == 2 for f in frames)
        assert hub.statistics().closed_for_protocol == 1


async def test_this_releases_hello_agrees_3_and_a_leaf_is_told():
    """The hello as this release's peer frames it (2, offering 3 and its features): the
    welcome is framed 3 and says leaf, since the hello names no chunk server."""
    peer_key = signing.public_key(signing.new_private_key())
    async with tracker() as (hub, key, url, _), aiohttp.ClientSession() as http:
        for listen, leaf in ((None, True), ("http://127.0.0.1:9/", False)):
            nonce = os.urandom(16)
            protocol = PeerProtocol(0.0, hub_url=url, peer_key=peer_key, nonce=nonce)
            async with http.ws_connect(url) as ws:
                hello = protocol.hello(m.Hello("new", "relay", "cpu", listen_addr=listen,
                                               nonce=nonce, peer_key=peer_key))
                assert unpack(hello)["p"] == 2
                await ws.send_bytes(hello)
                frame = await ws.receive_bytes(timeout=30)
                assert unpack(frame)["p"] == 3
                welcome = protocol.receive_welcome(frame, 0.0)
                assert (welcome.protocol, welcome.features, welcome.leaf) == (3, [LEAF_NOTICE], leaf)


async def test_a_protocol_1_hello_is_refused_with_the_sentence():
    """Framed 1 (as protocol 1 framed it) or framed 2 saying 1: a goodbye and a close 4000,
    both with the sentence."""
    sentence = refusal(3, 1)
    framed_1 = msgpack.packb({**OLD_HELLO, "p": 1}, use_bin_type=True)
    saying_1 = msgpack.packb({**OLD_HELLO, "protocol": 1}, use_bin_type=True)
    async with tracker() as (hub, key, url, _), aiohttp.ClientSession() as http:
        for hello in (framed_1, saying_1):
            async with http.ws_connect(url) as ws:
                await ws.send_bytes(hello)
                code, reason, frames = await close_of(ws)
                assert (code, reason) == (4000, sentence)
                assert [(f["t"], f["code"], f["reason"]) for f in frames] == [
                    ("goodbye", 4000, sentence)]
        assert not hub.peer_views()


async def test_the_peer_refused_by_a_newer_hub_prints_the_sentence_and_exits():
    """`echo2-peer join` against a hub that speaks only protocol 4: one sentence, exit 1, no
    retry."""
    def future(hub) -> None:
        hub._speaks = Speaks((4,))

    async with tracker(future) as (hub, key, url, _):
        code, err = await join(url)
    last = assert_gave_up(code, err)
    assert last == f"echo2-peer: {refusal(4, 3)}"
    assert "retrying" not in err


async def test_the_peer_speaks_2_to_a_hub_that_does_not_answer_protocol():
    """A hub of the previous release (a welcome with no `protocol`, framed 2): this release's
    connection then frames everything 2."""
    heard: list[dict] = []
    hearing = Pulse()  # at each frame heard
    welcome = {k: v for k, v in m.to_wire(m.Welcome("p1", "run", "tiny", "add", 0, 1, 2, 1.0,
                                                    1.0, 8, 0)).items()
               if k not in ("protocol", "features", "leaf")}

    async def old_hub(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            heard.append(unpack(msg.data))
            hearing.fire()
            if heard[-1]["t"] == "hello":
                await ws.send_bytes(msgpack.packb({"p": 2, "t": "welcome", **welcome},
                                                  use_bin_type=True))
        return ws

    app = web.Application()
    app.router.add_get("/ws", old_hub)
    async with serving(app) as port, aiohttp.ClientSession() as http:
        url = f"ws://127.0.0.1:{port}/ws"
        cfg = PeerConfig(hub_url=url, engine="relay", listen="")
        ws, protocol, got = await connect(http, url, cfg, signing.new_private_key(), None)
        async with ws:
            assert got.protocol == 2 and protocol.agreed.protocol == 2
            conn = HubConnection(ws, protocol, http, "", 10.0, None)
            await conn.send(m.LeaseRequest(1))
            await conn.send(m.Heartbeat())
            await hearing.until(lambda: len(heard) == 3)
    assert [(f["t"], f["p"]) for f in heard] == [("hello", 2), ("lease_request", 2),
                                                  ("heartbeat", 2)]
    assert heard[0]["protocol"] == 3  # offered, and not taken up


# --- gossip links ----------------------------------------------------------------------------


async def test_a_link_agrees_its_version_in_the_upgrade():
    """This release's acceptor: a dialler with no header (the previous release) gets a link of
    2 (its proof framed 2), one offering 3 gets 3 (answered in the 101's headers, the proof
    framed 3), one offering 1 gets 426 with the sentence; and two peers of this release link
    in 3."""
    async with tracker(relay="gossip") as (hub, key, url, _), Peers(url, 2) as (peer, other):
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 2)
        hub.feed(VersionPublished(blob_version(key, 1, os.urandom(64 << 10), chunk_bytes=CHUNK)))
        for links in (peer.fetcher.links, other.fetcher.links):
            await until(links, lambda: bool(links.links))  # at each peer
        assert {link.protocol for c in (peer, other) for link in c.fetcher.links.links.values()} == {3}
        target, dialler = peer.welcome.peer_id, admitted(key, "p99")
        async with aiohttp.ClientSession() as http:
            for offer, agreed in ((None, 2), ("3", 3), ("7", 3)):
                headers = dialler.header(target)
                if offer is not None:
                    headers |= {PROTOCOL_HEADER: offer, FEATURES_HEADER: "unknown-one"}
                async with http.ws_connect(peer.served_url + lk.LINK_PATH, params={"id": "p99"},
                                           headers=headers) as ws:
                    assert answer_of(ws).protocol == agreed
                    assert ws._response.headers[PROTOCOL_HEADER] == str(agreed)
                    proof = await ws.receive_bytes(timeout=30)
                    assert unpack(proof)["p"] == agreed
                    rec, _ = decode_frame(proof, lk.LINK_LIMITS, lk.FRAMES, (agreed,))
                    assert isinstance(rec, lk.Proof)
                links = peer.fetcher.links
                await until(links, lambda: "p99" not in links.links)
            async with http.get(peer.served_url + lk.LINK_PATH, params={"id": "p99"},
                                headers=dialler.header(target) | {PROTOCOL_HEADER: "1"}) as resp:
                assert resp.status == 426
                assert await resp.text() == refusal(3, 1, "peer", "dialling peer")


async def test_a_dialler_speaks_2_to_an_acceptor_that_answers_no_header():
    """An acceptor of the previous release (no header in its 101, its proof framed 2): this
    release's dialler frames every frame of that link 2."""
    heard: list[dict] = []
    hearing = Pulse()  # at each frame heard
    proof_for: dict[str, bytes] = {}

    async def old_acceptor(request: web.Request) -> web.WebSocketResponse:
        assert request.headers[PROTOCOL_HEADER] == "3"  # offered
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(encode_frame("proof", lk.Proof(proof_for["header"]), 2))
        async for msg in ws:
            heard.append(unpack(msg.data))
            hearing.fire()
        return ws

    app = web.Application()
    app.router.add_get(lk.LINK_PATH, old_acceptor)
    async with tracker(relay="gossip") as (hub, key, url, _), Peers(url, 1) as [peer], \
            serving(app) as port:
        hub.feed(VersionPublished(blob_version(key, 0, b"\0" * 1024, chunk_bytes=CHUNK)))
        await joined(hub, 1)
        links = peer.fetcher.links
        await until(links, lambda: links.http is not None)
        old = admitted(key, "p77")
        proof_for["header"] = old.header(peer.welcome.peer_id)[TICKET_HEADER].encode()
        links.heard_of([m.RelaySource("p77", f"http://127.0.0.1:{port}")])
        await until(links, lambda: "p77" in links.links)
        await hearing.until(lambda: heard)
        assert links.links["p77"].protocol == 2
        await hearing.until(lambda: any(f["t"] == "peers" for f in heard))
    assert heard and all(f["p"] == 2 for f in heard), heard
