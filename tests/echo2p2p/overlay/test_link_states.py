"""What a gossip link end may receive, in hand-written legal and illegal sequences (the link's
state table, `echo2p2p.overlay.link.LINK_TRANSITIONS`, is not read here): chunk frames in any
order before and after the one `peers`, a second `peers` or any `proof` closes the link."""

from __future__ import annotations

import pytest

from echo2p2p import messages as m
from echo2p2p.overlay.link import Cancel, Had, Have, Link, LinkError, Peers, Proof
from echo2p2p.overlay.links import Links
from echo2p2p.overlay.serving import UploadMeter

HAVE, HAD, CANCEL = Have(5, 4, b"\x01"), Had(5, 4, m.pack_ids([0])), Cancel(5, 4, 0)


def a_link() -> Link:
    """A link end as an accepted link starts: its proof sent, nothing received yet."""
    return Link(Links(lambda: ("p1", None), UploadMeter()), "p2", ws=None, dialled=False)


@pytest.mark.parametrize("frames", [
    [Peers([]), HAVE, HAD, CANCEL],
    [HAVE, HAD, Peers([]), HAVE, CANCEL],
    [HAVE, HAD, CANCEL],  # a peers frame is owed by an honest end, not required of it
])
async def test_legal_sequences_keep_the_link(frames):
    link = a_link()
    for rec in frames:
        await link.receive(rec)


@pytest.mark.parametrize("frames", [
    [Peers([]), Peers([])],
    [Peers([]), HAVE, Peers([])],
    [Proof(b"p2.x")],
    [HAVE, Peers([]), Proof(b"p2.x")],
])
async def test_illegal_sequences_close_the_link(frames):
    link = a_link()
    for rec in frames[:-1]:
        await link.receive(rec)
    with pytest.raises(LinkError):
        await link.receive(frames[-1])
