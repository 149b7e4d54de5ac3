"""Gold answers out of dataset rows: GSM8K's "#### 72", MATH's last \\boxed{...}, or the text.

A dataset's answer field often holds a worked solution; the reward compares a completion with
the final answer only, so the hub extracts it once, when it reads the rows
(`problems_from_records`), and the task keeps the extracted text as `Problem.answer`. Peers
score with the same `math_reward` on the same answer string, whatever style the rows came in.

Styles (`ANSWER_FORMATS`):
- "gsm8k": the text after the last "####" ("Natalia sold ... #### 72" -> "72"; commas dropped);
- "math": the content of the last \\boxed{...} (braces balanced: "\\boxed{\\frac{1}{2}}");
- "plain": the whole field, stripped (a dataset whose answer field is already the answer);
- "auto": "gsm8k" if the text has "####", else "math" if it has a \\boxed{, else "plain".
A row whose answer the style cannot find, or whose question is not text, is skipped and counted;
no usable row at all is a ValueError naming the fix. Pure: rows come in as plain mappings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .base import Problem

ANSWER_FORMATS = ("auto", "gsm8k", "math", "plain")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None if there is none (or unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str, answer_format: str) -> str | None:
    """The final answer inside `text` under `answer_format`; None when there is none."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer format {answer_format!r}; expected one of "
                         f"{', '.join(ANSWER_FORMATS)}")
    if answer_format == "auto":
        answer_format = ("gsm8k" if "####" in text else "math" if "\\boxed{" in text
                         else "plain")
    if answer_format == "gsm8k":
        found = text.rsplit("####", 1)[-1].replace(",", "") if "####" in text else None
    elif answer_format == "math":
        found = last_boxed(text)
    else:
        found = text
    found = found.strip() if found is not None else None
    return found or None


# `value`: a dataset cell, whatever its column holds.
def _text(value: Any) -> str | None:
    """A row value usable as text: a string, or a number (GSM8K-like sets store ints)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def problems_from_records(records: Iterable[Mapping[str, Any]], *, question_field: str,
                          answer_field: str, answer_format: str, template: str,
                          id_prefix: str) -> tuple[list[Problem], int]:
    """(problems, rows skipped) of dataset rows: the prompt is `template` with {question}, the
    answer extracted from `answer_field`; ids are "<id_prefix>-<row index>"."""
    problems, skipped = [], 0
    for index, row in enumerate(records):
        question, raw = _text(row.get(question_field)), _text(row.get(answer_field))
        answer = extract_answer(raw, answer_format) if raw is not None else None
        if question is None or not question.strip() or answer is None:
            skipped += 1
            continue
        problems.append(Problem(id=f"{id_prefix}-{index}",
                                prompt=template.format(question=question.strip()), answer=answer))
    if not problems:
        raise ValueError(
            f"no usable row in {id_prefix!r}: every row lacks a text field {question_field!r} or "
            f"an answer in field {answer_field!r} that answer format {answer_format!r} can "
            f"extract; check the field mapping, or set the answer format to 'plain'")
    return problems, skipped
