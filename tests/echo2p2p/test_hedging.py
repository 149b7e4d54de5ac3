"""Issue 42, item 7: no default reward pays for hedging. Against real problems, a hedge (the
gold with a digit appended, two or three answers, boxes or tags that disagree), digit soup
and the question echoed back score 0 where the exact answer scores 1, on reasoning-gym's
generators (full credit or nothing), the math reward and the addition task; the partial-credit
option gives the generator's old scores back."""

from __future__ import annotations

import pytest

from echo2p2p.tasks import AdditionTask, addition_reward, math_reward

DIGIT_SOUP = "0123456789"


def hedges(gold: str, question: str) -> dict[str, str]:
    """Completions that commit to no one answer, or to the question, for a numeric `gold`."""
    n = int(gold)
    return {
        "gold with a digit appended": f"{gold}7",
        "two answers in the tag": f"<answer>{gold} {n + 1}</answer>",
        "two answers, gold last": f"{n + 1} or {gold}",
        "three answers": f"{n - 1} {gold} {n + 1}",
        "the gold, then a doubt": f"The answer is {gold}, or maybe {n + 1}",
        "boxes that disagree": f"\\boxed{{{n + 1}}} \\boxed{{{gold}}}",
        "tags that disagree": f"<answer>{n + 1}</answer> <answer>{gold}</answer>",
        "digit soup": DIGIT_SOUP,
        "digit soup, tagged": f"<answer>{DIGIT_SOUP}</answer>",
        "the question echoed": f"{question} = {question}",
        "the question, boxed": f"\\boxed{{{question}}}",
    }


def exact(gold: str, question: str) -> dict[str, str]:
    """Completions that commit to the gold alone."""
    return {"bare": gold, "tagged": f"<answer>{gold}</answer>", "boxed": f"\\boxed{{{gold}}}",
            "worked": f"{question} = {gold}", "said, then a sign-off":
            f"The answer is {gold}.\n\nLet me know if you need more help!"}


# -- reasoning-gym ---------------------------------------------------------------------------

GENERATORS = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "leg_counting": {"min_animals": 1, "max_animals": 3},
}


def _generator_task(name: str, partial: bool = False):
    pytest.importorskip("reasoning_gym")
    from echo2p2p.tasks.reasoning import ReasoningTask

    return ReasoningTask(name, GENERATORS[name], eval_size=16, train_size=200,
                         partial_credit=partial)


def _sum_of(question: str) -> str:
    """The arithmetic a generator's question asks for ("...: 4 + 31 - 7 =" -> "4 + 31 - 7")."""
    return question.rstrip().rstrip(".").rstrip("=").rsplit(":", 1)[-1].replace("Calculate",
                                                                                "").strip()


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_pay_nothing_for_a_hedge(name):
    """Full credit or nothing, by default: every hedge scores 0 on every held-out problem,
    every exact answer 1."""
    task = _generator_task(name)
    score = task.scorer()
    problems = [p for p in task.problems("eval") if p.answer.lstrip("-").isdigit()]
    assert len(problems) >= 8
    for p in problems:
        question = _sum_of(p.row["question"]) if name != "leg_counting" else "2 + 4"
        paid = {k: score(p, c) for k, c in hedges(p.answer, question).items() if score(p, c)}
        assert paid == {}, f"{p.row['question']!r} (gold {p.answer}): {paid}"
        assert {k: score(p, c) for k, c in exact(p.answer, question).items()} == \
               dict.fromkeys(exact(p.answer, question), 1.0)


def test_partial_credit_gives_the_old_scores_back():
    """With "partial_credit" chain_sum's own scores stand: the gold with a digit appended earns
    len(gold) / len(answer), a tagged pair of answers likewise, digit soup containing the gold
    1/5 to 1/10, where the strict default gives 0 to each."""
    strict, partial = _generator_task("chain_sum"), _generator_task("chain_sum", partial=True)
    problems = [p for p in partial.problems("eval") if p.answer.isdigit()]
    assert problems
    for p in problems:
        g = p.answer
        assert partial.scorer()(p, f"{g}7") == pytest.approx(len(g) / (len(g) + 1))
        pair = f"{g} {int(g) + 1}"
        assert partial.scorer()(p, f"<answer>{pair}</answer>") == pytest.approx(len(g) / len(pair))
        soup = partial.scorer()(p, DIGIT_SOUP)
        assert soup == (pytest.approx(len(g) / len(DIGIT_SOUP)) if g in DIGIT_SOUP else 0.0)
        assert strict.scorer()(p, f"{g}7") == strict.scorer()(p, DIGIT_SOUP) == 0.0


def test_a_generators_own_normalisation_still_earns_full_credit():
    """Strict is the generator's full credit: chain_sum reads "+013.00" as 13, and
    spell_backward ignores case; spell_backward gives its gold with a letter appended 0.8, or
    0.9999999999999998 where a float sum misses its own `== 1.0` check: strict scores 0."""
    task = _generator_task("chain_sum")
    p = next(p for p in task.problems("eval") if p.answer.isdigit())
    assert task.scorer()(p, f"+0{p.answer}.00") == 1.0
    pytest.importorskip("reasoning_gym")
    from echo2p2p.tasks.reasoning import ReasoningTask

    backward = ReasoningTask("spell_backward", {}, eval_size=4, train_size=200)
    q = backward.problems("eval")[0]
    assert backward.scorer()(q, q.answer.upper()) == 1.0
    assert backward.scorer()(q, q.answer + "x") == 0.0
    loose = ReasoningTask("spell_backward", {}, eval_size=4, train_size=200, partial_credit=True)
    assert 0.0 < loose.scorer()(q, q.answer + "x") < 1.0


# -- the math reward -------------------------------------------------------------------------

@pytest.mark.parametrize("a, b", [(84, 80), (7, 9), (31, 45), (99, 99)])
def test_math_pays_nothing_for_an_echoed_sum_or_a_hedge(a, b):
    """Two-digit sums: the echoed question ("84 + 80 = 84 + 80", which math-verify evaluates
    to the gold), hedges and digit soup score 0; the sum, worked or bare, scores 1."""
    gold, question = str(a + b), f"{a} + {b}"
    paid = {k: math_reward(gold, c) for k, c in hedges(gold, question).items()
            if math_reward(gold, c)}
    assert paid == {}
    assert all(math_reward(gold, c) == 1.0 for c in exact(gold, question).values())
    assert math_reward(gold, f"{question}") == 0.0
    assert math_reward(gold, f"\\frac{{{2 * (a + b)}}}{{2}}") == 0.0  # unevaluated too


@pytest.mark.parametrize("gold, completion, expected", [
    ("\\frac{1}{2}", "So it is \\boxed{0.5}.", 1.0),
    ("\\frac{1}{2}", "So it is \\boxed{\\frac{2}{4}}.", 1.0),  # the same size as the gold
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{4} + \\frac{1}{4}}", 0.0),  # the question, unevaluated
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}} or \\boxed{\\frac{1}{3}}", 0.0),
    ("\\frac{1}{2}", "x = \\frac{1}{2}", 1.0),
    ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", 1.0),  # bare, math-verify parses "\sqrt{2}" to nothing
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}", 1.0),
    ("(1, 3)", "\\boxed{(1, 3)}", 1.0),
    ("y = 2x + 3", "\\boxed{y = 2x + 3}", 1.0),
    ("0.5", "\\boxed{\\frac{1}{2}}", 0.0),  # a numeric gold takes one number, not a fraction
    ("1, 2", "\\boxed{2, 1}", 1.0),  # two roots: an expression, not the number 12
    ("1, 2", "\\boxed{1}", 0.0),
])
def test_math_expression_answers(gold, completion, expected):
    """An expression gold is judged by math-verify on the one statement committed to, as long
    as it holds no more numbers than the gold: equivalent forms score, an unevaluated one not."""
    pytest.importorskip("math_verify")
    assert math_reward(gold, completion) == expected


# -- the addition task -----------------------------------------------------------------------

def test_addition_exact_match_pays_nothing_for_a_hedge():
    """The built-in addition reward is an exact match: no hedge of its prompts earns anything."""
    for p in AdditionTask(eval_size=20, train_size=20).problems("eval"):
        question = p.prompt.removesuffix("=")
        paid = {k: c for k, c in hedges(p.answer, question.replace("+", " + ")).items()
                if addition_reward(p.answer, c)}
        assert paid == {}
        assert addition_reward(p.answer, p.answer) == 1.0
