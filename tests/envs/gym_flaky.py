"""Gymnasium text environments that break the rules: one ignores its seed (its pile comes from
the process's random state), one observes numbers instead of text."""

import random

import gymnasium as gym


class Flaky(gym.Env):
    def reset(self, *, seed=None, options=None):
        self.pile = random.randint(5, 50)  # not from the seed
        return f"pile {self.pile}:", {}

    def step(self, action):
        self.pile -= 1
        return f"pile {self.pile}:", 0.0, self.pile <= 0, False, {}


class Numbers(gym.Env):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 3, {}

    def step(self, action):
        return 2, 0.0, True, False, {}
