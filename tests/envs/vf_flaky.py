"""A multi-turn verifiers environment whose answer is drawn from the process's random state, not
from its row: not a function of its seed, so the hub must refuse it."""

import random

import verifiers as vf
from datasets import Dataset


class Flaky(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        # One of 2**32 answers: two plays of seed 0 agree by chance about never (a choice of
        # two made the first seed's plays agree once in a few hundred runs, and the check then
        # named seed 1).
        return [vf.UserMessage(content=f"{random.getrandbits(32):08x}")]


def load_environment(**kwargs) -> vf.Environment:
    dataset = Dataset.from_list([{"question": f"q{i}", "answer": "1"} for i in range(20)])
    return Flaky(dataset=dataset, max_turns=3, rubric=vf.Rubric(funcs=[lambda: 0.0]), **kwargs)
