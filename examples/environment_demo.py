"""What the environment examples share: train the built-in take-away player on an environment
module of this folder, with the hub and two local peers, and print the rewards before and after.
The peers import the environment by its name, as they would an installed package's: this
folder goes on their PYTHONPATH."""

import os
import sys
from pathlib import Path

from echo2p2p.hub import Run


def train(env: str, steps: int) -> None:
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    records = Run(env=env, model="tiny-takeaway", max_steps=steps, eval_every=10).demo(peers=2)
    trained = [r["train/reward_mean"] for r in records if "step" in r]
    held_out = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    print(f"train reward {trained[0]:.3f} -> {trained[-1]:.3f}; "
          f"held-out reward {held_out[0]:.3f} -> {held_out[-1]:.3f}")
