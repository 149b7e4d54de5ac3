"""Train the built-in model with rewards written for TRL, on rows in TRL's conversational format:
python examples/trl_reward.py

`right_sum` is a reward as TRL's GRPOTrainer takes it (the completions as messages, the rows'
columns as keyword lists); `get_soft_overlong_punishment` is TRL's own, reading the
completions' token ids. Neither is changed to run here: the hub calls them in its scoring workers
on the ids each peer sent."""

import random

from trl.rewards import get_soft_overlong_punishment

from echo2p2p.hub import Run


def right_sum(completions, answer, **kwargs):
    """1 for the exact sum, 0.2 for a wrong number of the right length (a hint of progress)."""
    out = []
    for completion, gold in zip(completions, answer):
        guess = completion[0]["content"].strip()
        out.append(1.0 if guess == gold else 0.2 if guess.isdigit() and len(guess) == len(gold)
                   else 0.0)
    return out


too_long = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)


def sums(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(1, 99)) for _ in range(n)]
    return [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a, b in pairs]


if __name__ == "__main__":  # the hub's scoring workers import this file to find the functions
    records = Run(dataset=sums(600), reward=[right_sum, too_long], reward_weights=[1.0, 0.5],
                  eval_problems=64, max_steps=30, eval_every=10).demo(peers=2)
    steps = [r for r in records if "step" in r]
    held_out = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    print(f"train reward {steps[0]['train/reward_mean']:.3f} -> {steps[-1]['train/reward_mean']:.3f}"
          f"; held-out reward {held_out[0]:.3f} -> {held_out[-1]:.3f}")
