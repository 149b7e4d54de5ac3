"""Published versions kept on disk, memory-mapped (hub.overlay.versions.VersionFiles): the
publisher builds the same bytes as in RAM, the spot-checker's retained versions read back bit for
bit from their files, and RAM no longer holds the S + 1 copies."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import torch

from echo2p2p import signing
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.overlay.publisher import Publisher
from echo2p2p.hub.learning.spotcheck import SpotChecker
from echo2p2p.hub.overlay.versions import VersionFiles

CFG = HubConfig.from_flat(max_lag=2, keep_versions=3, anchor_every=10, chunk_bytes=256 << 10)
KEY = signing.new_private_key()


def weights(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """A small state dict in bf16, as the learner exports it (one int buffer among the floats)."""
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64 * scale, 1024, generator=g).to(torch.bfloat16),
            "layer.weight": torch.randn(1000 * scale, 33, generator=g).to(torch.bfloat16),
            "layer.index": torch.arange(7, dtype=torch.int64)}


def file_backed(t: torch.Tensor, path: Path) -> bool:
    """Whether `t`'s memory lies in a mapping of the file at `path` (unlinked or not)."""
    ptr = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].removesuffix(" (deleted)") == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr and ptr + t.nbytes <= hi:
                return True
    return False


def rss_anon() -> int:
    """Bytes of anonymous memory this process holds (not file pages, which the kernel may drop),
    after glibc hands freed heap back (its dynamic mmap threshold keeps freed 1 MiB chunks)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no RssAnon in /proc/self/status")


def test_versions_on_disk_are_the_bytes_built_in_ram(tmp_path):
    files = VersionFiles(tmp_path, keep_streams=3, keep_chunks=3)
    on_disk, in_ram = Publisher(CFG.overlay, KEY, files=files), Publisher(CFG.overlay, KEY)
    for v in range(3):
        a, b = on_disk.build(v, weights(v)), in_ram.build(v, weights(v))
        assert a.full.manifest == b.full.manifest and a.full.signature == b.full.signature
        assert [bytes(c) for c in a.full.chunks] == [bytes(c) for c in b.full.chunks]
        assert (a.delta is None) == (b.delta is None) == (v == 0)
        if v:
            assert a.delta.manifest == b.delta.manifest
            assert [bytes(c) for c in a.delta.chunks] == [bytes(c) for c in b.delta.chunks]
            assert a.delta.manifest.base_version == v - 1
        assert all(isinstance(c, memoryview) for c in a.full.chunks)
        assert on_disk.timings["build_s"] >= on_disk.timings["full_s"] > 0


def test_spot_checker_reads_retained_versions_bit_identical_from_their_files(tmp_path):
    model = torch.nn.Linear(2, 2)
    spot = SpotChecker(model, CFG)
    files = VersionFiles(tmp_path, keep_streams=CFG.staleness.max_lag + 1, keep_chunks=CFG.overlay.keep_versions)
    pub = Publisher(CFG.overlay, KEY, spot, files)
    for v in range(5):
        pub.build(v, weights(v))
    kept = spot._versions
    assert sorted(kept) == [2, 3, 4]  # S + 1
    for v, state in kept.items():
        want = weights(v)
        assert list(state) == list(want)
        for name, t in state.items():
            assert t.dtype == want[name].dtype and t.shape == want[name].shape
            assert torch.equal(t, want[name]), (v, name)
            assert file_backed(t, files.path(v, "stream")), (v, name)
    # Past the window, files are unlinked: S + 1 streams, keep_versions chunk files.
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["v2-delta.chunks", "v2-full.chunks", "v2.stream", "v3-delta.chunks",
                     "v3-full.chunks", "v3.stream", "v4-delta.chunks", "v4-full.chunks", "v4.stream"]


def test_ram_does_not_hold_the_retained_copies(tmp_path):
    """Once a delta has been built, four more versions of 35 MB (bf16) each leave S + 1 = 3
    checkable and 3 versions' chunks served, yet the process's anonymous memory grows by less
    than half a version: in RAM they would add three versions and more."""
    cfg = CFG.replace(chunk_bytes=1 << 20)
    spot = SpotChecker(torch.nn.Linear(2, 2), cfg)
    pub = Publisher(cfg.overlay, KEY, spot, VersionFiles(tmp_path, keep_streams=3, keep_chunks=3))
    size = sum(t.nbytes for t in weights(0, scale=180).values())
    assert size > 30 << 20
    published = [pub.build(v, weights(v, scale=180)) for v in range(2)]
    before = rss_anon()
    for v in range(2, 6):
        published.append(pub.build(v, weights(v, scale=180)))  # the export is dropped after
        published = published[-3:]  # what the tracker keeps
    for state in spot._versions.values():  # every page of every retained version touched
        assert all(torch.isfinite(t.float()).all() for t in state.values() if t.is_floating_point())
    assert sorted(spot._versions) == [3, 4, 5]
    assert sum(len(c) for p in published for c in p.full.chunks) > 2 * size
    assert rss_anon() - before < size / 2, "retained versions should be file pages, not RAM"
