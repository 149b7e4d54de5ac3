"""Who may fetch chunks: the hub's tickets, each request signed for the server it asks.

`Tickets` is a chunk server's check of the `TICKET_HEADER`; `Credentials` is what a fetcher
shows (its ticket and a signature per server, `signing.chunk_auth`). `server_base` reduces an
advertised URL to scheme://host:port, the only part a request is ever built from.
Pure of I/O except for reading a request's headers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from echo2p2p import signing
from echo2p2p.failover import HUB

if TYPE_CHECKING:
    from aiohttp import web

TICKET_HEADER = "X-Echo2-Ticket"  # "<peer id>.<hex peer key>.<hex ticket>.<hex auth>"


class Tickets:
    """Who may fetch chunks from this server, `audience` (our peer id, or "hub"): holders of a
    ticket the hub signed for this run whose request also carries their own signature naming
    this server (`signing.chunk_auth`), so a header seen by one server opens no other. Until
    `admit` names the hub's key, the run and who we are (a peer learns them in its welcome)
    nobody may; a hub without a signing key (a bench rig) issues no tickets, and then anyone may.
    """

    def __init__(self, hub_key: bytes | None = None, run_id: str = "", audience: str = "") -> None:
        self.hub_key, self.run_id, self.audience = hub_key, run_id, audience
        self._valid: set[str] = set()  # header values already verified

    def admit(self, hub_key: bytes, run_id: str, audience: str) -> None:
        if (hub_key, run_id, audience) != (self.hub_key, self.run_id, self.audience):
            self.hub_key, self.run_id, self.audience, self._valid = hub_key, run_id, audience, set()

    def __call__(self, request: web.BaseRequest) -> bool:
        return self.hub_key == b"" or self._checked(request.headers.get(TICKET_HEADER, ""))

    def _checked(self, value: str) -> bool:
        """Whether header `value` verifies (remembered: a peer sends the same one each time)."""
        if value in self._valid:
            return True
        ok = self.hub_key is not None and len(value) <= 512 and self._verify(value)
        if ok and len(self._valid) < 100_000:
            self._valid.add(value)
        return ok

    def hub_only(self, request: web.BaseRequest) -> bool:
        """`self(request)`, and the ticket is the hub's own (peer id "hub"): for routes only the
        hub has a use for, such as the uplink probe, which another peer could use to fill
        this server's uplink."""
        value = request.headers.get(TICKET_HEADER, "")
        return self(request) and (self.hub_key == b"" or value.split(".", 1)[0] == HUB)

    def holder(self, value: str) -> tuple[str, bytes, bytes] | None:
        """The (peer id, peer key, ticket) a ticket header `value` proves, addressed to us: who
        dialled a gossip link, and who accepted it (that end shows its header, naming the
        dialler, as its first frame). None if it proves nothing; ("", b"", b"") from anyone
        while no tickets are issued."""
        if self.hub_key == b"":
            return "", b"", b""
        if not self._checked(value):
            return None
        peer_id, key_hex, ticket_hex, _ = value.split(".")
        return peer_id, bytes.fromhex(key_hex), bytes.fromhex(ticket_hex)

    def vouches(self, peer_id: str, peer_key: bytes, ticket: bytes) -> bool:
        """Whether `ticket` is the hub's, admitting `peer_id` (holding `peer_key`) to this run:
        what a `peers` frame entry must carry to be dialled (always, while no tickets are
        issued)."""
        if self.hub_key == b"":
            return True
        return self.hub_key is not None and signing.verify_ticket(
            self.hub_key, self.run_id, peer_id, peer_key, ticket=ticket)

    def _verify(self, value: str) -> bool:
        parts = value.split(".")
        if len(parts) != 4:
            return False
        peer_id = parts[0]
        try:
            peer_key, ticket, auth = (bytes.fromhex(p) for p in parts[1:])
        except ValueError:
            return False
        return (signing.verify_ticket(self.hub_key, self.run_id, peer_id, peer_key, ticket=ticket)
                and signing.verify_chunk_auth(peer_key, self.run_id, self.audience, auth))


class Credentials:
    """What this side shows chunk servers: its peer id, its key pair, the hub's ticket for
    them, and a signature per server asked (made once, kept)."""

    def __init__(self, run_id: str, peer_id: str, private_key: bytes, ticket: bytes) -> None:
        self.run_id, self.peer_id, self.ticket = run_id, peer_id, ticket
        self._key = private_key
        self._prefix = f"{peer_id}.{signing.public_key(private_key).hex()}.{ticket.hex()}."
        self._headers: dict[str, dict[str, str]] = {}

    @classmethod
    def issued(cls, signing_key: bytes, run_id: str, peer_id: str) -> Credentials:
        """A new identity `peer_id`, its own key pair and a ticket the hub (holder of
        `signing_key`) signs for it: how the hub asks a peer's server as a receiver would, since
        a server that could tell the hub's checks apart would pass them and fail the others."""
        private = signing.new_private_key()
        return cls(run_id, peer_id, private,
                   signing.sign_ticket(signing_key, run_id, peer_id, signing.public_key(private)))

    @property
    def peer_key(self) -> bytes:
        """Our public key, which the ticket binds."""
        return signing.public_key(self._key)

    def header(self, audience: str) -> dict[str, str]:
        """The ticket header for a request to the server of `audience` (a peer id or "hub")."""
        if not self.ticket:
            return {}
        if audience not in self._headers:
            if len(self._headers) > 10_000:  # peer ids come and go over a long run
                self._headers.clear()
            auth = signing.chunk_auth(self._key, self.run_id, audience)
            self._headers[audience] = {TICKET_HEADER: self._prefix + auth.hex()}
        return self._headers[audience]


def server_base(url: str) -> str | None:
    """scheme://host:port of an advertised chunk server URL, or None if it has no such form.
    Requests are built from these parts only: a path, query, fragment or user name someone
    else put in the URL never reaches a request (nor does our ticket go to a URL they chose)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host or port is None or len(url) > 256:
        return None
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}:{port}"

