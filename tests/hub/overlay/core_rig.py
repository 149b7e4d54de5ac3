"""A fake core for the overlay parts' tests: `Peer`s over one `Outbox`, a clock by hand.

The parts (`hub.core.tracker`, `hub.core.accusations`) are driven synchronously, as the hub's
core drives them; what they decide is the list of actions drained from the outbox. A `Send` is
encoded with the peer's own protocol, as the shell does, and decoded back.
"""

from __future__ import annotations

from typing import Any

from echo2p2p import messages as m
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.core.actions import Outbox, Record, Send
from echo2p2p.hub.core.overlay_actions import BuildDelta
from echo2p2p.hub.core.peer import Peer
from echo2p2p.hub.core.tracker import VersionTracker
from echo2p2p.hub.overlay.catchup import build_catch_up
from echo2p2p.hub_protocol import HubProtocol
from echo2p2p.pool import Pool


class Rig:
    """A tracker over peers that said hello and were welcomed, on a clock moved by hand."""

    def __init__(self, **cfg: Any):
        self.cfg = HubConfig.from_flat(**{"relay": "pipelined", **cfg})  # the tracker unless told
        self.outbox = Outbox()
        self.peers: dict[str, Peer] = {}
        self.pool = Pool("all", 0.0)
        self.quarantined: set[str] = set()
        self.clock = 100.0
        self.tracker = VersionTracker(self.cfg.overlay, self.peers, self.pool, self.outbox,
                                      quarantined=lambda p: p.peer_id in self.quarantined)

    def join(self, peer_id: str, relay: bool = True, peer_key: bytes = b"",
             listen_addr: str | None = "", active: bool = True) -> Peer:
        proto = HubProtocol(self.clock, 1 << 20)
        if listen_addr == "":
            listen_addr = f"http://127.0.0.1:{9000 + len(self.peers)}"
        hello = m.Hello(peer_id, "transformers", "cpu", listen_addr=listen_addr,
                        peer_key=peer_key)
        proto.receive_frame(m.encode(hello), self.clock)
        proto.send(m.Welcome(peer_id, "run", "tiny", "addition", 0, 2, 2, 1.0, 1.0, 4, 7))
        peer = Peer(peer_id, hello, proto, self.outbox, relay="ok" if relay else "failed")
        self.peers[peer_id] = peer
        self.pool.join(peer_id, peer_id, 0.0, generates=active, now=self.clock)
        if active:  # a generating peer, put to work at once
            self.pool.replan(None, self.clock)
        return peer

    def built(self, actions: list[Any]) -> list[Any]:
        """Run every `BuildDelta` among `actions` as the shell does (a real encode, here in
        this thread) and report it back; the actions decided then."""
        for action in actions:
            if isinstance(action, BuildDelta):
                snap = build_catch_up(action.target, action.base)
                self.tracker.delta_built(action.key, snap, self.clock)
        return self.drain()

    def leave(self, peer_id: str) -> list[Any]:
        del self.peers[peer_id]
        self.tracker.peer_left(peer_id, self.clock)
        return self.drain()

    def drain(self) -> list[Any]:
        """The actions decided since the last drain; each `Send` is framed by its peer's
        protocol (as the shell frames it) and carries the message decoded back."""
        out = []
        for action in self.outbox.drain():
            if isinstance(action, Send) and (peer := self.peers.get(action.peer_id)):
                frame = peer.protocol.send(action.message)
                assert frame is not None
                action = Send(action.peer_id, m.decode(frame), action.not_before)
            out.append(action)
        return out


def to(actions: list[Any], peer_id: str) -> list[m.Message]:
    """The messages `actions` send to `peer_id`, in order."""
    return [a.message for a in actions if isinstance(a, Send) and a.peer_id == peer_id]


def records(actions: list[Any]) -> list[dict]:
    return [a.record for a in actions if isinstance(a, Record)]


def plans(messages: list[m.Message], version: int | None = None) -> list[m.RelayPlan]:
    """The relay plans among `messages` (an announcement's, then re-deals), of `version`."""
    out = [f.plan if isinstance(f, m.VersionAnnouncement) else f for f in messages
           if isinstance(f, (m.VersionAnnouncement, m.RelayPlan))]
    return [p for p in out if version is None or p.version == version]


def seeds(messages: list[m.Message], version: int | None = None) -> list[list[int]]:
    """The seed lists among `messages`' gossip plans."""
    return [m.unpack_ids(p.gossip.seed) for p in plans(messages, version) if p.gossip is not None]
