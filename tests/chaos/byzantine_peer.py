"""A byzantine peer: a real `echo2-peer join` process whose client lies in the ways chosen.

    python tests/chaos/byzantine_peer.py [ATTACKS] join URL [echo2-peer join flags]

ATTACKS (any of):
  --corrupt-chunks  flip the first byte of every chunk its chunk server sends (it relays them
                    as the hub's plan says; the digest in the signed manifest catches each one)
  --forge-rewards   claim reward 1.0 for every sample (the hub re-scores with the task)
  --forge-logprobs  report 0.0 (probability 1) as every token's behaviour logprob (the hub's
                    logprob spot-checks recompute them under the claimed version)
  --forge-version   tag each rollout with one version newer than the one that generated it

Everything else is the honest `echo2p2p.peer.client.PeerClient`: the lies sit in a subclass, a chunk
store and an engine wrapper, so the hub meets the same protocol an honest peer speaks.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when run as a file

from echo2p2p import messages as m  # noqa: E402
from echo2p2p.peer import cli as peer_cli  # noqa: E402
from echo2p2p.peer.client import PeerClient  # noqa: E402
from echo2p2p.peer.config import PeerConfig  # noqa: E402
from echo2p2p.overlay.store import ChunkStore  # noqa: E402

ATTACKS = ("corrupt-chunks", "forge-rewards", "forge-logprobs", "forge-version")


class CorruptingStore(ChunkStore):
    """Holds and verifies versions honestly; serves every chunk with its first byte flipped."""

    async def chunk(self, version: int, base: int | None, index: int, wait_s: float) -> bytes | None:
        data = await super().chunk(version, base, index, wait_s)
        return bytes([data[0] ^ 0xFF]) + data[1:] if data else data  # None and GONE pass


class ForgingEngine:
    """The real engine, with every behaviour logprob reported as 0.0."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def load_weights(self, named_tensors: Any) -> None:
        self.engine.load_weights(named_tensors)

    def generate(self, prompt_ids: list[int], n: int, **kwargs: Any) -> list:
        return [replace(c, logprobs=[0.0] * len(c.logprobs))
                for c in self.engine.generate(prompt_ids, n, **kwargs)]


def full_marks(answer: str, text: str) -> float:
    """The forged reward: a module-level function, so the peer's scoring worker can load it."""
    return 1.0


class ByzantinePeer(PeerClient):
    def __init__(self, cfg: PeerConfig, attacks: set[str]):
        super().__init__(cfg)
        self.attacks = attacks
        if "corrupt-chunks" in attacks:
            self.store = CorruptingStore(cfg.keep_versions)

    async def _adopt(self, welcome: m.Welcome) -> None:
        await super()._adopt(welcome)
        if "corrupt-chunks" in self.attacks and not isinstance(self.store, CorruptingStore):
            self.store = CorruptingStore(self.cfg.keep_versions)  # the honest code made a new one
        if "forge-logprobs" in self.attacks and self.engine is not None \
                and not isinstance(self.engine, ForgingEngine):
            self.engine = ForgingEngine(self.engine)
        if "forge-rewards" in self.attacks:
            self.reward = full_marks

    def _generate(self, lease: m.LeaseGrant, seed: int) -> tuple[int | None, list]:
        version, out = super()._generate(lease, seed)
        if "forge-version" in self.attacks and version is not None:
            version += 1
        return version, out


def main(argv: list[str] | None = None) -> int:
    lies = argparse.ArgumentParser(add_help=False)
    for attack in ATTACKS:
        lies.add_argument(f"--{attack}", action="store_true")
    chosen, rest = lies.parse_known_args(argv)
    attacks = {a for a in ATTACKS if getattr(chosen, a.replace("-", "_"))}
    return peer_cli.main(rest, lambda cfg: ByzantinePeer(cfg, attacks))


if __name__ == "__main__":
    sys.exit(main())
