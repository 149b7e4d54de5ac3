"""A hub that stopped, as the peer's log says it: the first failed round, then once that the
hub may have stopped, and nothing more while it stays away (a peer logged two lines a second
after its hub stopped, issue 45); a hub that serves again starts the count afresh."""

from __future__ import annotations

import logging

from echo2p2p.failover import HUB, Failover
from echo2p2p.overlay.download import log_hub_fault


def fail_rounds(f: Failover, rounds: int, t: float) -> float:
    """`rounds` rounds of every hub request failing, each logged as the shells do; the time
    after them."""
    for _ in range(rounds):
        for i, source in f.requests(t, window=4):
            f.finished(i, source, "unreachable", t)
            log_hub_fault(f.hub, i, 7, "unreachable")
        t = f.hub.retry_at
    return t


def test_a_stopped_hub_is_said_once_to_be_gone(caplog):
    f = Failover(4, "me", hub_retry_s=1.0)
    with caplog.at_level(logging.WARNING, logger="echo2p2p.overlay.download"):
        t = fail_rounds(f, 12, 0.0)  # 48 failed requests, 190 s of a hub gone
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "did not serve chunk 0 of v7 (unreachable); retrying" in lines[0]
    assert "it may have stopped" in lines[1] and "up to 30 s" in lines[1]
    caplog.clear()
    (i, source), *rest = f.requests(t, window=4)
    assert source == HUB
    f.finished(i, source, None, t)  # back
    with caplog.at_level(logging.WARNING, logger="echo2p2p.overlay.download"):
        for j, source in rest:
            f.finished(j, source, "unreachable", t + 1)
            log_hub_fault(f.hub, j, 7, "unreachable")
    assert len(caplog.records) == 1 and "retrying" in caplog.records[0].getMessage()
