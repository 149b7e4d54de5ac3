"""Hub-signed manifests: Ed25519 over a canonical encoding of the manifest.

A manifest lists every chunk's digest, so a signature over it vouches for every chunk: a peer
that checks the manifest's signature against the hub's key, then each chunk's digest against
the manifest, may take chunks from anyone. The hub's public key reaches a peer in the Welcome,
and a peer may pin it (`echo2-peer join --hub-key HEX`) so that a hub impostor is refused.

Pure: keys come in and go out as raw 32-byte strings; storing them is the shell's job. The
signature uses `cryptography` (a well-kept binding to OpenSSL), never hand-rolled maths.
"""

from __future__ import annotations

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import messages as m
from .errors import SnapshotError

KEY_BYTES = 32


def new_private_key() -> bytes:
    """A fresh Ed25519 private key, raw 32 bytes."""
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def public_key(private_key: bytes) -> bytes:
    """The raw 32-byte public key of `private_key`."""
    return Ed25519PrivateKey.from_private_bytes(private_key).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _ticket_bytes(run_id: str, peer_id: str, peer_key: bytes) -> bytes:
    return (b"echo2p2p-ticket-v2\0" + run_id.encode() + b"\0" + peer_id.encode() + b"\0"
            + peer_key)


def sign_ticket(private_key: bytes, run_id: str, peer_id: str, peer_key: bytes) -> bytes:
    """The hub's word that `peer_id`, holding the private half of `peer_key`, belongs to run
    `run_id`: what chunk servers (the hub's and every peer's) ask of whoever requests a chunk.
    A ticket alone opens nothing: each request also carries the holder's `chunk_auth` for the
    server asked, so a server that sees a ticket cannot replay it to another."""
    return _sign(private_key, _ticket_bytes(run_id, peer_id, peer_key))


def verify_ticket(hub_key: bytes, run_id: str, peer_id: str, peer_key: bytes,
                  *, ticket: bytes) -> bool:
    """Whether `ticket` is the hub's signature admitting (`peer_id`, `peer_key`) to `run_id`."""
    return _verify(hub_key, ticket, _ticket_bytes(run_id, peer_id, peer_key))


def _auth_bytes(run_id: str, audience: str) -> bytes:
    return b"echo2p2p-chunk-auth-v1\0" + run_id.encode() + b"\0" + audience.encode()


def chunk_auth(private_key: bytes, run_id: str, audience: str) -> bytes:
    """A requester's signature, by its own key, naming the one server it is addressed to
    (`audience`: that server's peer id, or "hub")."""
    return _sign(private_key, _auth_bytes(run_id, audience))


def verify_chunk_auth(peer_key: bytes, run_id: str, audience: str, auth: bytes) -> bool:
    return _verify(peer_key, auth, _auth_bytes(run_id, audience))


def _welcome_bytes(nonce: bytes, run_id: str, peer_id: str, peer_key: bytes) -> bytes:
    return (b"echo2p2p-welcome-v1\0" + len(nonce).to_bytes(1, "big") + nonce + run_id.encode()
            + b"\0" + peer_id.encode() + b"\0" + peer_key)


def sign_welcome(private_key: bytes, nonce: bytes, run_id: str, peer_id: str,
                 peer_key: bytes) -> bytes:
    """The hub's proof that it holds its key: a signature over the peer's fresh hello nonce
    and what the welcome gives it (run, peer id) and the peer key its ticket binds."""
    return _sign(private_key, _welcome_bytes(nonce, run_id, peer_id, peer_key))


def verify_welcome(hub_key: bytes, nonce: bytes, run_id: str, peer_id: str, peer_key: bytes,
                   proof: bytes) -> bool:
    return _verify(hub_key, proof, _welcome_bytes(nonce, run_id, peer_id, peer_key))


def _model_files_bytes(index_digest: bytes) -> bytes:
    return b"echo2p2p-model-files-v1\0" + index_digest


def sign_model_files(private_key: bytes, index_digest: bytes) -> bytes:
    """The hub's word that the model-files index hashing to `index_digest` (32 bytes,
    `echo2p2p.model_index.index_digest`) is its model's: the index lists every file's digest,
    so this vouches for every file, wherever a peer fetched it."""
    return _sign(private_key, _model_files_bytes(index_digest))


def verify_model_files(hub_key: bytes, index_digest: bytes, signature: bytes) -> bool:
    return _verify(hub_key, signature, _model_files_bytes(index_digest))


def _sign(private_key: bytes, data: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private_key).sign(data)


def _verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    if len(public_key) != KEY_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def manifest_bytes(manifest: m.Manifest) -> bytes:
    """The canonical bytes a signature covers: the manifest's wire map, packed by msgpack with
    fields in declaration order (the same on every side that runs this module)."""
    return b"echo2p2p-manifest-v1\0" + msgpack.packb(m.to_wire(manifest), use_bin_type=True)


def sign_manifest(private_key: bytes, manifest: m.Manifest) -> bytes:
    """The 64-byte Ed25519 signature of `manifest`."""
    return Ed25519PrivateKey.from_private_bytes(private_key).sign(manifest_bytes(manifest))


def verify_manifest(hub_key: bytes, manifest: m.Manifest, signature: bytes) -> None:
    """Return if `signature` is the hub's over `manifest`; SnapshotError otherwise."""
    if len(hub_key) != KEY_BYTES:
        raise SnapshotError("hub key must be 32 bytes")
    try:
        Ed25519PublicKey.from_public_bytes(hub_key).verify(signature, manifest_bytes(manifest))
    except InvalidSignature:
        raise SnapshotError(f"manifest of v{manifest.version} is not signed by the hub") from None
