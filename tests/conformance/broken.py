"""Broken peers for the conformance kit's tests: the reference peer with one behaviour
changed, each putting back one erratum class of issue 43 (or breaking one rule the kit checks).

`python -m tests.conformance.broken KIND join URL [peer options]` monkeypatches the one
function KIND names, then runs `echo2-peer`'s main with the rest of the command line: the kit
launches it as the peer under test and must fail it on the rule in `BROKEN[KIND]`.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Callable

import aiohttp

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.hub.conformance import verdicts as v
from echo2p2p.overlay import link, links, store
from echo2p2p.peer import chunk_server, cli
from echo2p2p.peer.client import PeerClient


def silent_server() -> None:
    """Advertises a listen_addr where nothing answers (wire §3 said such a peer is never an
    owner; gossip gave it a share all the same)."""
    hole = socket.socket()  # bound, never listening: connections are refused, the port kept
    hole.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{hole.getsockname()[1]}"

    @contextlib.asynccontextmanager
    async def serve(*args, **kwargs):
        yield url

    chunk_server._serve = serve


def open_chunks() -> None:
    """Serves chunks to anyone: the chunk route without its ticket check."""
    honest = chunk_server.chunk_handler
    chunk_server.chunk_handler = lambda lookup, meter, limiter, authorize=None: honest(
        lookup, meter, limiter)


def no_link_proof() -> None:
    """A gossip acceptor that does not show its ticket first (the old peer's links)."""
    honest = links.encode_frame
    links.encode_frame = lambda tag, rec, *version: honest(
        *(("peers", link.Peers([])) if tag == "proof" else (tag, rec)), *version)


def bare_peers() -> None:
    """`peers` entries without their key and ticket (the old peer's format)."""
    links.Neighbour = lambda peer_id, url, key, ticket: link.Neighbour(peer_id, url, b"", b"")


def wrong_logprobs() -> None:
    """Reports behaviour logprobs 0.5 nats below those it sampled with (as a peer that applied
    its own chat template, or sampled with top-k, would report logprobs of another policy)."""
    honest = m.pack_logprobs
    m.pack_logprobs = lambda values: honest([x - 0.5 for x in values])


def no_reconnect() -> None:
    """Stops for good when a connection it was welcomed on drops."""
    honest = PeerClient._connection_until

    async def once(self, http, stop):
        welcomed = await honest(self, http, stop)
        if welcomed:
            stop.set()
        return welcomed

    PeerClient._connection_until = once


def trusts_any_proof() -> None:
    """Takes a welcome whose proof does not verify (an impostor's)."""
    signing.verify_welcome = lambda *args: True


def unseen_is_gone() -> None:
    """Answers 404 at once for a manifest it has not seen, where the route waits and says 503
    (the implicit rule the issue's errata name)."""
    honest = store.ChunkStore.chunk

    async def chunk(self, version, base, index, wait_s):
        if (version, base) not in self._held:
            return store.GONE
        return await honest(self, version, base, index, wait_s)

    store.ChunkStore.chunk = chunk


def talks_first() -> None:
    """A dialler that sends its `have` before the acceptor's proof (what §7a left unsaid)."""
    honest = links.Links._proof

    async def early(self, ws, peer_id, protocol):
        await ws.send_bytes(links.encode_frame(link.Have.TYPE, link.Have(0, None, b"\x00"),
                                               protocol))
        return await honest(self, ws, peer_id, protocol)

    links.Links._proof = early


def trusts_any_link_proof() -> None:
    """A dialler that takes whatever `proof` the acceptor shows (the old peer had none)."""

    async def any_proof(self, ws, peer_id, protocol):
        msg = await ws.receive()
        return (peer_id, b"", b"") if msg.type is aiohttp.WSMsgType.BINARY else None

    links.Links._proof = any_proof


def unlisted_reason() -> None:
    """Reports a corrupt piece with a reason outside the spec's four (as wire.md §12 listed
    three where the code had four, a peer may send one the hub does not know)."""
    honest = m.RelayReport
    m.RelayReport = lambda version, peer_id, reason, *rest: honest(
        version, peer_id, "bad_piece" if reason == "corrupt" else reason, *rest)


def hello_framed_3() -> None:
    """Frames its hello with its own newest version, not the base 2 every hub reads (a hub of
    protocol 2 would close it 4000 before it could say what it speaks)."""
    m.BASE_PROTOCOL = m.PROTOCOL_VERSION


# kind -> (the change, the kit's phase that sees it, the rule it must fail)
BROKEN: dict[str, tuple[Callable[[], None], str, str]] = {
    "silent_server": (silent_server, "serving", v.PROBED),
    "open_chunks": (open_chunks, "serving", v.TICKET),
    "no_link_proof": (no_link_proof, "gossip", v.LINK_PROOF),
    "bare_peers": (bare_peers, "gossip", v.LINK_PEERS),
    "wrong_logprobs": (wrong_logprobs, "rollouts", v.LOGPROBS),
    "no_reconnect": (no_reconnect, "reconnect", v.RECONNECT),
    "trusts_any_proof": (trusts_any_proof, "impostor", v.PROOF),
    "hello_framed_3": (hello_framed_3, "impostor", v.VERSIONS),
    "unseen_is_gone": (unseen_is_gone, "serving", v.NOT_YET),
    "talks_first": (talks_first, "dialler", v.DIAL_SILENT),
    "trusts_any_link_proof": (trusts_any_link_proof, "dialler", v.DIAL_PROOF),
    "unlisted_reason": (unlisted_reason, "dialler", v.REPORT),
}

if __name__ == "__main__":
    BROKEN[sys.argv[1]][0]()
    sys.exit(cli.main(sys.argv[2:]))
