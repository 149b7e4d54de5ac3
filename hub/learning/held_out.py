"""A held-out evaluation in pieces, and how far it has got: what a user watches for minutes.

On a real model an evaluation is long: SmolLM2-135M's 200 greedy problems took 50 s on two idle
cores and 3-11 minutes on two loaded ones, while nothing else happens (the base evaluation runs
before the first step, so every figure of the run is still empty). So the problems are
evaluated PIECE_PROBLEMS at a time, and after each piece `EvalProgress` counts the problems done:
a bar on a terminal (`echo2p2p.runtime.progress.count_bar`), and "evaluating v0: 128/200" on the
dashboard and in `echo2-hub status`, which read it through /status (`echo2p2p.hub.view.status`).

The pieces run in the worker thread the evaluation runs in; `EvalProgress` is written there and
read by the event loop's /status, unlocked: each field is one int, written whole, and a reader
that sees `done` a piece behind shows the previous count, no harm. Neither side waits for the
other.

A piece is one greedy `generate` call (the learner's evaluation batch, 64, is larger): on a CPU
decoding costs about in proportion to the batch, so the pieces add each call's overhead and
little else (not measured here; a GPU would use a larger batch better, and evaluates 200
problems in seconds anyway). The accuracy is the mean over all problems, as one call gives it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from echo2p2p.runtime.progress import count_bar

PIECE_PROBLEMS = 32  # problems evaluated between two counts: 7 counts of SmolLM2's 200


@dataclass
class EvalProgress:
    """An evaluation under way: of version `version`, `done` of `total` problems evaluated."""

    version: int
    total: int
    done: int = 0

    def as_dict(self) -> dict[str, int]:
        """What /status answers under "evaluating"."""
        return {"version": self.version, "done": self.done, "total": self.total}


def evaluate_in_pieces(evaluate: Callable[[Sequence[Any]], float], problems: Sequence[Any],
                       progress: EvalProgress, piece: int = PIECE_PROBLEMS,
                       stream: TextIO | None = None) -> float:
    """The mean reward over `problems`, `evaluate` (the mean over the problems it is given)
    called on `piece` of them at a time, `progress` counted after each (and a bar drawn on
    `stream`, stderr, if a terminal, redrawn after each piece). Blocking: call it in a worker
    thread."""
    if not problems:
        return 0.0
    total = 0.0
    with count_bar(len(problems), f"evaluating v{progress.version}", "problem",
                   stream=stream) as bar:
        for start in range(0, len(problems), piece):
            part = problems[start:start + piece]
            # back from a mean to a sum: rounded, so that 3/25 * 25 sums to 3 and the whole
            # mean is what one call over every problem would have returned
            total += round(evaluate(part) * len(part), 9)
            progress.done += len(part)
            bar.update(len(part))
            bar.refresh()  # every piece is drawn: it took seconds, past the bar's redraw limit
    return total / len(problems)
