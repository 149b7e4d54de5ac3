"""A Gymnasium text environment, trained here as it is: python examples/gym_blackjack.py

`BlackjackText` is Gymnasium's own Blackjack-v1 in text: `reset(seed=...)` -> (observation,
info) and `step(action)` -> (observation, reward, terminated, truncated, info), as SkyRL-gym and
grail write theirs. The model reads "14 v 10:" (its sum, the dealer's card) and answers "1" to
hit or "2" to stick (the built-in take-away player's moves); anything else forfeits the hand,
which costs more than losing it (-2). The hub runs it with
`--env gym:gym_blackjack:BlackjackText` (this module, importable by that name: the script puts its
own folder on the peers' PYTHONPATH, as installing a package would). Gymnasium draws the cards
from `reset(seed=...)`, so an episode is a function of its seed and the model's turns, which the
hub checks before it serves the environment and replays for every episode."""

import gymnasium as gym

MOVES = {"1": 1, "2": 0}  # hit, stick
FORFEIT = -2.0


class BlackjackText(gym.Env):
    """Blackjack-v1 with text observations and actions."""

    metadata: dict = {}

    def __init__(self):
        self.game = gym.make("Blackjack-v1")
        self.observation_space = gym.spaces.Text(16)
        self.action_space = gym.spaces.Text(8)

    def reset(self, *, seed=None, options=None):
        state, info = self.game.reset(seed=seed)
        return self.say(state), info

    def step(self, action: str):
        move = MOVES.get(action.strip())
        if move is None:
            return "", FORFEIT, True, False, {"forfeit": True}
        state, reward, terminated, truncated, info = self.game.step(move)
        return self.say(state), float(reward), terminated, truncated, info

    @staticmethod
    def say(state) -> str:
        total, dealer, _usable_ace = state
        return f"{total} v {dealer}:"


if __name__ == "__main__":
    from environment_demo import train

    train("gym:gym_blackjack:BlackjackText", steps=200)
