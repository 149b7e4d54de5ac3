"""Take-away, the built-in multi-turn environment: take 1-3 stones, whoever takes the last wins.

The model moves first on a pile of 9..21 stones (drawn from the episode's seed) against a fixed
opponent that plays the winning move (leave a multiple of 4) with probability `OPPONENT_SKILL`
and a uniform legal move otherwise, its choice drawn from (seed, turn) alone, so an episode is
a pure function of its seed and the model's actions (the hub replays it, `echo2p2p.episodes`).
A model turn's action, stripped, must be exactly "1", "2" or "3" and at most the pile; anything
else loses at once. Reward 1 when the model takes the last stone, else 0, given on the last turn.
Observations are short (the built-in model reads one token per character and has 512
positions): "take 1-3. pile 17: ", then "I took 2. pile 12: ".

Pure: no clock, no I/O; `make` is the factory the "echo2p2p.environments" entry point names.
"""

from __future__ import annotations

import random

from echo2p2p.episodes import Step

MIN_PILE, MAX_PILE = 9, 21
MOVES = ("1", "2", "3")
OPPONENT_SKILL = 0.75  # chance the opponent plays the winning move when it has one


def optimal_move(pile: int) -> int:
    """The winning move from `pile` (leave a multiple of 4); 1 when there is none (a lost
    position against perfect play: take the least, leaving the opponent the most room to err)."""
    return pile % 4 or 1


def random_move(pile: int, rng: random.Random) -> int:
    """A uniform legal move from `pile` (>= 1)."""
    return rng.randint(1, min(3, pile))


def legal(action: str, pile: int) -> bool:
    """Whether the model turn `action` is a move on `pile`: "1", "2" or "3" (spaces around
    allowed), at most the pile."""
    move = action.strip()
    return move in MOVES and int(move) <= pile


def prompt(pile: int) -> str:
    """What the model reads before a move on `pile` stones."""
    return f"take 1-3. pile {pile}: "


class TakeAway:
    """One take-away game against the fixed opponent (an `echo2p2p.episodes.Environment`)."""

    name = "takeaway"
    version = "1"
    max_turns = 12  # never reached: each round takes at least 2 of at most 21 stones

    def __init__(self, opponent_skill: float = OPPONENT_SKILL):
        self.opponent_skill = opponent_skill
        self.seed: int | None = None
        self.pile = 0
        self.turn = 0  # model turns played
        self.done = True

    def reset(self, seed: int) -> str:
        """Start the game of `seed`: its pile, and the first observation."""
        self.seed, self.turn, self.done = seed, 0, False
        self.pile = random.Random(f"takeaway/{seed}").randint(MIN_PILE, MAX_PILE)
        return prompt(self.pile)

    def step(self, action: str) -> Step:
        """The model takes `action` stones; the opponent answers unless the game is over."""
        if self.done:
            raise ValueError("take-away: step() after the game ended (or before reset())")
        self.turn += 1
        if not legal(action, self.pile):
            return self._end(0.0)  # an illegal move loses at once
        self.pile -= int(action)
        if self.pile == 0:
            return self._end(1.0)
        taken = self.opponent_move()
        self.pile -= taken
        if self.pile == 0:
            return self._end(0.0)
        return Step(f"I took {taken}. pile {self.pile}: ", 0.0, False)

    def opponent_move(self) -> int:
        """The opponent's move on the current pile: fixed by (seed, turn)."""
        rng = random.Random(f"takeaway/{self.seed}/opponent/{self.turn}")
        if self.pile % 4 and rng.random() < self.opponent_skill:
            return optimal_move(self.pile)
        return random_move(self.pile, rng)

    def _end(self, reward: float) -> Step:
        self.done = True
        return Step("", reward, True)


def make() -> TakeAway:
    """The environment the "takeaway" entry point names (a fresh game; `reset` starts one)."""
    return TakeAway()
