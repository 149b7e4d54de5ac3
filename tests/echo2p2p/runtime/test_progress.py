"""Progress bars of the long waits, on a real pseudo-terminal and a real pipe: the bar with its
rate and time left where a person watches, nothing in a log; and each site that draws one (a
peer's first version, a checkpoint write, the model files from the hub) draws it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
import threading
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from echo2p2p import signing
from echo2p2p.hub.learning.durable import Checkpoints
from echo2p2p.overlay.download import Download
from echo2p2p.overlay.store import ChunkStore
from echo2p2p.runtime.progress import LARGE_BYTES, progress_bar

from tests.blob_versions import blob_version
from tests.conftest import serving
from tests.peer.test_model_from_hub import FILES, INDEX, fetch, model_server, welcome


class Terminal:
    """A pseudo-terminal of 24 rows by 120 columns: programs write to `stream`, `text` is
    what it has shown."""

    def __init__(self):
        self._screen, side = pty.openpty()
        fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        self.stream = os.fdopen(side, "w")
        self._got = b""

    def text(self, until: str = "", timeout_s: float = 10.0) -> str:
        """What it has shown so far; with `until`, once that has appeared (within timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.stream.flush()
            shown = self._got.decode(errors="replace")
            wait_s = max(0.0, deadline - time.monotonic()) if until not in shown else 0.0
            if not select.select([self._screen], [], [], wait_s)[0]:
                assert until in shown, f"{until!r} not shown in {timeout_s} s: {shown!r}"
                return shown
            self._got += os.read(self._screen, 1 << 16)


def pipe():
    """(a stream writing into a pipe, a function reading all it got once the stream closes)."""
    out, into = os.pipe()
    stream = os.fdopen(into, "w")

    def read() -> bytes:
        stream.close()
        with os.fdopen(out, "rb") as got:
            return got.read()

    return stream, read


def test_a_bar_shows_bytes_rate_and_time_left_on_a_terminal():
    """On a terminal the bar shows the bytes done of the total, the elapsed and remaining
    time and the rate in bytes per second."""
    term = Terminal()
    with progress_bar(1 << 20, "v7", show=True, stream=term.stream) as bar:
        bar.update(1 << 19)
        bar.refresh()
        shown = term.text()
    assert re.search(r"v7: +50%\|.*\| 524k/1\.05M \[\d\d:\d\d<\d\d:\d\d, +[\d.]+[kMGT]?B/s\]",
                     shown), shown


def test_nothing_is_printed_into_a_pipe():
    """Into a pipe (a log file, a supervisor) even a bar asked for prints nothing."""
    stream, read = pipe()
    with progress_bar(LARGE_BYTES, "v7", show=True, stream=stream) as bar:
        bar.update(LARGE_BYTES)
        bar.refresh()
    assert read() == b""


def test_only_large_or_long_waits_get_a_bar_unless_asked():
    """By default a bar is drawn at once for LARGE_BYTES or more; a smaller one stays quiet
    unless the caller asks for it, and one of unknown size that ends at once is never drawn
    (the checkpoint test below sees it drawn once it has lasted)."""
    term = Terminal()
    for total, name in ((LARGE_BYTES - 1, "small"), (LARGE_BYTES, "large"), (None, "unknown"),
                        (LARGE_BYTES - 1, "asked")):
        with progress_bar(total, name, show=True if name == "asked" else None,
                          stream=term.stream):
            pass
    shown = term.text()
    assert "large:" in shown and "asked:" in shown
    assert "small" not in shown and "unknown" not in shown


async def test_a_peers_first_version_shows_a_bar_and_a_small_later_one_does_not(monkeypatch):
    """A download of a small version draws a bar on the terminal only as the peer's first."""
    key = signing.new_private_key()
    version = blob_version(key, 0, os.urandom(64 << 10), chunk_bytes=16 << 10)

    async def chunk(request: web.Request) -> web.Response:
        return web.Response(body=version.full.chunks[int(request.match_info["index"])])

    app = web.Application()
    app.router.add_get("/chunk/{version}/{base}/{index}", chunk)
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term.stream)
    shown = []
    async with serving(app) as port, aiohttp.ClientSession() as http:
        for first in (False, True):
            store = ChunkStore()
            held = store.begin(version.full.manifest)
            await Download(store, held, http=http, hub_base_url=f"http://127.0.0.1:{port}",
                           me="p1", report=None, first=first).run()
            assert not held.assembler.missing
            shown.append(term.text())
    assert shown[0] == "" and re.search(r"v0: .*B/s", shown[1]), shown


def test_a_checkpoint_write_shows_the_bytes_as_torch_writes_them(tmp_path, monkeypatch):
    """While the learner's files are written the bar shows their bytes (the first, of unknown
    size, once it has lasted; then against the previous checkpoint's size); into a pipe
    nothing is shown and nothing polls."""
    checkpoints = Checkpoints(tmp_path)
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term.stream)

    def save(size: int, until: str):
        def write(where: Path) -> None:
            where.mkdir()
            with open(where / "weights", "wb") as f:
                f.truncate(size)  # sparse: the bytes a bar counts, without the disk's time
            term.text(until=until)  # the bar counted the file while the write was under way
        return write

    checkpoints.write(0, save(80_000_000, "checkpoint 0: 80.0MB"), {"step": 0})
    checkpoints.write(1, save(40_000_000, "checkpoint 1:  50%"), {"step": 1})
    assert re.search(r"checkpoint 1: +50%\|.*\| 40\.0M/80\.0M \[.*B/s\]", term.text())
    stream, read = pipe()
    monkeypatch.setattr(sys, "stderr", stream)

    def quiet(where: Path) -> None:
        where.mkdir()
        assert "checkpoint-progress" not in {t.name for t in threading.enumerate()}

    checkpoints.write(2, quiet, {"step": 2})
    assert read() == b"" and checkpoints.latest() == 2


async def test_the_model_files_from_the_hub_show_a_bar(tmp_path, monkeypatch):
    """A peer fetching the model's files draws a bar of their bytes on a terminal, and
    prints nothing into a pipe."""
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term.stream)
    async with model_server(INDEX, FILES) as (base, _):
        await fetch(base, welcome(INDEX), tmp_path / "cache")
        assert re.search(r"model files: .*B/s", term.text())
        stream, read = pipe()
        monkeypatch.setattr(sys, "stderr", stream)
        await fetch(base, welcome(INDEX), tmp_path / "other-cache")
        assert read() == b""
