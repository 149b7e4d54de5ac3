"""Progress bars for the long waits, in one style: a version's download, a checkpoint write, the
model's files fetched from the hub (`progress_bar`, in bytes), a held-out evaluation and a GGUF
file's conversion (`count_bar`, in problems or tensors).

A bar counts bytes (kB, MB, GB), or things, with the rate and the time left, on stderr, and is
drawn only when stderr is a terminal: in a log file or under a supervisor it prints nothing. It
redraws at most twice a second and leaves no line behind when closed (the log says what
finished). A wait of unknown size may be a short one: its bar appears only once it has lasted
UNKNOWN_WAIT_S. Knows nothing of what is being counted: the caller updates it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

LARGE_BYTES = 64 << 20  # a wait this big or bigger gets a bar; the built-in model's stay quiet
REDRAW_S = 0.5
UNKNOWN_WAIT_S = 2.0


def progress_bar(total: int | None, desc: str, *, show: bool | None = None,
                 stream: TextIO | None = None) -> tqdm:
    """A bar of `total` bytes (None: unknown, no time left shown) on `stream` (stderr).
    `show`: True, or None for "when `total` is unknown or at least LARGE_BYTES"; either way it
    is drawn only on a terminal. Use it as a context manager, or close it."""
    if show is None:
        show = total is None or total >= LARGE_BYTES
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, mininterval=REDRAW_S,
                delay=UNKNOWN_WAIT_S if total is None else 0.0, leave=False,
                file=stream or sys.stderr,
                disable=None if show else True)  # None: tqdm turns it off unless a terminal


def count_bar(total: int | None, desc: str, unit: str, *, iterable: Iterable[Any] | None = None,
              stream: TextIO | None = None) -> tqdm:
    """A bar of `total` things of `unit` ("problem", "tensor") on `stream` (stderr), drawn only
    on a terminal; over `iterable` if given (its length is the total when `total` is None).
    Use it as a context manager, or close it (or exhaust `iterable`)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, mininterval=REDRAW_S, leave=False,
                file=stream or sys.stderr, disable=None)  # None: off unless a terminal
