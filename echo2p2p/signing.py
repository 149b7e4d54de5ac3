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


def _ticket_bytes(run_id: str, peer_id: str) -> bytes:
    return b"echo2p2p-ticket-v1\0" + run_id.encode() + b"\0" + peer_id.encode()


def sign_ticket(private_key: bytes, run_id: str, peer_id: str) -> bytes:
    """The hub's word that `peer_id` belongs to run `run_id`: what other peers' chunk servers
    (and the hub's) ask of whoever requests a chunk."""
    return Ed25519PrivateKey.from_private_bytes(private_key).sign(_ticket_bytes(run_id, peer_id))


def verify_ticket(hub_key: bytes, run_id: str, peer_id: str, ticket: bytes) -> bool:
    """Whether `ticket` is the hub's signature admitting `peer_id` to run `run_id`."""
    try:
        Ed25519PublicKey.from_public_bytes(hub_key).verify(ticket, _ticket_bytes(run_id, peer_id))
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
