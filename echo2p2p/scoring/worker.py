"""The scoring worker: a child process that runs a reward function over batches of completions.

Started by `echo2p2p.scoring.scorer.Scorer` (spawn, never fork: the parent holds torch and threads).
It is handed the reward function, and for the hub a `CompletionDecoder`, pickled once at
start; then it reads batches `(cut_s, items)` from its pipe and answers each with the list of
`(reward, note, detail)` of the items it scored and the seconds each took: all of them, or
those up to the first that ends past `cut_s` into the batch (the parent queues the rest again,
so one slow item holds up no more of them). Before each completion it stamps its index and
start time into a shared array, so the parent can see which one overran its deadline and kill
the process: a verifier stuck in C code (math-verify on `\\boxed{9^{9^{9^{9}}}}` runs for
ever) cannot be interrupted any other way. It never sees a socket or the parent's event loop,
and it dies with the thread that spawned it, so with the hub or peer (Linux: the kernel's
parent-death signal; elsewhere at its next read).

`WorkerProcess` is the parent's side of one such child: spawn it, wait until it is ready, kill
it. Items are `(key, text)`, scored as they are (`reward(key, text)`; the key is what the caller
scores against: an answer, or the hub's `Problem`), or `(key, packed_ids, claimed_text)`: the
ids are decoded by the completion rule (`echo2p2p.completions`), that text is scored (with the
ids, `reward(key, text, ids)`, for a reward whose `takes_ids` is set: a text's own are its
encoding, when the worker has a decoder), and the note says whether the claim was the decoding;
or `(key, packed_ids, claimed_text, packed_turns)`,
an episode, replayed by `reward.replay` (`echo2p2p.episodes`).
"""

from __future__ import annotations

import math
import pickle
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from echo2p2p.errors import ScoringError
from .code import ForgedPass

if TYPE_CHECKING:
    import asyncio
    import ctypes
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnContext

    from echo2p2p.completions import CompletionDecoder
    from .rewards import Key, Reward

# What the parent learns of each completion besides its reward (always 0.0 unless OK/MISMATCH).
OK = 0  # scored
MISMATCH = 1  # scored from the decoded ids; the claimed text was something else
MALFORMED = 2  # the ids are no completion (out of vocabulary, after EOS, empty)
FAILED = 3  # the reward function raised or returned a non-finite value
TIMEOUT = 4  # set by the parent: ran past the deadline, the worker was killed
REPLAYED = 5  # an episode its environment's replay does not reproduce (the detail says how)
FORGED = 6  # a program that tried to forge its tests' verdict (`echo2p2p.scoring.code`)

READY = "ready"
START_TIMEOUT_S = 120.0  # a worker that has not loaded its reward function by then is broken


def serve(conn: Connection, progress: ctypes.Array[ctypes.c_double], reward_blob: bytes,
          decoder_blob: bytes | None) -> None:
    """The worker's main: load, say READY, then score batches until EOF or None."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    reward = pickle.loads(reward_blob)
    decoder = pickle.loads(decoder_blob) if decoder_blob is not None else None
    conn.send(READY)
    started = 0
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        cut_s, items = batch
        out, seconds = [], []
        began = time.monotonic()
        for item in items:
            start = progress[1] = time.monotonic()  # first: the parent reads the index first
            progress[0] = started
            started += 1
            out.append(score_item(reward, decoder, item))
            end = time.monotonic()
            seconds.append(end - start)
            if end - began > cut_s:  # the rest goes back to be queued again
                break
        conn.send((out, seconds))


def score_item(reward: Reward, decoder: CompletionDecoder | None, item: tuple
               ) -> tuple[float, int, str]:
    """`(reward, note, detail)` of one item (see the module docstring); `detail` says why a
    FAILED, REPLAYED or FORGED item scored 0 ('' otherwise)."""
    key, *rest = item
    if len(rest) == 3:  # an episode: its environment replayed on its model turns
        return _replay(reward, decoder, key, *rest)
    note, ids, takes_ids = OK, None, getattr(reward, "takes_ids", False)
    if len(rest) == 2:
        decoded = decoder.from_wire(rest[0]) if decoder is not None else None
        if decoded is None:
            return 0.0, MALFORMED, ""
        text, ids = decoded.text, decoded.token_ids
        note = OK if rest[1] == text else MISMATCH
    else:
        text = rest[0]
        if takes_ids and decoder is not None:
            ids = decoder.encode(text)  # a text scored as it is (held-out evaluation): its ids
    try:
        value = float(reward(key, text, ids) if takes_ids else reward(key, text))
    except ForgedPass as exc:  # scores 0, and the hub holds it against the peer
        return 0.0, FORGED, _why(exc)
    except Exception as exc:  # a reward must not raise; if it does, this sample scores 0
        return 0.0, FAILED, _why(exc)
    return (value, note, "") if math.isfinite(value) else (0.0, FAILED, f"returned {value}")


def _replay(reward: Reward, decoder: CompletionDecoder | None, key: Key, packed_ids: bytes,
            claimed: str, packed_turns: bytes) -> tuple[float, int, str]:
    """An episode's reward by replaying its environment (`reward.replay`, see
    `echo2p2p.scoring.rewards.EpisodeReplay`); REPLAYED with the fault if it does not check out."""
    try:
        replayed = reward.replay(key, packed_ids, packed_turns, decoder)
    except Exception as exc:  # the environment raised on these actions: scores 0, counted
        return 0.0, FAILED, _why(exc)
    if replayed.fault:
        return 0.0, REPLAYED, replayed.fault
    return replayed.reward, OK, ""


def _why(exc: BaseException) -> str:
    """A short reason for the log: the exception's type and message, cut."""
    return f"{type(exc).__name__}: {exc}"[:200]


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when our parent goes (Linux), even mid-verifier."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import multiprocessing
    import os

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):  # no prctl (an unusual libc): EOF on the pipe still ends us
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it went before we asked
        os._exit(1)


class WorkerProcess:
    """The parent's handle on one child: its pipe, its progress stamp and the batch it is
    scoring (the `Scorer`'s bookkeeping, kept here so the handle is one object)."""

    def __init__(self, ctx: SpawnContext, reward_blob: bytes, decoder_blob: bytes | None,
                 name: str):
        """Spawns the process and waits until it is ready: run in the Scorer's spawner thread."""
        self.conn, child = ctx.Pipe()
        self.progress = ctx.RawArray("d", [-1.0, 0.0])  # [index started, its monotonic start]
        self.process = ctx.Process(target=serve, name=name, daemon=True,
                                   args=(child, self.progress, reward_blob, decoder_blob))
        self.process.start()
        child.close()
        self.started = 0  # completions this worker has begun, as of the batch now sent
        self.sent_at = 0.0  # when that batch was sent (time.monotonic, as the stamps)
        self.listening = False  # the loop watches its pipe for the answer
        self.batch: list[tuple[Any, int]] | None = None  # (the Scorer's job, item index)
        self.timer: asyncio.TimerHandle | None = None  # the loop's, for this batch's deadline
        try:
            ready = self.conn.poll(START_TIMEOUT_S) and self.conn.recv() == READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise ScoringError(f"the scoring worker did not start (exit code "
                               f"{self.process.exitcode}); see its traceback above")

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """Stop the process now (idle or deep in a verifier) and reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10.0)
        self.conn.close()
