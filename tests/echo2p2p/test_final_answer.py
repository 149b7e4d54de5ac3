"""The statement a completion commits to (`echo2p2p.tasks.final_answer`): tags, then boxes,
then the final line, right of its last "="; nothing when tags or boxes disagree."""

from __future__ import annotations

import pytest

from echo2p2p.tasks.final_answer import (Statement, boxed_contents, committed_statement,
                                         number_count, plain_number, same_number, single_number)


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{\\frac{1}{2}} and \\boxed{3}", ["\\frac{1}{2}", "3"]),
    ("\\boxed{\\boxed{3}}", ["\\boxed{3}"]),  # outermost only
    ("\\boxed{3} \\boxed{unclosed", ["3"]),
    ("no box", []),
])
def test_boxed_contents(text, expected):
    assert boxed_contents(text) == expected


@pytest.mark.parametrize("completion, numeric, expected", [
    ("84 + 80 = 164", True, Statement("164", False)),
    ("84 + 80 = 84 + 80", True, Statement("84 + 80", False)),
    ("Work: 2 + 2 = 4\nThe answer is 4.\nThanks!", True, Statement("The answer is 4.", False)),
    ("Work: 2 + 2 = 4\nThanks!", False, Statement("Thanks!", False)),
    ("so \\boxed{x = 5}, done", True, Statement("5", True)),
    ("\\boxed{3} then \\boxed{ 3 }", True, Statement("3", True)),  # the same answer twice
    ("\\boxed{3} or \\boxed{4}", True, None),
    ("<answer>3</answer><answer>4</answer>", True, None),
    ("<answer>x \\boxed{3}</answer> \\boxed{4}", True, Statement("3", True)),  # the tag's box
    ("   \n ", False, None),
    ("the answer is 4 =", True, None),
])
def test_committed_statement(completion, numeric, expected):
    assert committed_statement(completion, numeric=numeric) == expected


def test_an_equation_gold_keeps_the_equation():
    assert committed_statement("\\boxed{y = 2x}", numeric=False, keep_equation=True) == \
        Statement("y = 2x", True)


def test_numbers():
    """One number or none: commas are thousands, a Unicode minus is a minus."""
    assert single_number("It costs $1,000.") == "1000"
    assert single_number("\u22123 degrees") == "-3"
    assert single_number("84 + 80") is single_number("164 or 165") is single_number("x") is None
    assert number_count("\\frac{1}{2}") == 2 and number_count("\\pi") == 0
    assert plain_number("$1,000") == "1000" and plain_number("5\\%") == "5"
    assert plain_number("\\frac{1}{2}") is plain_number("x + 1") is plain_number("") is None
    assert plain_number("\\$ 18") == "18" and plain_number("1,\\!000") == "1000"
    assert plain_number("1, 2") is plain_number("-3, 5") is None  # two answers, not 12
    assert same_number("72.0", "72") and same_number("-0.0", "0") and same_number("007", "7")
    assert not same_number(None, "1") and not same_number("7", "70") and not same_number("-7", "7")
    assert not same_number("0.5", "5") and same_number("-12.50", "-12.5")
