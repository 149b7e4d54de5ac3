"""Hub restart without loss: checkpoints and the journal between them.

A checkpoint is the learner (weights, optimizer: a `torch.distributed.checkpoint` directory,
sharded when the learner is, loadable on any rank count; multi-node runs keep run_dir on a
filesystem every node sees) and the hub's state as plain data (the step,
the run's one step counter; lease table and data cursor; admitted-but-untrained groups, their
rows as validated at admission; trust), written under
`<run_dir>/checkpoints/ckpt-NNNNNN/` and made current by atomically replacing the `LATEST`
pointer file, so a kill at any moment leaves the previous checkpoint whole. The signing key
stays where it was made, `<run_dir>/hub_key`. Every change after a checkpoint (a peer id handed
out, a lease granted, dropped or re-queued, a group admitted) is appended to
`journal-NNNNNN.log` before the peer hears of it; a resumed hub loads the newest checkpoint and
replays every journal from its number on, in order. A record torn by the kill is the last one, and is skipped: nothing was answered
for it, so the peer that sent it sends it again.

Records are flushed to the OS, not fsynced (one fsync per admitted group would bound ingest by
the disk): a killed hub loses nothing; a machine that loses power may lose the newest records.
On a terminal a checkpoint write shows a progress bar of its bytes against the previous
checkpoint's (`echo2p2p.runtime.progress`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from echo2p2p.buffer import ScoredGroup
from echo2p2p.rows import SampleRow
from echo2p2p.runtime.progress import progress_bar

if TYPE_CHECKING:
    from tqdm import tqdm

LATEST = "LATEST"
POLL_S = 0.5  # how often a checkpoint's bar reads how much torch has written


class Journal:
    """An append-only file of msgpack records."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("ab")

    def write(self, record: list) -> None:
        self._file.write(msgpack.packb(record, use_bin_type=True))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_journal(path: Path) -> Iterator[list]:
    """The records of `path`, up to a torn last one."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(path.read_bytes())
    try:
        yield from unpacker
    except (msgpack.UnpackException, ValueError):
        return


def group_to_wire(g: ScoredGroup) -> list:
    """`g` as msgpack-able data; each row as the bytes it was validated from."""
    return [g.lease_id, g.problem_id, g.prompt_ids, g.version,
            [[r.packed_ids, r.packed_logprobs, r.finish_reason, r.text, r.packed_turns]
             for r in g.samples],
            g.rewards]


def group_from_wire(w: list) -> ScoredGroup:
    """The group `group_to_wire` wrote: its rows were validated when admitted, not again."""
    lease_id, problem_id, prompt_ids, version, samples, rewards = w
    return ScoredGroup(lease_id, problem_id, prompt_ids, version,
                       tuple(SampleRow(*s) for s in samples), rewards)


class Checkpoints:
    """The checkpoints and journals of one run directory."""

    def __init__(self, run_dir: Path):
        self.root = run_dir / "checkpoints"
        self.root.mkdir(parents=True, exist_ok=True)

    def latest(self) -> int | None:
        """The number of the current checkpoint, or None if there is none."""
        pointer = self.root / LATEST
        return int(pointer.read_text()) if pointer.exists() else None

    def latest_step(self) -> int | None:
        """The step (version) the current checkpoint holds; None if there is none or it cannot
        be read (what a resume would go back to, said before it loads)."""
        number = self.latest()
        if number is None:
            return None
        try:
            state = msgpack.unpackb((self.root / f"ckpt-{number:06d}" / "hub.msgpack").read_bytes(),
                                    raw=False, strict_map_key=False)
            return int(state["step"])
        except (OSError, ValueError, KeyError, TypeError, msgpack.UnpackException):
            return None

    def next_number(self) -> int:
        """A number after every checkpoint and journal here."""
        return max(self._numbered(), default=-1) + 1

    def _numbered(self) -> dict[int, list[Path]]:
        """Checkpoints, journals and unfinished checkpoints (`tmp-N`) by their number N."""
        found: dict[int, list[Path]] = {}
        for path in self.root.iterdir():
            _, _, number = path.stem.rpartition("-")
            if number.isdigit():
                found.setdefault(int(number), []).append(path)
        return found

    def journal(self, number: int) -> Journal:
        return Journal(self.root / f"journal-{number:06d}.log")

    def write(self, number: int, save_learner: Callable[[Path], None], hub: dict[str, Any]
              ) -> None:
        """Write checkpoint `number` (`save_learner` writes the learner's directory, with every
        rank of a sharded one; hub: msgpack-able), make it the current one, and delete what it
        supersedes."""
        final = self.root / f"ckpt-{number:06d}"
        tmp = self.root / f"tmp-{number:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        latest = self.latest()  # checkpoints of one run are all about the same size
        previous = _bytes_under(self.root / f"ckpt-{latest:06d}") if latest is not None else None
        with progress_bar(previous, f"checkpoint {number}") as bar:
            _watched(lambda: save_learner(tmp / "learner"), tmp, bar)
            (tmp / "hub.msgpack").write_bytes(msgpack.packb(hub, use_bin_type=True))
            for f in tmp.rglob("*"):  # the learner's directory and every file in it too
                _fsync(f)
        tmp.rename(final)
        pointer = self.root / f"{LATEST}.tmp"
        pointer.write_text(str(number))
        _fsync(pointer)
        os.replace(pointer, self.root / LATEST)
        _fsync(self.root)
        for older, paths in self._numbered().items():
            for old in paths if older < number else ():
                shutil.rmtree(old) if old.is_dir() else old.unlink()

    def load(self) -> tuple[Path, dict[str, Any], list[list]]:
        """(the learner's directory, hub state, journal records after it) of the current
        checkpoint."""
        number = self.latest()
        if number is None:
            raise FileNotFoundError(f"no checkpoint in {self.root}")
        where = self.root / f"ckpt-{number:06d}"
        learner = where / "learner"
        hub = msgpack.unpackb((where / "hub.msgpack").read_bytes(), raw=False,
                              strict_map_key=False)
        numbered = self._numbered()
        journals = [p for n in sorted(numbered) if n >= number
                    for p in numbered[n] if p.name.startswith("journal-")]
        return learner, hub, [r for j in journals for r in read_journal(j)]


def _watched(save: Callable[[], None], where: Path, bar: tqdm) -> None:
    """`save()`, while the tqdm `bar` shows the bytes under `where`: torch writes the files, so
    a thread of ours reads their sizes every POLL_S (no thread when the bar is off)."""
    if bar.disable:
        save()
        return
    done = threading.Event()

    def poll() -> None:
        while not done.wait(POLL_S):
            bar.update(_bytes_under(where) - bar.n)

    watcher = threading.Thread(target=poll, name="checkpoint-progress", daemon=True)
    watcher.start()
    try:
        save()
    finally:
        done.set()
        watcher.join()
    bar.update(_bytes_under(where) - bar.n)


def _bytes_under(path: Path) -> int:
    """Bytes of the files under `path` now (one renamed away meanwhile is not counted)."""
    total = 0
    for f in path.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            total += f.stat().st_size if f.is_file() else 0
    return total


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
