"""What a completion commits to as its final answer, or nothing when it commits to several.

A reward that credits any number found in the text, or the gold answer found inside a longer
one, pays a policy for hedging: "164 165", the gold with a digit appended, or digit soup earn
something where a wrong answer earns 0, and an echo of the question ("84 + 80") is, to a
symbolic checker, equal to its sum. The strict rewards (`math_reward`, reasoning-gym's tasks by
default) score only the one statement this module picks out of a completion:

- the content of its `<answer>...</answer>` tags, if it has some, else the whole text;
- in that, the content of its `\\boxed{...}`, if it has some; tags or boxes that say different
  things are a hedge, and commit to nothing;
- else its final line: the last non-empty line, or, against a numeric gold, the last line that
  holds a number (a sign-off after the answer is not an answer);
- of that, the right-hand side of its last "=" ("84 + 80 = 164" commits to 164), unless the
  gold is itself an equation.

Against a numeric gold that statement must hold exactly one number (`single_number`): "164 or
165", "163 164 165" and "84 + 80" hold several. Against an expression gold ("\\frac{1}{2}") it
may hold no more numbers than the gold does (`number_count`): "\\frac{1}{4} + \\frac{1}{4}"
is the question, not its answer, while "0.5" and "\\frac{2}{4}" stay for a checker to judge.
Pure text rules: no math-verify here, and nothing a completion says can make them slow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number as answers write it: a sign, thousands commas ("1,234"), a decimal part.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_BOX = "\\boxed{"
# What a numeric gold may carry around its number ("$1,000", "5\\%", "1,\\!000").
_NUMBER_DRESS = re.compile(r"\\?[$%]|\\!")


def boxed_contents(text: str) -> list[str]:
    """The contents of every outermost, closed `\\boxed{...}` of `text`, in order (braces
    balanced: "\\boxed{\\frac{1}{2}}" holds "\\frac{1}{2}")."""
    found, start = [], text.find(_BOX)
    while start >= 0:
        depth, open_at = 0, start + len(_BOX) - 1
        for j in range(open_at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                found.append(text[open_at + 1:j])
                break
        else:
            return found  # unclosed: nothing after it is boxed either
        start = text.find(_BOX, j + 1)
    return found


def _one_of(candidates: list[str]) -> str | None:
    """The last of `candidates` if they all say the same (whitespace aside), else None."""
    if len({" ".join(c.split()) for c in candidates}) > 1:
        return None
    return candidates[-1]


@dataclass(frozen=True)
class Statement:
    """The answer a completion commits to: its `text`, and whether that was `boxed` content
    (a checker that reads LaTeX parses it as such; a final line is prose around an answer)."""

    text: str
    boxed: bool


def committed_statement(completion: str, *, numeric: bool,
                        keep_equation: bool = False) -> Statement | None:
    """The statement `completion` commits to as its answer (the rules of the module
    docstring), stripped; None when it commits to several, or says nothing. `numeric`: the
    gold is a number (the final line is then the last one holding a number); `keep_equation`:
    the gold is an equation, so a statement is not cut at its last "="."""
    tagged = ANSWER_TAG.findall(completion)
    region = completion if not tagged else _one_of(tagged)
    if region is None:
        return None
    boxes = boxed_contents(region)
    if boxes:
        text = _one_of(boxes)
    else:
        lines = [line for line in region.splitlines() if line.strip()]
        if numeric:
            lines = [line for line in lines if NUMBER.search(line)]
        text = lines[-1] if lines else None
    if text is None:
        return None
    if not keep_equation:
        text = text.rsplit("=", 1)[-1]
    return Statement(text.strip(), bool(boxes)) if text.strip() else None


def numbers_in(text: str) -> list[str]:
    """The numbers `text` writes, commas dropped, a Unicode minus read as "-"."""
    return [n.replace(",", "") for n in NUMBER.findall(text.replace("\u2212", "-"))]


def number_count(text: str) -> int:
    """How many numbers `text` writes ("\\frac{1}{2}": 2)."""
    return len(numbers_in(text))


def single_number(text: str) -> str | None:
    """The one number `text` holds ("It costs $1,000." gives "1000"); None for none or
    several ("84 + 80", "164 or 165")."""
    found = numbers_in(text)
    return found[0] if len(found) == 1 else None


def plain_number(answer: str) -> str | None:
    """`answer` as a bare number if it is one, dressed or not ("$1,000" gives "1000", "5\\%"
    gives "5"); None for anything else ("\\frac{1}{2}", "x + 1", "blue", "1, 2")."""
    bare = _NUMBER_DRESS.sub("", answer.replace("\u2212", "-")).strip()
    return bare.replace(",", "") if NUMBER.fullmatch(bare) else None


def _canonical(number: str) -> str:
    """A bare number written one way: no leading zeros, no trailing decimal zeros, no "-0"."""
    sign, digits = ("-", number[1:]) if number.startswith("-") else ("", number)
    whole, _, fraction = digits.partition(".")
    whole, fraction = whole.lstrip("0") or "0", fraction.rstrip("0")
    written = whole + ("." + fraction if fraction else "")
    return "0" if written == "0" else sign + written


def same_number(said: str | None, gold: str) -> bool:
    """`said` and `gold` (bare numbers, as `single_number` and `plain_number` give them) are the
    same value ("72.0" and "72", "007" and "7", "-0" and "0")."""
    return said is not None and _canonical(said) == _canonical(gold)
