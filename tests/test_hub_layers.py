"""The folders under hub/ import in one direction: each may import only the layers below it.

From the bottom: the run's configuration (hub/config*.py), the tasks, the core (the hub's
decisions, sans-IO: `echo2p2p.hub.core`), learning (the learner, GRPO, checkpoints: torch),
the overlay (versions, model files, the hub's relay probes), serving (the shell: sockets, the
frame pump, the HTTP limits), the view (dashboard, metrics, run log), the run (the learner loop
and the one entry point that starts a run), then the applications' faces: the conformance kit,
the Python API and the CLI. Every import counts, type-only ones too: a folder that needs a type
from above asks for a Protocol of its own instead. A pair of folders importing each other is a
tangle a reader cannot follow in either direction (issue 44).
"""

from __future__ import annotations

import pytest

from tests.test_core_boundary import ROOT, import_arrows, our_modules

HUB = ROOT / "hub"
LAYERS = ["config", "tasks", "core", "learning", "overlay", "serving", "view", "run",
          "conformance", "api", "cli"]
TOP_LEVEL = {"config": "config", "config_grpo": "config", "config_memory": "config",
             "config_presets": "config", "config_sections": "config", "run": "run",
             "api": "api"}  # hub/*.py modules: the layer each belongs to


def layer_of(module: str) -> str | None:
    """The layer of a module of echo2p2p.hub (None: the package itself)."""
    parts = module.split(".")[2:]
    if not parts:
        return None
    return parts[0] if (HUB / parts[0]).is_dir() else TOP_LEVEL[parts[0]]


def upward_imports(modules: dict) -> list[str]:
    """`a imports b` for every arrow from a module to one in a layer above its own."""
    bad = []
    for name, path in sorted(modules.items()):
        here = layer_of(name)
        for there in sorted(import_arrows(name, path, modules)):
            if here and (up := layer_of(there)) and LAYERS.index(up) > LAYERS.index(here):
                bad.append(f"{name} ({here}) imports {there} ({up})")
    return bad


def test_every_folder_has_a_layer():
    """A new folder under hub/ must be given its place (the order is an allow-list)."""
    folders = {p.name for p in HUB.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders <= set(LAYERS), f"unplaced: {sorted(folders - set(LAYERS))}"
    modules = {p.stem for p in HUB.glob("*.py") if p.stem != "__init__"}
    assert modules <= set(TOP_LEVEL), f"unplaced: {sorted(modules - set(TOP_LEVEL))}"


def test_hub_folders_import_downward_only():
    modules = our_modules({"echo2p2p.hub": HUB})
    assert not (bad := upward_imports(modules)), "\n".join(bad)


def test_an_upward_import_is_caught(tmp_path):
    """The rule goes red on a core module that imports the shell, even under TYPE_CHECKING."""
    (tmp_path / "core").mkdir()
    (tmp_path / "serving").mkdir()
    core = tmp_path / "core" / "x.py"
    core.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from ..serving.y import Hub\n")
    (tmp_path / "serving" / "y.py").write_text("")
    modules = {"echo2p2p.hub.core.x": core, "echo2p2p.hub.serving.y": tmp_path / "serving" / "y.py"}
    assert upward_imports(modules) == [
        "echo2p2p.hub.core.x (core) imports echo2p2p.hub.serving.y (serving)"]


@pytest.mark.parametrize("module", ["echo2p2p.hub.run.loop", "echo2p2p.hub.api"])
def test_layer_names_resolve(module):
    assert layer_of(module) in LAYERS
