"""Who a gossip link may reach: `Tickets.holder` reads who a ticket header proves (the proof a
dialled end shows), `Tickets.vouches` checks a `peers` entry's ticket, and `Links.heard_of_link`
remembers (and so dials) only ids with the hub's ticket, never re-pointing an address it has."""

from __future__ import annotations

import os

from echo2p2p import messages as m
from echo2p2p import signing
from echo2p2p.overlay.link import Neighbour
from echo2p2p.overlay.links import Links
from echo2p2p.overlay.serving import UploadMeter
from echo2p2p.overlay.tickets import TICKET_HEADER, Credentials, Tickets

HUB = signing.new_private_key()


def admitted(peer_id: str, run_id: str = "run") -> Credentials:
    private = signing.new_private_key()
    ticket = signing.sign_ticket(HUB, run_id, peer_id, signing.public_key(private))
    return Credentials(run_id, peer_id, private, ticket)


def entry(creds: Credentials, url: str = "http://127.0.0.1:9") -> Neighbour:
    return Neighbour(creds.peer_id, url, creds.peer_key, creds.ticket)


def test_holder_names_the_peer_whose_header_is_addressed_to_us():
    """A header of p2's, naming us (p1), proves p2 and its key; one naming another server, of
    another run, or cut short proves nothing."""
    ours = Tickets(signing.public_key(HUB), "run", "p1")
    p2 = admitted("p2")
    assert ours.holder(p2.header("p1")[TICKET_HEADER]) == ("p2", p2.peer_key, p2.ticket)
    assert ours.holder(p2.header("p3")[TICKET_HEADER]) is None  # replayed from another server
    assert ours.holder(admitted("p2", "other-run").header("p1")[TICKET_HEADER]) is None
    assert ours.holder(p2.header("p1")[TICKET_HEADER][:-2]) is None
    assert ours.holder("") is None
    assert Tickets().holder(p2.header("p1")[TICKET_HEADER]) is None  # not welcomed yet
    assert Tickets(b"").holder("") == ("", b"", b"")  # a rig without tickets


def test_vouches_only_for_the_id_and_key_the_hub_signed():
    ours = Tickets(signing.public_key(HUB), "run", "p1")
    p2 = admitted("p2")
    assert ours.vouches("p2", p2.peer_key, p2.ticket)
    assert not ours.vouches("p9", p2.peer_key, p2.ticket)  # another id under p2's ticket
    assert not ours.vouches("p2", os.urandom(32), p2.ticket)
    assert not ours.vouches("p2", p2.peer_key, os.urandom(64))


async def test_a_peers_frame_is_remembered_only_for_ids_with_a_ticket():
    """Of a peers frame, made-up ids (forged or no tickets) are dropped; an admitted id is kept;
    an entry never replaces an address heard before (from the hub or a link)."""
    links = Links(lambda: ("p1", None), UploadMeter(),
                  tickets=Tickets(signing.public_key(HUB), "run", "p1"))
    p2, p3 = admitted("p2"), admitted("p3")
    links.heard_of([m.RelaySource("p3", "http://127.0.0.1:3000")])  # the hub's sample
    made_up = [Neighbour(f"p{900 + i}", "http://127.0.0.1:6666", os.urandom(32), os.urandom(64))
               for i in range(14)]
    links.heard_of_link([*made_up, entry(p2, "http://127.0.0.1:2000"),
                         entry(p3, "http://127.0.0.1:6666")])
    assert links.known == {"p3": "http://127.0.0.1:3000", "p2": "http://127.0.0.1:2000"}


async def test_without_tickets_in_the_run_any_entry_is_dialled():
    """A rig whose hub signs nothing (no hub key) keeps what it did before."""
    links = Links(lambda: ("p1", None), UploadMeter())
    links.heard_of_link([Neighbour("p2", "http://127.0.0.1:2000", b"", b"")])
    assert links.known == {"p2": "http://127.0.0.1:2000"}
