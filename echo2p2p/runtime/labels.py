"""Text from the other side as a Prometheus label value, for the hub's and the peers' /metrics:
at most LABEL_CHARS characters of [A-Za-z0-9._-], any other character '_', so a name can
neither break the exposition format nor grow a series' label without bound."""

from __future__ import annotations

import re

LABEL_CHARS = 32  # the longest label value made from text the other side sent
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def label_text(text: str, limit: int = LABEL_CHARS) -> str:
    """`text` cut to `limit` characters of [A-Za-z0-9._-] ('_' for any other)."""
    return _UNSAFE.sub("_", text[:limit])
