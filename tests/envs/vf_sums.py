"""A single-turn verifiers environment with a system prompt, a parser and a weighted rubric."""

import verifiers as vf
from datasets import Dataset


def rows(n: int, offset: int) -> Dataset:
    return Dataset.from_list([{"question": f"{10 + i % 80}+{1 + i % 9}=",
                               "answer": str(10 + i % 80 + 1 + i % 9)}
                              for i in range(offset, offset + n)])


def exact(completion, answer, parser) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


def digits(completion) -> float:
    text = completion[-1]["content"].strip()
    return float(text.isdigit())


def load_environment(**kwargs) -> vf.Environment:
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[exact, digits], weights=[1.0, 0.25], parser=parser)
    return vf.SingleTurnEnv(dataset=rows(300, 100), eval_dataset=rows(40, 0), parser=parser,
                            system_prompt="Add.", rubric=rubric, **kwargs)
