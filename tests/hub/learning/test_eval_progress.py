"""An evaluation says how far it has got (issue 45: SmolLM2's 200-problem base evaluation ran for
3-11 minutes with nothing on screen and every dashboard tile at "–"): it runs in pieces, counted
in `EvalProgress` after each, drawn as a bar on a terminal (a real pseudo-terminal here), and a
real hub's /status answers the count while its event loop goes on serving during the evaluation.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import threading

import aiohttp

from echo2p2p.hub.learning.held_out import PIECE_PROBLEMS, EvalProgress, evaluate_in_pieces
from echo2p2p.hub.run.start import start_hub

from tests.conftest import Pulse


def read_all(fd: int) -> str:
    """What was written to the pseudo-terminal whose controlling side is `fd`, so far."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except (BlockingIOError, OSError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_pieces_count_the_problems_done_and_give_the_mean_of_them_all():
    """70 problems in pieces of 32: each piece sees only its own, the count after each is what
    was evaluated, and the mean is over all 70 (rewards of thirds: no float drift from turning
    each piece's mean back into a sum). On a terminal a bar counts them; nothing is drawn when
    stderr is not one."""
    rewards = [(i % 3) / 3 for i in range(70)]
    progress, seen = EvalProgress(4, len(rewards)), []

    def evaluate(part: list[float]) -> float:
        seen.append((progress.done, len(part)))
        return sum(part) / len(part)

    controller, terminal = pty.openpty()
    with os.fdopen(terminal, "w") as stderr:
        mean = evaluate_in_pieces(evaluate, rewards, progress, stream=stderr)
        drawn = read_all(controller)  # before its other side closes: Linux drops it then
    os.close(controller)
    assert seen == [(0, 32), (32, 32), (64, 6)]
    assert progress.as_dict() == {"version": 4, "done": 70, "total": 70}
    assert mean == sum(rewards) / 70
    assert "evaluating v4" in drawn and "32/70" in drawn and "64/70" in drawn, drawn
    assert PIECE_PROBLEMS == 32


def test_no_terminal_no_bar(capfd):
    evaluate_in_pieces(lambda part: 1.0, list(range(40)), EvalProgress(0, 40))
    assert capfd.readouterr().err == ""


async def test_a_real_hubs_status_shows_its_evaluation_under_way(hub_cfg):
    """The tiny model's real evaluation of 70 problems, held after its first piece: the hub's
    /status, answered meanwhile (its event loop is not blocked by the evaluation), says
    version 0, 32 of 70; once it ends, none; the accuracy is a mean reward."""
    cfg = hub_cfg.replace(dashboard_port=0, eval_problems=70)
    loop, pulse, release = asyncio.get_running_loop(), Pulse(), threading.Event()
    async with start_hub(cfg, stream=None) as run:
        real, calls = run.learner.evaluate, []

        def held(*args, **kwargs):  # the learner's own evaluation, the second piece held
            calls.append(len(args[1]))
            loop.call_soon_threadsafe(pulse.fire)
            if len(calls) == 2:
                release.wait(60)
            return real(*args, **kwargs)

        run.learner.evaluate = held
        evaluation = asyncio.ensure_future(run.evaluate())
        try:
            await pulse.until(lambda: len(calls) == 2)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{run.dashboard_port}/status") as answer:
                    during = json.loads(await answer.text())
        finally:
            release.set()
        accuracy = await asyncio.wait_for(evaluation, 120)
        after = run.evaluating
    assert during["evaluating"] == {"version": 0, "done": 32, "total": 70}
    assert calls == [32, 32, 6] and after is None
    assert 0.0 <= accuracy <= 1.0
