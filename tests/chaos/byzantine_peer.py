"""A byzantine peer: a real `echo2-peer join` process whose client lies in the ways chosen.

    python tests/chaos/byzantine_peer.py [ATTACKS] join URL [echo2-peer join flags]

ATTACKS (any of):
  --corrupt-chunks  flip the first byte of every chunk it serves, from its chunk server and
                    over its gossip links alike (it relays them as the hub's plan says, or
                    seeds them on gossip; the digest in the signed manifest catches each one)
  --forge-rewards   claim reward 1.0 for every sample (the hub re-scores with the task)
  --forge-logprobs  report 0.0 (probability 1) as every token's behaviour logprob (the hub's
                    logprob spot-checks recompute them under the claimed version)
  --forge-version   tag each rollout with one version newer than the one that generated it

Everything else is the honest `echo2p2p.peer.client.PeerClient`: the lies sit in the parts it
is given (a chunk store, a wrapper of its rollouts, a reward function), so the hub meets the same
protocol an honest peer speaks.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a file

from echo2p2p.peer import cli as peer_cli  # noqa: E402
from echo2p2p.peer.client import PeerClient  # noqa: E402
from echo2p2p.peer.config import PeerConfig  # noqa: E402
from echo2p2p.peer.worker import Rollouts  # noqa: E402
from echo2p2p.overlay.store import ChunkStore, Held  # noqa: E402
from echo2p2p.tasks import REWARDS  # noqa: E402

ATTACKS = ("corrupt-chunks", "forge-rewards", "forge-logprobs", "forge-version")


class CorruptingStore(ChunkStore):
    """Holds and verifies versions honestly; serves every chunk with its first byte flipped.
    The copy it keeps to serve (`Held.wires`, which its chunk server and its gossip links both
    send) is the flipped one; what it assembles and loads is what it verified."""

    async def add(self, held: Held, index: int, data: bytes) -> bool:
        kept = held.wires[index] is not None  # a second copy: the first one was kept
        complete = await super().add(held, index, data)
        if not kept and (wire := held.wires[index]):
            held.wires[index] = bytes([wire[0] ^ 0xFF]) + bytes(wire[1:])
        return complete


class ForgedRollouts:
    """The real engine's groups, with every behaviour logprob reported as 0.0 (forge-logprobs)
    and/or tagged one version newer than the one that made them (forge-version)."""

    def __init__(self, honest: Rollouts, attacks: set[str]):
        self.honest, self.attacks = honest, attacks

    def generate(self, lease: Any, seed: int, welcome: Any) -> tuple[int | None, list]:
        version, out = self.honest.generate(lease, seed, welcome)
        if "forge-logprobs" in self.attacks:
            out = [replace(c, logprobs=[0.0] * len(c.logprobs)) for c in out]
        if "forge-version" in self.attacks and version is not None:
            version += 1
        return version, out

    def play(self, lease: Any, seed: int, welcome: Any, env: Any) -> tuple[int | None, list]:
        return self.honest.play(lease, seed, welcome, env)  # the lies are single-turn ones


def full_marks(answer: str, text: str) -> float:
    """The forged reward: a module-level function, so the peer's scoring worker can load it."""
    return 1.0


def byzantine_peer(cfg: PeerConfig, attacks: set[str]) -> PeerClient:
    """An honest `PeerClient` given the lying parts `attacks` choose."""
    return PeerClient(
        cfg, rollouts=lambda honest: ForgedRollouts(honest, attacks),
        chunk_store=CorruptingStore if "corrupt-chunks" in attacks else ChunkStore,
        reward_for=(lambda task: full_marks) if "forge-rewards" in attacks else REWARDS.get)


def main(argv: list[str] | None = None) -> int:
    lies = argparse.ArgumentParser(add_help=False)
    for attack in ATTACKS:
        lies.add_argument(f"--{attack}", action="store_true")
    chosen, rest = lies.parse_known_args(argv)
    attacks = {a for a in ATTACKS if getattr(chosen, a.replace("-", "_"))}
    return peer_cli.main(rest, lambda cfg: byzantine_peer(cfg, attacks))


if __name__ == "__main__":
    sys.exit(main())
