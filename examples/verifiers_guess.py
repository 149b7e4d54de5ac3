"""A verifiers environment, written as prime-rl's Environments Hub writes them, trained here as it
is: python examples/verifiers_guess.py

`load_environment()` returns a `vf.MultiTurnEnv`: guess a number from 1 to 3 in two turns, told
"higher" or "lower" after a wrong guess; its rubric pays 1 for finding it. (The built-in
take-away player, which says "1", "2" or "3", plays it; guessing 2 first always wins.) The hub runs
it with `--env verifiers:verifiers_guess` (this module, importable by that name: the script puts
its own folder on the peers' PYTHONPATH, as `pip install` of an environment package would): the
peers play every episode and the hub replays it, so an observation a peer alters is caught."""

import verifiers as vf
from datasets import Dataset

LOW, HIGH = 1, 3


def rows(n: int, offset: int = 0) -> Dataset:
    """n games, their secret numbers cycling through LOW..HIGH."""
    return Dataset.from_list([{"question": f"guess {LOW}-{HIGH}:",
                               "answer": str(LOW + (offset + i) % (HIGH - LOW + 1))}
                              for i in range(n)])


def guess(messages: vf.Messages) -> int | None:
    """The model's last turn as a number in range, else None."""
    text = (messages[-1]["content"] if messages else "").strip()
    return int(text) if text.isdigit() and LOW <= int(text) <= HIGH else None


class GuessEnv(vf.MultiTurnEnv):
    """Higher or lower after each guess; a guess out of range ends the game."""

    @vf.stop
    async def found_or_lost(self, state: vf.State) -> bool:
        if not state["trajectory"]:
            return False
        last = guess(state["trajectory"][-1]["completion"])
        return last is None or last == int(state["answer"])

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        higher = guess(messages) < int(state["answer"])
        return [vf.UserMessage(content="higher:" if higher else "lower:")]


def found(completion: vf.Messages, answer: str) -> float:
    """1 when a guess of the game was the secret number."""
    turns = [m for m in completion if m["role"] == "assistant"]
    return float(any(guess([m]) == int(answer) for m in turns))


def load_environment(**kwargs) -> vf.Environment:
    return GuessEnv(dataset=rows(700, 64), eval_dataset=rows(64), max_turns=2,
                    rubric=vf.Rubric(funcs=[found]), **kwargs)


if __name__ == "__main__":
    from environment_demo import train

    train("verifiers:verifiers_guess", steps=100)
