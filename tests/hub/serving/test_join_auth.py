"""Who may join: join tokens (create, list, revoke; refused with a reason), a TLS hub, and
chunk tickets (only this run's peers may fetch chunks)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from dataclasses import replace

import aiohttp
import pytest

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.errors import ConfigError, JoinRefused
from echo2p2p.session import Session, Side
from echo2p2p.hub.cli import main as hub_main
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.serving.tokens import TokenBook
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.overlay.tickets import TICKET_HEADER, Credentials

from tests.blob_versions import blob_version
from tests.conftest import tracker
from echo2p2p.hub.core.events import VersionPublished


def relay_peer(url: str, **overrides) -> PeerClient:
    """A peer that needs no model: it only joins and receives versions."""
    return PeerClient(replace(PeerConfig(hub_url=url, engine="relay", listen="", name="auth"),
                              **overrides))


def test_token_book_keeps_hashes_and_sees_revocations_from_another_process(tmp_path):
    path = tmp_path / "tokens.json"
    cli, hub = TokenBook(path), TokenBook(path)  # `echo2-hub token` and a running hub
    token = cli.create("alice")
    assert hub.refusal(token) is None
    token_id, secret = token.split(".")
    assert secret not in path.read_text() and (path.stat().st_mode & 0o777) == 0o600
    assert "required" in hub.refusal("")
    assert hub.refusal(f"{token_id}.wrong") == "join token not recognised"
    assert hub.refusal(f"nobody.{secret}") == "join token not recognised"
    assert hub.refusal("no-dot-at-all") == "join token not recognised"
    other = cli.create("bob")
    assert cli.revoke(token_id) and cli.revoke(token_id) and not cli.revoke("nope")
    assert hub.refusal(token) == "join token revoked"
    assert hub.refusal(other) is None
    assert [(e["name"], e["revoked"] is not None) for e in hub.entries()] == [
        ("alice", True), ("bob", False)]


def test_token_cli(tmp_path, capsys):
    path = str(tmp_path / "t.json")
    assert hub_main(["token", "create", "--file", path, "--name", "lab-gpu"]) == 0
    token = capsys.readouterr().out.strip()
    assert TokenBook(path).refusal(token) is None
    assert hub_main(["token", "list", "--file", path]) == 0
    token_id = token.split(".")[0]
    assert capsys.readouterr().out.split() == [token_id, "active", "lab-gpu"]
    assert hub_main(["token", "revoke", token_id, "--file", path]) == 0
    assert TokenBook(path).refusal(token) == "join token revoked"
    assert hub_main(["token", "revoke", "nope", "--file", path]) == 1
    assert "no token 'nope'" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert hub_main(["token", "list", "--file", str(tmp_path / "bad.json")]) == 1


@pytest.mark.parametrize("token, reason", [("", "join token is required"),
                                           ("abc.def", "not recognised")])
async def test_join_without_a_valid_token_is_refused_for_good(tmp_path, token, reason):
    TokenBook(tmp_path / "t.json").create()
    async with tracker(tokens=str(tmp_path / "t.json")) as (hub, _, url, _):
        with pytest.raises(JoinRefused, match=reason):
            await asyncio.wait_for(relay_peer(url, token=token).run(), 30)
        assert hub.statistics().refused == 1 and not hub.peer_views()


async def test_revoked_token_sends_a_connected_peer_away(tmp_path):
    book = TokenBook(tmp_path / "t.json")
    token = book.create("volunteer")
    async with tracker(tokens=str(book.path), heartbeat_s=0.2) as (hub, key, url, _):
        peer = relay_peer(url, token=token)
        running = asyncio.create_task(peer.run())
        hub.feed(VersionPublished(blob_version(key, 0, b"\1" * 4096)))
        await asyncio.wait_for(hub.until(lambda: peer.fetcher.store.newest_stream() == 0), 60)
        assert len(hub.peer_views()) == 1
        book.revoke(token.split(".")[0])
        with pytest.raises(JoinRefused, match="revoked"):
            await asyncio.wait_for(running, 30)
        await asyncio.wait_for(hub.until(lambda: len(hub.peer_views()) == 0), 60)


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "echo2p2p test hub")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "hub.crt", tmp_path / "hub.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


async def test_tls_hub_serves_wss_and_https_to_peers_that_trust_it(tmp_path):
    cert, key_file = self_signed(tmp_path)
    async with tracker(tls_cert=cert, tls_key=key_file) as (hub, key, url, _):
        assert url.startswith("wss://")
        data = bytes(range(256)) * 256
        hub.feed(VersionPublished(blob_version(key, 0, data, chunk_bytes=16 << 10)))
        peer = relay_peer(url, ca_cert=cert)
        stop = asyncio.Event()
        running = asyncio.create_task(peer.run(stop))
        await asyncio.wait_for(hub.until(lambda: peer.fetcher.store.newest_stream() == 0), 60)  # chunks came over https
        stop.set()
        await running
        # Without the certificate the connection fails verification: nothing in plain text.
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await http.ws_connect(url)
            with pytest.raises(aiohttp.ClientError):
                await http.ws_connect(url.replace("wss://", "ws://"))


def test_tls_and_auth_settings_are_checked_by_name(tmp_path):
    with pytest.raises(ConfigError) as exc:
        HubConfig.from_flat(tls_cert="hub.crt")
    assert exc.value.field == "tls_key"
    with pytest.raises(ConfigError) as exc:
        PeerConfig(ca_cert=str(tmp_path / "missing.pem"))
    assert exc.value.field == "ca_cert"


async def test_unloadable_certificate_names_the_field(tmp_path):
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError) as exc:
        async with tracker(tls_cert=str(tmp_path / "junk.pem"), tls_key=str(tmp_path / "junk.pem")):
            pass
    assert exc.value.field == "tls_cert"


async def test_chunks_go_only_to_holders_of_this_runs_ticket():
    """The hub's chunk route and a peer's chunk server answer 403 without a ticket, with one
    signed by another key, for another run, peer id or peer key, or with a request signature
    addressed to another server (a replayed header); 200 with a valid one for that server."""
    async with tracker() as (hub, key, url, _):
        hub.feed(VersionPublished(blob_version(key, 0, b"\7" * 4096)))
        peer = relay_peer(url, listen="127.0.0.1:0")
        stop = asyncio.Event()
        running = asyncio.create_task(peer.run(stop))
        await asyncio.wait_for(hub.until(lambda: peer.fetcher.store.newest_stream() == 0), 60)
        await asyncio.wait_for(peer.wait_welcomed(), 60)
        hub_base = url.replace("ws://", "http://").removesuffix("/ws")
        other_key, mine = signing.new_private_key(), signing.new_private_key()
        pub = signing.public_key(mine)

        def creds(ticket: bytes, private: bytes = mine, peer_id: str = "p9") -> Credentials:
            return Credentials("run", peer_id, private, ticket)

        honest = creds(signing.sign_ticket(key, "run", "p9", pub))
        servers = ((hub_base, "hub"), (peer.served_url, peer.welcome.peer_id))
        async with aiohttp.ClientSession() as http:
            for (base, audience), (_, elsewhere) in zip(servers, reversed(servers)):
                bad = [{}, creds(signing.sign_ticket(other_key, "run", "p9", pub)).header(audience),
                       creds(signing.sign_ticket(key, "another run", "p9", pub)).header(audience),
                       creds(signing.sign_ticket(key, "run", "p8", pub)).header(audience),
                       creds(signing.sign_ticket(key, "run", "p9", pub), other_key).header(audience),
                       honest.header(elsewhere),  # seen by the other server, replayed here
                       {TICKET_HEADER: "p9.not-hex"}]
                for headers in bad:
                    async with http.get(f"{base}/chunk/0/full/0", headers=headers) as resp:
                        assert resp.status == 403, (base, headers)
                async with http.get(f"{base}/chunk/0/full/0", headers=honest.header(audience)) as resp:
                    assert resp.status == 200 and len(await resp.read()) > 0
        stop.set()
        await running


async def test_one_address_gets_only_its_share_of_connections():
    """Past --max-peers-per-address joined connections from one IP, the next connection is
    turned away before its websocket upgrade (HTTP 429, the reason as its body); the ones
    already joined stay."""
    async with tracker(max_peers_per_address=2) as (hub, _, url, _):
        async with aiohttp.ClientSession() as http:
            joined = []
            for _ in range(2):
                ws = await http.ws_connect(url)
                session = Session(Side.PEER, 0.0)
                await ws.send_bytes(session.send(m.Hello("many", "relay", "cpu")))
                assert isinstance(session.receive((await ws.receive()).data, 0.0), m.Welcome)
                joined.append(ws)
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(url)
            assert refused.value.status == 429
            async with http.get(url.replace("ws://", "http://")) as resp:
                assert resp.status == 429 and "too many connections" in await resp.text()
            assert len(hub.peer_views()) == 2 and hub.statistics().refused == 2
            for ws in joined:
                await ws.close()
