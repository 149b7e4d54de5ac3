"""The house drawn from its import graph: folders, their size, and the arrows between them.

    python bench/house.py            # a table and a Mermaid graph, with sizes and import counts
    python bench/house.py --json     # the same as one JSON object
    python bench/house.py --page     # rewrite docs/architecture.md's graph: folders and arrows

Every `import` of our own modules counts, wherever it is (top level, in a function, under
TYPE_CHECKING). A folder is a package: the core's top-level modules are one box ("core"), each
sub-package of echo2p2p/ and of hub/ is one, peer/ is one. The page's graph has no numbers:
sizes and counts change with every commit, the folders and arrows only when the house does
(tests/test_docs.py fails when they differ, and `--page` redraws it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo's tests/
from tests.test_core_boundary import import_arrows, our_modules  # noqa: E402  (one reading of imports)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
HEADING = "### The house, drawn from its import graph"
PACKAGES = {"echo2p2p": ROOT / "echo2p2p", "echo2p2p.hub": ROOT / "hub", "echo2p2p.peer": ROOT / "peer"}


def box(name: str) -> str:
    """The folder a module is drawn in."""
    parts = name.split(".")
    if parts[1:2] == ["hub"] and len(parts) > 2 and (ROOT / "hub" / parts[2]).is_dir():
        return "hub/" + parts[2]
    if parts[1:2] == ["hub"]:
        return "hub"
    if parts[1:2] == ["peer"]:
        return "peer"
    if len(parts) > 2:
        return "echo2p2p/" + parts[1]
    return "echo2p2p (core)"


def house() -> dict:
    found = our_modules(PACKAGES)
    arrows: Counter[tuple[str, str]] = Counter()
    sizes: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for name, path in found.items():
        sizes[box(name)] += len(path.read_text().splitlines())
        count[box(name)] += 1
        for target in import_arrows(name, path, found):
            if box(target) != box(name):
                arrows[box(name), box(target)] += 1
    return {"folders": {b: {"modules": count[b], "lines": sizes[b]} for b in sorted(count)},
            "arrows": [{"from": a, "to": b, "imports": n} for (a, b), n in sorted(arrows.items())]}


def mermaid(drawn: dict, numbers: bool = True) -> str:
    """The graph; without `numbers`, folders and arrows only (what the page can keep true)."""
    ids = {name: f"n{i}" for i, name in enumerate(drawn["folders"])}
    lines = ["graph TD"]
    for name, info in drawn["folders"].items():
        size = f'<br/>{info["modules"]} modules, {info["lines"]} lines' if numbers else ""
        lines.append(f'  {ids[name]}["{name}{size}"]')
    for a in drawn["arrows"]:
        label = f'|{a["imports"]}| ' if numbers else " "
        lines.append(f'  {ids[a["from"]]} -->{label}{ids[a["to"]]}')
    return "\n".join(lines)


def page_graph(text: str) -> str:
    """The Mermaid graph under docs/architecture.md's house heading."""
    return re.search(rf"{re.escape(HEADING)}.*?```mermaid\n(.*?)\n```", text, re.S).group(1)


def redraw_page(drawn: dict) -> None:
    """Put the graph without numbers in docs/architecture.md."""
    text = PAGE.read_text()
    PAGE.write_text(text.replace(page_graph(text), mermaid(drawn, numbers=False)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--page", action="store_true", help="redraw docs/architecture.md's graph")
    args = ap.parse_args()
    drawn = house()
    if args.page:
        redraw_page(drawn)
        return
    if args.json:
        print(json.dumps(drawn))
        return
    print(f"{'folder':<22} {'modules':>7} {'lines':>7}")
    for name, info in drawn["folders"].items():
        print(f"{name:<22} {info['modules']:>7} {info['lines']:>7}")
    print()
    print(mermaid(drawn))
    print(json.dumps({"folders": len(drawn["folders"]), "arrows": len(drawn["arrows"])}))


if __name__ == "__main__":
    main()
