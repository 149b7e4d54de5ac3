"""The log budget: at most so many lines of one kind a minute, the rest counted and summed up.

A peer can make the hub (or another peer) log a line per frame it sends: 3,361 relay reports
a second were 80,127 lines (7.3 MB) in 40 s. Within each window (WINDOW_S, counted from the
first line after the last window ended) the first `lines_per_window` lines of a kind are
logged and the rest only counted; when the window ends, `due` returns one `Suppressed` per kind
that went over, for the caller to log as one line each. A kind is whatever the caller says
(the logging shell uses the logger's name and the record's format string, so that every line
of one call site is one kind, whatever its arguments). The kinds kept are bounded: past
`max_kinds` in a window, the new ones share the budget of one kind, OTHER.

Which lines are budgeted at all is the caller's choice (the shell never holds back an ERROR).
Pure: `now` comes in, nothing is logged here.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

LINES_PER_WINDOW = 60  # lines of one kind logged a window: one a second on average
WINDOW_S = 60.0
MAX_KINDS = 1024  # kinds counted apart in one window; the code has far fewer call sites
OTHER = ("", "(lines of kinds past the first max_kinds of the window)")


@dataclass(frozen=True)
class Suppressed:
    """A kind that went over its budget in the window just ended: `lines` not logged, the
    highest `level` among them (a logging level number), over `window_s` seconds."""

    kind: Hashable
    lines: int
    level: int
    window_s: float


class LogBudget:
    """Per-kind line budgets over fixed windows."""

    def __init__(self, lines_per_window: int = LINES_PER_WINDOW, window_s: float = WINDOW_S,
                 max_kinds: int = MAX_KINDS):
        self.lines_per_window, self.window_s, self.max_kinds = lines_per_window, window_s, max_kinds
        self._start: float | None = None  # the window's start; None: no window open
        self._logged: dict[Hashable, int] = {}
        self._held: dict[Hashable, list[int]] = {}  # kind -> [lines held back, highest level]

    @property
    def window_end(self) -> float | None:
        """When the open window ends (None: none is open)."""
        return None if self._start is None else self._start + self.window_s

    def admit(self, kind: Hashable, level: int, now: float) -> bool:
        """Whether a line of `kind` at `now` is logged (else it is counted). Call `due(now)`
        first, so that a window that has ended is summed up before a new one opens."""
        if self._start is None:
            self._start = now
        if kind not in self._logged and len(self._logged) >= self.max_kinds:
            kind = OTHER
        logged = self._logged.get(kind, 0)
        if logged < self.lines_per_window:
            self._logged[kind] = logged + 1
            return True
        held = self._held.setdefault(kind, [0, level])
        held[0] += 1
        held[1] = max(held[1], level)
        return False

    def due(self, now: float) -> list[Suppressed]:
        """If the open window has ended by `now`: the kinds it held lines of (then a new window
        opens with the next line); else nothing."""
        end = self.window_end
        if end is None or now < end:
            return []
        told = [Suppressed(kind, lines, level, self.window_s)
                for kind, (lines, level) in self._held.items()]
        self._start = None
        self._logged.clear()
        self._held.clear()
        return told

    @property
    def holding(self) -> bool:
        """Whether the open window has held back any line (a summary is owed at its end)."""
        return bool(self._held)
