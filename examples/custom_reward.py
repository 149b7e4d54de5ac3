"""Train the built-in model with reward functions defined in this file: python examples/custom_reward.py"""

from echo2p2p.hub import Run


def right_sum(prompt: str, completion: str, row: dict) -> float:
    """1 for the exact sum, 0.2 for a wrong number of the right length (a hint of progress)."""
    a, b = prompt.rstrip("=").split("+")
    answer, guess = str(int(a) + int(b)), completion.strip()
    return 1.0 if guess == answer else 0.2 if guess.isdigit() and len(guess) == len(answer) else 0.0


async def no_hedge(prompt: str, completion: str, row: dict) -> float:
    """Async works too: 1 unless the answer hedges with a '?', as the base model likes to."""
    return 0.0 if "?" in completion else 1.0


if __name__ == "__main__":  # the hub's scoring workers import this file to find the functions
    records = Run(reward=[right_sum, no_hedge], reward_weights=[1.0, 0.25],
                  max_steps=30, eval_every=10).demo(peers=2)
    steps = [r for r in records if "step" in r]
    print(f"train reward {steps[0]['train/reward_mean']:.3f} -> {steps[-1]['train/reward_mean']:.3f}")
