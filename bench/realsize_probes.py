"""bench/realsize.py's instruments: probes around the hub's own methods, an RSS sampler, the
publish path's per-core rates, and a markdown table.

`Probes.installed()` wraps (on the classes, before the hub is built, so bound methods in the
hub's dispatch tables are the wrapped ones) the learner's step and export, the publisher's
build, the tracker's announcement, chunk lookups and transfers, and the hub's VersionHeld
handler (each peer's reload ends there). Times are `time.perf_counter()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import mmap
import threading
import time
from pathlib import Path
from typing import Any

from echo2p2p.tasks import AdditionTask


class CoinTask(AdditionTask):
    """The addition prompts, scored by a coin: bit 0 of blake2b of the completion's text.
    Random weights never solve a task, and GRPO learns nothing from a group that all scores 0
    (the learner skips the update): with this verifier groups mix and every step trains."""

    def reward(self, answer: str, completion: str) -> float:
        return float(hashlib.blake2b(completion.encode()).digest()[0] & 1)


def padded_char_tokenizer(size: int) -> Any:
    """The built-in character tokenizer with filler tokens up to `size` ids, so that a random
    model's samples (any id below the embedding's size) are all tokens the hub accepts; the
    fillers are multi-character strings, which encoding (no merges) never produces."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from echo2p2p.policy.model import CHARACTERS, SPECIAL_TOKENS

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    vocab.update({f"<x{i}>": i for i in range(len(vocab), size)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


class Probes:
    """What happened when, per version and peer, in the run under way."""

    def __init__(self) -> None:
        self.run: Any = None
        self.step_end: list[float] = []  # learner step k ended -> version k + 1 (kappa = 1)
        self.exports: list[tuple[float, float]] = []  # per version, in order (v0 first)
        self.builds: dict[int, tuple[float, float, dict]] = {}
        self.announce: dict[int, float] = {}
        self.first_lookup: dict[int, float] = {}
        self.last_served: dict[int, float] = {}
        self.transfer: dict[tuple[str, int], float] = {}
        self.held: dict[tuple[str, int], float] = {}
        self._pulse: asyncio.Event | None = None

    @contextlib.contextmanager
    def installed(self):
        from echo2p2p.hub.learning.learner import Learner
        from echo2p2p.hub.overlay.publisher import Publisher
        from echo2p2p.hub.core.tracker import VersionTracker
        from echo2p2p.hub.serving.overlay_shell import OverlayShell

        now = time.perf_counter
        saved = [(Learner, "step"), (Learner, "iter_weights"), (Publisher, "build"),
                 (VersionTracker, "publish"), (OverlayShell, "chunk_lookup"),
                 (VersionTracker, "chunk_served"), (VersionTracker, "transfer_reported"),
                 (VersionTracker, "holding_reported")]
        originals = {(c, n): getattr(c, n) for c, n in saved}
        orig = lambda c, n: originals[(c, n)]  # noqa: E731

        def step(learner, batch):
            out = orig(Learner, "step")(learner, batch)
            self.step_end.append(now())
            return out

        def export(learner, *a, **k):  # the stream is written as the tensors come
            start = now()
            yield from orig(Learner, "iter_weights")(learner, *a, **k)
            self.exports.append((start, now()))

        def build(pub, version, weights):
            start = now()
            out = orig(Publisher, "build")(pub, version, weights)
            self.builds[version] = (start, now(), dict(pub.timings))
            return out

        def publish(tracker, version, at):
            self.announce[version.version] = now()
            return orig(VersionTracker, "publish")(tracker, version, at)

        async def lookup(shell, version, base, index, wait_s):
            self.first_lookup.setdefault(version, now())
            return await orig(OverlayShell, "chunk_lookup")(shell, version, base, index, wait_s)

        def served(tracker, version, nbytes, at):
            self.last_served[version] = now()
            return orig(VersionTracker, "chunk_served")(tracker, version, nbytes, at)

        def transferred(tracker, conn, msg, at):
            self.transfer.setdefault((conn.peer_id, msg.version), now())
            return orig(VersionTracker, "transfer_reported")(tracker, conn, msg, at)

        def holding(tracker, conn, version, at):  # a hold the hub believed (its transfer seen)
            self._held(conn.peer_id, version)
            return orig(VersionTracker, "holding_reported")(tracker, conn, version, at)

        new = [step, export, build, publish, lookup, served, transferred, holding]
        for (cls, name), fn in zip(saved, new):
            setattr(cls, name, functools.wraps(originals[(cls, name)])(fn))
        try:
            yield self
        finally:
            for (cls, name), fn in originals.items():
                setattr(cls, name, fn)

    def _held(self, peer_id: str, version: int) -> None:
        key = (peer_id, version)
        if key in self.held:
            return
        self.held[key] = time.perf_counter()
        if self._pulse is not None:
            self._pulse.set()

    async def all_hold(self, version: int, n: int) -> None:
        """Return once `n` peers have reported holding `version` (or a newer one)."""
        while len({p for p, v in self.held if v >= version}) < n:
            self._pulse = asyncio.Event()
            await self._pulse.wait()

    def versions(self, metrics: Path) -> list[dict]:
        """One row per version published after a learner step."""
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        props = {r["version"]: r for r in records if r.get("event") == "propagation"}
        rows = []
        for k, end in enumerate(self.step_end):
            v = k + 1
            if v not in self.builds:
                continue
            start, done, timings = self.builds[v]
            rel = lambda t: None if t is None else round(t - end, 2)  # noqa: E731
            peers = sorted({p for p, _ in self.transfer})
            reloads = [round(self.held[(p, v)] - self.transfer[(p, v)], 2) for p in peers
                       if (p, v) in self.held and (p, v) in self.transfer]
            t90 = props.get(v, {}).get("t_bcast_s")  # the hub's own: announced -> 90 % serving
            rows.append({
                "version": v, "kind": "delta" if props.get(v, {}).get("peers_on_delta") else "full",
                "export_s": rel(self.exports[v][1]) if v < len(self.exports) else None,
                "stream_s": rel(start + timings["stream_s"]), "coded_s": rel(done),
                "full_code_s": round(timings["full_s"], 2), "delta_code_s": round(timings["delta_s"], 2),
                "announce_s": rel(self.announce.get(v)),
                "first_chunk_s": rel(self.first_lookup.get(v)),
                "last_chunk_s": rel(self.last_served.get(v)), "reload_s": reloads,
                "transfer_t90_s": props.get(v, {}).get("t90_s"), "t_bcast_s": t90,
                "serving_s": None if t90 is None else round(self.announce[v] + t90 - end, 2),
                "full_wire_bytes": props.get(v, {}).get("full_wire_bytes"),
                "delta_wire_bytes": props.get(v, {}).get("delta_wire_bytes")})
        return rows


class RssSampler:
    """Peak RssAnon and RssFile of this process and of watched ones, every `every_s`."""

    def __init__(self, every_s: float = 0.2) -> None:
        self.every_s = every_s
        self.pids: dict[str, int] = {"hub": 0}  # 0: this process
        self.peaks: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def now(self, name: str) -> int:
        """RssAnon of watched process `name` now, in bytes."""
        got = _rss(self.pids[name])
        return got[0] if got else 0

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            for name, pid in list(self.pids.items()):
                got = _rss(pid)
                if got is not None:
                    old = self.peaks.get(name, (0, 0))
                    self.peaks[name] = (max(old[0], got[0]), max(old[1], got[1]))


def _rss(pid: int) -> tuple[int, int] | None:
    """(RssAnon, RssFile) of `pid` (0: this process) in bytes, None once it is gone."""
    try:
        text = Path(f"/proc/{pid or 'self'}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return tuple(int(fields[k].split()[0]) << 10 for k in ("RssAnon", "RssFile"))
    except (KeyError, ValueError):
        return None


def per_core_rates(run: Any, versions_dir: Path, sample_bytes: int = 256 << 20) -> dict[str, float]:
    """MB/s of each publish stage on one thread, on the run's own weights: the bf16 cast (the
    learner's export, bytes out), full coding (zstd + blake2b), delta coding against the previous
    version, the stream hash; the signature in ms; the wire/raw ratios of the last version."""
    import torch

    from echo2p2p import signing
    from echo2p2p import snapshot as snap

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        exported = run.learner.export_weights(torch.bfloat16)
        cast_s = time.perf_counter() - start
        cast_bytes = sum(t.nbytes for t in exported.values())
        del exported
    finally:
        torch.set_num_threads(threads)
    streams = sorted(versions_dir.glob("v*.stream"), key=lambda p: int(p.name[1:].split(".")[0]))
    cur = _map(streams[-1])
    n = min(len(cur), sample_bytes) // 2 * 2
    # The previous version's stream, or (one stream kept: no spot-checks) the base weights'.
    base = _map(streams[-2]) if len(streams) > 1 else _base_stream(run, n)
    piece = [("w", "bfloat16", [n // 2], cur[:n])]
    chunk = run.cfg.overlay.chunk_bytes or snap.auto_chunk_bytes(len(cur))
    timed = {}
    for name, fn in (("full", lambda: snap.build_snapshot(1, piece, chunk_bytes=chunk)),
                     ("delta", lambda: snap.build_snapshot(1, piece, chunk_bytes=chunk,
                                                           base=(0, base[:n]))),
                     ("hash", lambda: snap.chunk_digest(cur[:n]))):
        start = time.perf_counter()
        fn()
        timed[name] = time.perf_counter() - start
    start = time.perf_counter()
    full = run.hub.core.tracker.snapshot()  # the newest version in full, and as a delta from the one before
    signing.sign_manifest(run.signing_key, full.manifest)
    sign_s = time.perf_counter() - start
    published = run.hub.statistics().published
    delta = run.hub.core.tracker.snapshot(published[-1], published[-2]) if len(published) > 1 else None
    total = full.manifest.total_bytes
    mb = lambda b, s: round(b / s / 1e6, 1)  # noqa: E731
    return {"bf16 cast (export), MB/s": mb(cast_bytes, cast_s),
            "full: zstd + blake2b, MB/s": mb(n, timed["full"]),
            "delta: coding + zstd + blake2b, MB/s": mb(n, timed["delta"]),
            "stream hash (blake2b), MB/s": mb(n, timed["hash"]),
            "sign manifest, ms": round(sign_s * 1e3, 2),
            "chunks per version (chunk KiB)": f"{len(full.chunks)} ({chunk >> 10})",
            "full wire / raw": round(full.wire_bytes / total, 3),
            "delta wire / raw": round(delta.wire_bytes / total, 3) if delta else None}


def _base_stream(run: Any, n: int) -> bytes:
    """The first `n` bytes of the stream of the model directory's weights (version 0)."""
    from safetensors import safe_open

    import torch

    out = bytearray()
    files = sorted(Path(run.cfg.run.model).glob("*.safetensors"))
    handles = [safe_open(str(f), framework="pt") for f in files]
    for t in run.hub.core.tracker.snapshot().manifest.tensors:
        if len(out) >= n:
            break
        handle = next(h for h in handles if t.name in h.keys())
        tensor = handle.get_tensor(t.name).to(torch.bfloat16).contiguous()
        out += tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return bytes(out[:n])


def _map(path: Path) -> memoryview:
    with path.open("rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table, columns aligned."""
    cells = [headers] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + "\n"
