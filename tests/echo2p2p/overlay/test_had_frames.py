"""`Links.had` tells each link only the chunks its `have` / `had` does not already claim (it
wants none of those): a link that holds them all gets no frame; one whose `have` was of another
manifest under the key, or that said nothing, gets them all."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from echo2p2p import messages as m
from echo2p2p.frames import decode_frame
from echo2p2p.gossip import pack_bits
from echo2p2p.overlay.link import FRAMES, LINK_LIMITS, Had, Have, Link
from echo2p2p.overlay.links import Links
from echo2p2p.overlay.serving import UploadMeter

KEY, N = (3, None), 20


class Wire:
    """A websocket end that keeps what is sent on it."""

    def __init__(self):
        self.sent: list = []

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(decode_frame(data, LINK_LIMITS, FRAMES)[0])


async def test_had_skips_the_chunks_each_link_holds():
    links = Links(lambda: ("p0", None), UploadMeter())
    manifest = SimpleNamespace(version=3, base_version=None, digest=b"ours")
    held = SimpleNamespace(manifest=manifest, wires=[None] * N, key=KEY)
    links.advertised[KEY] = held
    said = {"half": (b"ours", [0, 1]), "all": (b"ours", [0, 1, 2]),
            "other": (b"theirs", [0, 1, 2]), "silent": None}
    for peer_id, have in said.items():
        link = links.links[peer_id] = Link(links, peer_id, Wire(), dialled=True)
        if have is not None:
            link._heard(KEY, Have(*KEY, pack_bits(have[1], N), have[0]))
    links.had(KEY, [0, 1, 2])
    await asyncio.gather(*links._tasks)
    got = {p: [m.unpack_ids(f.indices) for f in link.ws.sent if isinstance(f, Had)]
           for p, link in links.links.items()}
    assert got == {"half": [[2]], "all": [], "other": [[0, 1, 2]], "silent": [[0, 1, 2]]}
