"""The dashboard's screenshot (docs/dashboard.png): a demo-like run, then the page in Chromium.

A hub in this process (`echo2p2p.hub.run.start.start_hub`: the built-in model and task, --steps
steps, an evaluation every 10, S = 2, cost-aware activation) and --peers real in-process peers
with names and prices of their own (one free, so the pool has a standby to choose around), their
chunk servers relaying to each other. Once the learner is done, with the peers still connected
(so the table lists them), the page is opened in headless Chromium (Debian's /usr/bin/chromium)
at 1400x900, left until a status event has come, and shot full-page.

    python bench/dashboard_shot.py [--steps 60] [--peers 4] [--out docs/dashboard.png]

Prints what the page holds (points per series, peers, rows) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright.async_api import async_playwright  # noqa: E402

from echo2p2p.hub.config import HubConfig  # noqa: E402
from echo2p2p.hub.run.start import start_hub  # noqa: E402
from tests.conftest import running_peers  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# (name, $/h): a free volunteer, two spot GPUs, an on-demand one
PEERS = [("volunteer-rtx3090", 0.0), ("spot-a10g-eu", 0.35), ("spot-l4-us", 0.42),
         ("ondemand-a100", 1.2)]


@contextlib.asynccontextmanager
async def peers(url: str, n: int):
    """`n` real peers joined to `url` (names and prices from PEERS), stopped on exit."""
    async with contextlib.AsyncExitStack() as stack:
        for name, price in (PEERS * (n // len(PEERS) + 1))[:n]:
            await stack.enter_async_context(
                running_peers(url, 1, name=name, price_per_hour=price, torch_threads=1))
        yield


async def shoot(url: str, out: Path) -> dict:
    """The page at `url`, once drawn and a status event later, shot full-page to `out`."""
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            problems: list[str] = []
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            await page.goto(url)
            await page.wait_for_function("() => dashboard.timings.first_render_ms !== null")
            await page.wait_for_function("() => dashboard.timings.events.status", timeout=10_000)
            await page.evaluate("new Promise(requestAnimationFrame)")
            held = await page.evaluate("dashboard.lengths()")
            await page.screenshot(path=str(out), full_page=True)
        finally:
            await browser.close()
    return {"page": held, "problems": problems}


async def main_async(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = HubConfig.from_flat(port=0, dashboard_port=0, max_steps=args.steps,
                      eval_every=10, eval_problems=64, torch_threads=1, seed=1,
                      run_dir=str(Path(tmp) / "run"))
        start = time.perf_counter()
        async with start_hub(cfg, stream=None) as run, peers(run.url, args.peers):
            await run.finished.wait()
            trained_s = time.perf_counter() - start
            held = await shoot(f"http://127.0.0.1:{run.dashboard_port}/", args.out)
    return {"bench": "dashboard_shot", "steps": args.steps, "peers": args.peers,
            "run_s": round(trained_s, 1), "out": str(args.out), **held}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "dashboard.png")
    args = p.parse_args(argv)
    result = asyncio.run(main_async(args))
    page = result["page"]
    print(f"{result['steps']} steps with {result['peers']} peers in {result['run_s']} s; the page "
          f"held {page['steps']} step points, {page['evals']} evaluations, {page['versions']} "
          f"versions, {page['peers']} peers in {page['rows']} rows; console errors: "
          f"{len(result['problems'])}; wrote {result['out']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
