"""Learner steps the sharded-learner tests replay on one process and on W ranks (torchrun).

    python -m torch.distributed.run --nproc-per-node 2 tests/hub/learning/sharded_steps.py OUT.pt \
        [--load DIR] [--save DIR] [--checkpointing on]

writes rank 0's view after the steps: the weights (fp32, HF names), every step's statistics and
the greedy completions of a few prompts. `--save DIR`: stop after the first STEPS // 2 steps,
checkpointed to DIR; `--load DIR`: start from that checkpoint, with the last STEPS // 2;
`--checkpointing on`: activations recomputed in the backward. The batches are off-policy (behaviour logprobs of the initial
model plus noise, so the importance ratio and its clip work), with a KL term and gradient-norm
clipping on, and long enough that micro-batches split and ranks get uneven shares.
"""

from __future__ import annotations

import random
import sys
from dataclasses import asdict

import torch

from echo2p2p.policy.prompts import PLAIN

STEPS = 4
LR = 1e-3
GROUPS_PER_STEP = 4


def batches(model) -> list[list]:
    """STEPS batches of GROUPS_PER_STEP groups of 4, behaviour logprobs from `model` + noise."""
    from tests.hub.learning.test_learner import make_group, sequence_logprobs

    draw = random.Random(7)
    out = []
    for step in range(STEPS):
        groups = []
        for g in range(GROUPS_PER_STEP):
            completions = [[draw.randrange(6, 48) for _ in range(draw.randrange(2, 12))]
                           for _ in range(4)]
            rewards = [float(draw.random() < 0.5) for _ in completions]
            rewards[0] = 1.0 - rewards[1] if rewards[0] == rewards[1] == rewards[2] == rewards[3] \
                else rewards[0]
            on_policy = sequence_logprobs(model, [3, 4, 5], completions)
            behaviour = [[min(x + draw.gauss(0, 0.3), 0.0) for x in lp] for lp in on_policy]
            groups.append(make_group(model, rewards, completions, f"s{step}g{g}", behaviour))
        out.append(groups)
    return out


def initial_weights() -> dict[str, torch.Tensor]:
    """The policy's weights before any step, fp32, by HF name."""
    from echo2p2p.policy.model import load_policy

    model, _ = load_policy("tiny")
    return {k: v.float() for k, v in model.state_dict().items()}


class Prompt:
    def __init__(self, prompt: str):
        self.prompt, self.answer = prompt, ""


def run(ranks, save: str = "", load: str = "", checkpointing: bool = False) -> dict:
    """The steps on this process (`ranks` None) or on the learner's ranks."""
    from pathlib import Path

    from echo2p2p.hub.learning.learner import Learner
    from echo2p2p.policy.model import load_policy

    model, tokenizer = load_policy("tiny")  # the built-in policy: its completions mean something
    plan = batches(model)
    if ranks is not None and ranks.rank > 0:  # as `echo2-hub serve` makes them: rank 0's weights
        model, _ = load_policy("tiny", weights=False)
    learner = Learner(model, lr=LR, kl_coef=0.1, max_grad_norm=0.5, micro_tokens=40,
                      ranks=ranks, checkpointing=checkpointing)
    half = STEPS // 2
    if load:
        learner.load(Path(load))
    stats = [asdict(learner.step(b)) for b in plan[half if load else 0:half if save else None]]
    if save:
        learner.save(Path(save))
    # 5 prompts in calls of 2: 2 calls per rank, the second rank's last one a stand-in
    texts = learner._completions(tokenizer, [Prompt(f"{i}+{i + 3}=") for i in range(5)],
                                 max_new_tokens=6, batch_size=2, prompts=PLAIN)
    return {"weights": learner.export_weights(torch.float32), "stats": stats, "texts": texts}


if __name__ == "__main__":
    from echo2p2p.hub.config import HubConfig
    from echo2p2p.hub.learning.ranks import Ranks

    args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
    ranks = Ranks.from_env(HubConfig.from_flat(prompts_per_step=GROUPS_PER_STEP))
    result = run(ranks, args.get("--save", ""), args.get("--load", ""),
                 args.get("--checkpointing") == "on")
    if ranks.rank == 0:
        torch.save(result, sys.argv[1])
    ranks.close()
