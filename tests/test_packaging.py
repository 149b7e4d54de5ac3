"""The wheel installs one top-level package, `echo2p2p`: hub/ and peer/ go in as echo2p2p.hub and
echo2p2p.peer (the names `hub` and `peer` belong to other PyPI projects), with the built-in
model's files and both entry points."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_only_echo2p2p(tmp_path):
    """Built from a copy of the source (no build files left in the tree), the wheel's top-level
    names are echo2p2p and its metadata; the applications, the assets and the scripts are in."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("echo2p2p", "hub", "peer"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(out), str(src)], check=True, timeout=300)
    (wheel,) = out.glob("echo2p2p-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"echo2p2p", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for path in ("echo2p2p/hub/serving/server.py", "echo2p2p/peer/client.py",
                 "echo2p2p/policy/assets/tiny-base/model.safetensors", "echo2p2p/overlay/store.py"):
        assert path in names, path
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "echo2-hub = echo2p2p.hub.cli:main" in scripts
    assert "echo2-peer = echo2p2p.peer.cli:main" in scripts
