"""The dashboard's page in a real headless Chromium (Debian's /usr/bin/chromium) over a real hub
and real peers: it fills from the run, follows it live without a reload, honours the token,
finds a restarted hub on the same port by itself, stays bounded over a long run with many
peers (the hub's real dashboard server and feed, its peers welcomed without sockets), shows
every tile and header whole at 1000 px, and shows the run's figures without scripts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

from playwright.async_api import Browser, Page, async_playwright

from echo2p2p import messages as m
from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.learning.held_out import EvalProgress
from echo2p2p.hub.view.dashboard import serve_dashboard
from echo2p2p.hub.view.feed import Feed
from echo2p2p.hub.core.peer import Peer
from echo2p2p.hub.view.runlog import RunLog
from echo2p2p.hub.serving.server import Hub, TokenizedProblem
from echo2p2p.hub.run.start import start_hub
from echo2p2p.hub.run.loop import HubRun
from echo2p2p.hub_protocol import HubProtocol
from echo2p2p.tasks import AdditionTask

from tests.conftest import running_peers

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 60_000
TOKEN = "s3cret-token"
HOSTILE_NAME = '<img src=x onerror="document.title=1">'  # a peer's name is any printable text
CHARTS = ("chart-reward", "chart-busy", "chart-rate", "chart-staleness", "chart-offpolicy",
          "chart-cdf", "chart-bcast", "chart-sources", "chart-wire", "chart-cost")

# For each chart: its series that have a value, and canvas pixels painted in a series' colour
# (the legend's marker has it), so axes and grid alone do not count as drawn.
DRAWN = """(ids) => ids.map((id) => {
  const plot = dashboard.charts[id].plot, canvas = document.querySelector('#' + id + ' canvas');
  const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  const colours = [...document.querySelectorAll('#' + id + ' .u-marker')]
    .map((m) => getComputedStyle(m).borderColor.match(/\\d+/g).map(Number));
  const painted = colours.map(([r, g, b]) => {
    let n = 0;
    for (let i = 0; i < pixels.length; i += 4)
      if (pixels[i] === r && pixels[i + 1] === g && pixels[i + 2] === b) n += 1;
    return n;
  });
  const valued = plot.data.slice(1).map((s) => s.filter((v) => v !== null && v !== 0).length);
  return {id, valued, painted};
})"""


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


async def open_page(browser: Browser, url: str) -> tuple[Page, list[str]]:
    """`url` in a 1400x900 page, and the list its console errors and page errors go to."""
    page = await browser.new_page(viewport={"width": 1400, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    await page.goto(url)
    await page.evaluate("window.loadedOnce = true")  # gone if the page ever reloads
    return page, problems


async def wait_for(page: Page, condition: str) -> None:
    """Until the JS expression `condition` holds (as a function: the page's CSP forbids
    evaluating a string)."""
    await page.wait_for_function(f"() => {condition}", timeout=WAIT_MS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_page_fills_from_a_real_run_and_follows_it_live(hub_cfg):
    """Opened before any step, the page draws every chart and the peers from the run's events
    alone, without a reload; a page opened afterwards draws the same from the snapshot."""
    cfg = hub_cfg.replace(dashboard_port=0, max_steps=3, eval_every=2, eval_problems=4)
    async with start_hub(cfg, stream=None) as run, chromium() as browser:
        url = f"http://127.0.0.1:{run.dashboard_port}/"
        page, problems = await open_page(browser, url)
        await wait_for(page, f"dashboard.state.runId === {run.hub.core.run_id!r}")
        assert (await page.evaluate("dashboard.lengths()"))["steps"] == 0
        async with running_peers(run.url, 2, price_per_hour=0.5):
            await wait_for(page, "dashboard.lengths().steps === 3 && dashboard.lengths().evals === 2")
            await wait_for(page, "dashboard.state.versions.some((r) => r.complete && r.t_bcast_s !== null)")
            await wait_for(page, "['test-0', 'test-1'].every((name) => "
                                 "document.querySelector('#peers tbody').textContent.includes(name))")
            await page.evaluate("new Promise(requestAnimationFrame)")  # the last events drawn
            assert await page.evaluate("window.loadedOnce") is True
            assert await page.text_content("#tile-step") == "2"
            assert await page.text_content("#connection") == "live"
            live = await page.evaluate(DRAWN, CHARTS)
            await page.fill("#peer-filter", "test-1")
            await wait_for(page, "dashboard.lengths().rows === 1")
            assert "test-1" in await page.text_content("#peers tbody")
            fresh, fresh_problems = await open_page(browser, url)
            await wait_for(fresh, "dashboard.timings.first_render_ms !== null")
            held = await fresh.evaluate("dashboard.lengths()")
            assert (held["steps"], held["evals"], held["rows"]) == (3, 2, 2)
            assert held["versions"] >= 1
    for chart in live:
        assert any(chart["valued"]) and any(chart["painted"]), chart
    assert problems == [] and fresh_problems == []


async def test_page_with_its_token_finds_a_restarted_hub_on_the_same_port(hub_cfg, tmp_path):
    """With a dashboard token the page opened with ?token= works, and without it the browser
    shows the hub's 401 reason. The hub goes and a new run starts on the same port: the page
    says it is reconnecting, then live again (its token carried on), and draws the new run's
    steps without a reload; its peers' names, markup as they are, show as text."""
    cfg = hub_cfg.replace(dashboard_port=free_port(), dashboard_token=TOKEN, max_steps=2)
    url = f"http://127.0.0.1:{cfg.view.dashboard_port}/"
    async with chromium() as browser:
        async with start_hub(cfg, stream=None) as first:
            page, problems = await open_page(browser, url + "?token=" + TOKEN)
            await wait_for(page, f"dashboard.state.runId === {first.hub.core.run_id!r}")
            await wait_for(page, "document.getElementById('connection').textContent === 'live'")
            refused = await browser.new_page()
            response = await refused.goto(url)
            assert response.status == 401
            assert "token missing or wrong" in await refused.text_content("body")
        await wait_for(page, "document.getElementById('connection').textContent === 'reconnecting'")
        async with start_hub(cfg.replace(run_dir=str(tmp_path / "second")), stream=None) as second:
            async with running_peers(second.url, 2, name=HOSTILE_NAME):
                await wait_for(page, f"dashboard.state.runId === {second.hub.core.run_id!r}"
                                     " && dashboard.lengths().steps === 2")
                assert await page.text_content("#connection") == "live"
                assert await page.evaluate("window.loadedOnce") is True
                await wait_for(page, "dashboard.lengths().rows === 2")
                assert HOSTILE_NAME in await page.text_content("#peers tbody")
                assert await page.evaluate("document.querySelector('#peers img')") is None
    assert first.hub.core.run_id != second.hub.core.run_id
    # Chromium itself logs the cut stream and the refused reconnections while the hub is away
    network = "Failed to load resource: net::ERR_"
    assert all(p.startswith(network) for p in problems), problems


def welcomed_peers(hub: Hub, n: int) -> None:
    """`n` peers that said hello and were welcomed, without sockets (as the tracker's tests
    make them), peer i generating i / 100 rollouts/s. No public face of the hub makes socket-less
    peers: this rig writes its peer table and pool (private) by hand."""
    now = asyncio.get_running_loop().time()  # the hub's clock
    for i in range(n):
        peer_id = f"p{i:04d}"
        proto = HubProtocol(now, 1 << 20)
        hello = m.Hello(f"peer-{i:04d}", "transformers", "cpu")
        proto.receive_frame(m.encode(hello), now)
        conn = Peer(peer_id, hello, proto, hub.core.outbox)
        proto.send(m.Welcome(peer_id=peer_id, run_id=hub.core.run_id, model="tiny",
                             task="addition", version=0, max_lag=2, group_size=4,
                             temperature=1.0, top_p=1.0, max_new_tokens=8, seed=i))
        hub._peers[peer_id] = conn
        hub._pool.join(peer_id, hello.name, 0.0, generates=True, now=now)
        hub._pool.accounts[peer_id].gen_rollouts_per_s = i / 100


def step_record(step: int) -> dict:
    return {"step": step, "version": step + 1, "time_s": float(step), "train/reward_mean": 0.5,
            "hub/learner_busy_frac": 0.5, "rollout/per_s": 10.0, "rollout/staleness_mean": 0.0,
            "rollout/staleness_hist": {"0": 4}, "cost/usd_total": 0.0, "cost/usd_per_hour": 0.0}


async def test_page_stays_bounded_over_a_long_run_and_many_peers(tmp_path):
    """A hub of 1,000 peers with 3,000 steps behind it, then 4,000 more live: the page keeps at
    most 4,000 points a series (in step order, the newest as it came), shows 200 table rows
    of the 1,000, and the filter and a column's sort reach all of them."""
    cfg = HubConfig.from_flat(port=0, dashboard_port=0, run_dir=str(tmp_path))
    task = AdditionTask()
    hub = Hub(cfg, "long-run", task, [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]])
    run = HubRun(cfg, hub, None, None, RunLog(tmp_path, {}, stream=None), b"")
    welcomed_peers(hub, 1000)
    feed = Feed()
    for step in range(3000):
        feed.record(step_record(step))
    async with serve_dashboard(run, feed) as port, chromium() as browser:
        page, problems = await open_page(browser, f"http://127.0.0.1:{port}/")
        await wait_for(page, "dashboard.timings.first_render_ms !== null")
        assert await page.text_content("#peer-count") == "the first 200 of 1000"
        for step in range(3000, 7000):
            feed.record(step_record(step))
        await wait_for(page, "dashboard.state.last.step === 6999")
        steps = await page.evaluate("dashboard.state.steps.step")
        assert 2000 < len(steps) <= 4000 and steps[-1] == 6999
        assert all(a < b for a, b in zip(steps, steps[1:]))
        await page.click("th[data-key=gen_rollouts_per_s]")  # a number column sorts high to low first
        await wait_for(page, "document.querySelector('#peers tbody td').textContent === 'peer-0999'")
        await page.fill("#peer-filter", "peer-000")
        await wait_for(page, "dashboard.lengths().rows === 10")
    run.runlog.close()
    assert problems == []


CUT = """() => [...document.querySelectorAll('.tile .label, .tile .value, #peers th')]
  .filter((el) => el.scrollWidth > el.clientWidth + 1 || el.getBoundingClientRect().right > innerWidth)
  .map((el) => el.textContent)"""


async def test_at_1000_px_no_tile_or_header_is_cut_and_the_lp_tile_says_why_it_is_empty(tmp_path):
    """At 1000 px wide every tile's label and value and every peers table header shows whole
    (they wrap, none is cut or runs off the page), and the LP bound tile, empty before any step
    was timed, says why (the capacity model's sentence)."""
    cfg = HubConfig.from_flat(port=0, dashboard_port=0, run_dir=str(tmp_path))
    task = AdditionTask()
    hub = Hub(cfg, "narrow", task, [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]])
    run = HubRun(cfg, hub, None, None, RunLog(tmp_path, {}, stream=None), b"")
    welcomed_peers(hub, 3)
    feed = Feed()
    feed.record(step_record(0))
    async with serve_dashboard(run, feed) as port, chromium() as browser:
        page = await browser.new_page(viewport={"width": 1000, "height": 900})
        await page.goto(f"http://127.0.0.1:{port}/")
        await wait_for(page, "dashboard.timings.first_render_ms !== null "
                             "&& dashboard.lengths().rows === 3")
        assert await page.evaluate(CUT) == []
        assert await page.evaluate("document.documentElement.scrollWidth") <= 1000
        assert await page.text_content("#tile-lp-bound") == "–"
        assert "needs a measured learner step" in await page.text_content("#tile-lp-why")
    run.runlog.close()


async def test_the_page_without_scripts_shows_the_runs_figures_and_where_the_data_is(tmp_path):
    """A plain headless Chromium with scripts off (a script's screenshot, a slow client) gets
    the run's figures of the moment in the tiles, served in the HTML, and a noscript line
    naming /status and /metrics."""
    cfg = HubConfig.from_flat(port=0, dashboard_port=0, run_dir=str(tmp_path))
    task = AdditionTask()
    hub = Hub(cfg, "first-paint", task, [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]])
    run = HubRun(cfg, hub, None, None, RunLog(tmp_path, {}, stream=None), b"")
    run.records.append({**step_record(7), "rollout/per_s": 12.345, "hub/learner_busy_frac": 0.61})
    run.evaluating = EvalProgress(8, 200, 96)
    welcomed_peers(hub, 2)
    async with serve_dashboard(run, Feed()) as port, chromium() as browser:
        context = await browser.new_context(java_script_enabled=False)
        page = await context.new_page()
        await page.goto(f"http://127.0.0.1:{port}/")
        shown = {tile: await page.text_content(f"#{tile}") for tile in (
            "run-id", "tile-step", "tile-rate", "tile-busy", "tile-reward", "tile-peers",
            "tile-evaluating")}
        note = await page.text_content("noscript")
    run.runlog.close()
    assert shown == {"run-id": "first-paint", "tile-step": "7", "tile-rate": "12.3",
                     "tile-busy": "61 %", "tile-reward": "0.500", "tile-peers": "2 · 0 · 0",
                     "tile-evaluating": "evaluating v8: 96/200"}
    assert "/status" in note and "/metrics" in note


async def test_the_base_evaluation_shows_its_progress_and_slow_rates_keep_two_figures(tmp_path):
    """Before the first step, while the base model is evaluated (minutes on a real model), the
    held-out tile says `evaluating v0: 96/200` and follows the count live, then clears when the
    evaluation ends; a real model's slow rates show two significant figures (a peer at 0.4/s
    is 0.4, not 0; the run's 0.043 admitted/s is 0.043)."""
    cfg = HubConfig.from_flat(port=0, dashboard_port=0, run_dir=str(tmp_path))
    task = AdditionTask()
    hub = Hub(cfg, "slow-model", task, [TokenizedProblem(p, [1]) for p in task.problems("train")[:4]])
    run = HubRun(cfg, hub, None, None, RunLog(tmp_path, {}, stream=None), b"")
    welcomed_peers(hub, 2)
    hub._pool.accounts["p0001"].gen_rollouts_per_s = 0.4
    progress = EvalProgress(0, 200, 96)
    run.evaluating = progress
    feed = Feed()
    async with serve_dashboard(run, feed) as port, chromium() as browser:
        page, problems = await open_page(browser, f"http://127.0.0.1:{port}/")
        tile = "document.getElementById('tile-evaluating').textContent"
        await wait_for(page, f"{tile} === 'evaluating v0: 96/200'")
        assert await page.text_content("#tile-accuracy") == "–"
        progress.done = 128  # the next piece done: the status event every 2 s carries it
        await wait_for(page, f"{tile} === 'evaluating v0: 128/200'")
        rates = await page.evaluate("[...document.querySelectorAll('#peers tbody tr')].map("
                                    "(row) => row.children[4].textContent)")
        assert sorted(rates) == ["0", "0.4"], rates
        run.evaluating = None
        feed.record({"event": "eval", "version": 0, "eval/accuracy": 0.142})
        feed.record({**step_record(0), "rollout/per_s": 0.043})
        await wait_for(page, f"{tile} === '' && dashboard.state.last !== null")
        assert await page.text_content("#tile-accuracy") == "0.142"
        assert await page.text_content("#tile-rate") == "0.043"
    run.runlog.close()
    assert problems == []
