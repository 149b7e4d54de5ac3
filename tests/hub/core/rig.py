"""A `HubCore` driven by hand, as h11's tests drive a `Connection`: events with a fake clock in,
actions read back. Peers are real `HubProtocol`s fed real frames; the scorer's ledger is a real
`Scorer` whose workers never start (nothing is submitted to it: scoring is the shell's, and a
test answers each `Score` with the `ScoringFinished` it chooses)."""

from __future__ import annotations

import itertools
from typing import Any

from echo2p2p import hub_protocol as hp
from echo2p2p import messages as m
from echo2p2p.completions import CompletionDecoder
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.core import actions as a
from echo2p2p.hub.core import events as ev
from echo2p2p.hub.core.core import HubCore, RunFacts
from echo2p2p.hub.tasks.task_setup import TokenizedProblem
from echo2p2p.policy.model import build_char_tokenizer
from echo2p2p.scoring.scorer import Scorer
from echo2p2p.tasks import AdditionTask, addition_reward

from tests.blob_versions import blob_version

TOK = build_char_tokenizer()
KEY = bytes(range(32))


def samples(n: int, text: str = "7", reward: float = 0.0) -> list[m.Sample]:
    """`n` samples whose ids spell `text` then EOS."""
    ids = TOK.encode(text, add_special_tokens=False) + [TOK.eos_token_id]
    return [m.Sample(m.pack_ids(ids), m.pack_logprobs([-1.0] * len(ids)), text, reward, "stop")
            for _ in range(n)]


class Rig:
    """One core, its clock, and every action it returned (`log`)."""

    def __init__(self, facts: RunFacts | None = None, spot_checks: bool = False, **cfg: Any):
        self.cfg = HubConfig.from_flat(**{"prompts_per_step": 2, "group_size": 2,
                                          "max_lag": 2, **cfg})
        problems = [TokenizedProblem(p, [1]) for p in AdditionTask().problems("train")[:8]]
        self.scorer = Scorer(addition_reward, decoder=CompletionDecoder(TOK), timeout_s=5.0,
                             workers=1, name="core-test")
        ids = itertools.count()
        self.core = HubCore(self.cfg, "run", problems, facts=facts or RunFacts("addition"),
                            new_lease_id=lambda: f"L{next(ids)}", scoring=self.scorer,
                            spot_checks=spot_checks)
        self.now = 100.0
        self.log: list[Any] = []
        self.tracker = self.core.tracker  # the real tracker: versions can be published

    def close(self) -> None:
        self.scorer.close()

    def feed(self, event: ev.Event) -> list[Any]:
        """`event` to the core; its sends are framed by their peers' protocols, as the shell
        frames them (the protocol's session follows what it sent: the welcome first)."""
        actions = self.core.handle(event, self.now)
        for x in actions:
            if isinstance(x, a.Send) and (peer := self.core.peers.get(x.peer_id)) is not None:
                peer.protocol.send(x.message)
        self.log += actions
        return actions

    def join(self, name: str = "p", remote: str | None = "10.0.0.1", token: str = "",
             token_refusal: str | None = None) -> list[Any]:
        protocol = hp.HubProtocol(self.now, 1 << 20)
        hello = m.Hello(name, "transformers", "cpu", token=token)
        protocol.receive_frame(m.encode(hello), self.now)
        return self.feed(ev.HelloReceived(f"c-{name}", hello, protocol, remote, token_refusal))

    def joined(self, name: str = "p", remote: str | None = "10.0.0.1") -> str:
        """The peer id of a peer that said hello and was joined."""
        (joined,) = [x for x in self.join(name, remote) if isinstance(x, a.Joined)]
        return joined.peer_id

    def frame(self, peer_id: str, msg: m.Message) -> list[Any]:
        """`msg` as peer `peer_id` frames it, through its protocol, to the core."""
        event = self.core.peers[peer_id].protocol.receive_frame(m.encode(msg), self.now)
        return self.feed(ev.FrameReceived(peer_id, event))

    def leases(self, peer_id: str, n: int) -> list[m.LeaseGrant]:
        """Ask for `n` leases and end the loop's turn: the grants it got."""
        self.frame(peer_id, m.LeaseRequest(n))
        return sent(self.feed(ev.TurnEnded()), peer_id, m.LeaseGrant)

    def submit(self, peer_id: str, lease_id: str, version: int = 0, n: int = 2,
               reward: float = 0.0) -> list[Any]:
        return self.frame(peer_id, m.RolloutSubmission(lease_id, version, samples(n, reward=reward)))

    def publish(self, version: int) -> list[Any]:
        return self.feed(ev.VersionPublished(blob_version(KEY, version, bytes([version]) * 64)))


def sent(actions: list[Any], peer_id: str, kind: type | None = None) -> list[Any]:
    """The messages `actions` send to `peer_id` (of `kind`, if given), in order."""
    return [x.message for x in actions if isinstance(x, a.Send) and x.peer_id == peer_id
            and (kind is None or isinstance(x.message, kind))]


def of(actions: list[Any], kind: type) -> list[Any]:
    return [x for x in actions if isinstance(x, kind)]
