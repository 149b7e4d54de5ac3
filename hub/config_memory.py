"""The memory section of the hub's configuration: the budget the hub fits itself into at start,
and the time-based checkpoint cadence that makes a kill (the kernel's OOM killer's included)
cost minutes of training, not the run.

A section of its own (not in `hub.config_sections`, which is at its size limit); it is one of
`echo2p2p.hub.config.HubConfig`'s like the others: flat names outside, `--help` from the field
docstrings, checks in `__post_init__` naming the field and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from echo2p2p.errors import ConfigError

UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
         "t": 1e12, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def size_bytes(name: str, text: str) -> int:
    """Bytes of a size written "16GB", "12.5GiB", "800MB" or "16000000000" (decimal units for
    GB/MB, binary for GiB/MiB, as `free -h` and cloud specs use them); ConfigError on `name`
    naming the form otherwise."""
    match = SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ConfigError(name, f"a size such as 16GB, 12.5GiB or 800MB, got {text!r}")
    return int(float(match.group(1)) * UNITS[unit])


@dataclass(frozen=True)
class MemoryConfig:
    """Memory: the budget the hub fits into, and how much training a kill may lose."""

    max_memory: str = ""
    """RAM the hub may use on this machine, with the demo's local peers: 16GB, 12.5GiB ('' =
    the memory available when the hub starts). At start the hub predicts its peak (the learner,
    the spot-checker's copy, publication, scoring workers, allocator slack; the demo's peers by
    engine), lowers learner_micro_tokens until it fits, and refuses to start, naming what to
    change, if it still does not ('' only warns: a shared machine's available memory is a
    snapshot). `--print-config` shows the fitted values."""
    checkpoint_every_s: float = 180.0
    """Also checkpoint at the first publication after this many seconds of training since the
    last checkpoint, however many versions that was (0 = by checkpoint_every only). A kill then
    loses at most about this much training; each checkpoint writes about 12 bytes a parameter."""

    def __post_init__(self) -> None:
        self.max_memory_bytes  # noqa: B018 - validates max_memory
        if not 0 <= self.checkpoint_every_s < float("inf"):
            raise ConfigError("checkpoint_every_s", f"must be >= 0 and finite (0 = by version "
                                                    f"only), got {self.checkpoint_every_s}")

    @property
    def max_memory_bytes(self) -> int | None:
        """The budget in bytes; None: the machine's available memory at start."""
        if not self.max_memory.strip():
            return None
        budget = size_bytes("max_memory", self.max_memory)
        if budget <= 0:
            raise ConfigError("max_memory", f"must be above 0 ('' = the memory available at "
                                            f"start), got {self.max_memory!r}")
        return budget
