"""Floods of the hub's HTTP routes and of its log (issue 42, item 3), each attacker in a process
of its own (`tests.hostile.attacks`, every connection from 127.1.0.1), measured as the honest
peer's learner steps a minute without, with and after it, on one hub.

- /status on the peers' port and the dashboard's routes (the page, /api/snapshot, /status,
  /metrics), asked by 16 connections as fast as they are answered: the hub answers the address
  at most its budget (`http_burst` at once, then `http_requests_per_min`; the rest wait their
  turn or get 429) and builds each answer at most once a moment (`http_limits.FRESH_S`).
- relay_report frames accusing the honest peer, one line each in the hub's log: under the log
  budget (`process.configure`, as both mains set logging up) at most LINES_PER_WINDOW lines of
  that kind a window are written, and the rest are told in a summary line at the window's end.
  (The frame budget also limits the frames themselves; the log budget must hold on its own.)
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from echo2p2p.hub.serving import http_limits
from echo2p2p.hub.view import dashboard as dashboard_module
from echo2p2p.hub.view.metrics import RunCollector
from echo2p2p.log_budget import LINES_PER_WINDOW, WINDOW_S
from echo2p2p.request_budget import PAGES
from echo2p2p.runtime import process

from tests.conftest import until_logged

from .conftest import yes
from .harness import (HONEST, Rates, attacker_process, hub_alive, hub_and_honest_peer, mark,
                      peer_id, small_cfg, steps_per_min, still_training)

CONNECTIONS = 16
MEASURED_STEPS = 60  # learner steps timed without, with and after the attacker (15-40 s each here):
# long enough that the burst each address may spend at once is a small part of the flood
RELAY_LINE = "%s reports relay %s on v%d: %s"  # hub.core.accusations' line for one report


async def measured(run, honest, kind: str, started, **params: Any) -> tuple[Rates, str, dict, float]:
    """The attack `kind` in a process of its own, once `started(report)` says it is under way:
    (steps/min without / with / after, the honest peer's account, the attacker's final counts,
    seconds it ran)."""
    without = await steps_per_min(run, MEASURED_STEPS)
    since = mark(run, honest)
    async with attacker_process(kind, run.url, **params) as attacker:
        await attacker.wait_report(started)
        with_ = await steps_per_min(run, MEASURED_STEPS)
        training = await still_training(run, honest, since)
    after = await steps_per_min(run, MEASURED_STEPS)
    return Rates(without, with_, after), training, attacker.report, attacker.report["elapsed_s"]


def answered(report: dict) -> int:
    return sum(n for key, n in report.items() if key.startswith("status_"))


def counting(monkeypatch, owner, name: str) -> Counter:
    """Calls of `owner.name` from now on, counted (the real one still runs)."""
    calls, real = Counter(), getattr(owner, name)

    def call(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, call)
    return calls


async def limited(run) -> dict[str, float]:
    """The dashboard's count of pages requests delayed, refused and dropped (asked from
    127.0.0.1, not the attacker's address)."""
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{run.dashboard_port}/metrics") as r:
        fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
    return {s.labels["outcome"]: s.value for s in fams["echo2_http_requests_limited"].samples
            if s.labels["route"] == "pages"}


def told(seen: dict, elapsed_s: float, held: dict[str, float]) -> str:
    """What the flood's clients were answered and what the hub's budget did, in words."""
    ok = seen.get("status_200", 0)
    return (f"{ok} answered 200 in {elapsed_s:.0f} s ({ok / elapsed_s:.1f}/s), "
            f"{seen.get('status_429', 0)} x 429; the hub delayed {held['delayed']:.0f}, "
            f"refused {held['refused']:.0f}, dropped {held['dropped']:.0f}")


def allowed(cfg, elapsed_s: float) -> float:
    """The most answers one address may get in `elapsed_s`: its burst, then its rate."""
    return cfg.limits.http_burst + cfg.limits.http_requests_per_min / 60 * elapsed_s + 1


def most_builds(cfg, elapsed_s: float) -> float:
    """The most builds of one answer while an attacker ran `elapsed_s`: one a moment, over
    that time and the longest wait of a request it left waiting, and one for `hub_alive`."""
    waits_s = http_limits.request_budget(cfg.limits).limits[PAGES].max_wait_s
    return (elapsed_s + waits_s) / http_limits.FRESH_S + 2


async def test_a_status_flood_is_held_to_the_addresss_budget(tmp_path, row, monkeypatch):
    """16 connections asking /status on the peers' port as fast as answered get at most the
    address's budget; /status is built at most once a moment; the honest peer trains."""
    r = row(f"42-3c. /status flood: {CONNECTIONS} connections from one address, hub's port")
    cfg = small_cfg(tmp_path)
    async with hub_and_honest_peer(cfg) as (run, honest):
        builds = counting(monkeypatch, dashboard_module, "status")  # full: a loopback hub
        rates, r.honest_training, seen, elapsed_s = await measured(
            run, honest, "http", lambda rep: answered(rep) > 0,
            target=f"http://127.0.0.1:{run.port}/status", connections=CONNECTIONS)
        held = await limited(run)
        r.hub_alive = yes(alive := await hub_alive(run))
    r.steps_per_min = rates.cell()
    r.reaction = f"{told(seen, elapsed_s, held)}; /status built {builds['status']} times"
    r.note = (f"budget {cfg.limits.http_burst} at once, then {cfg.limits.http_requests_per_min:.0f}"
              f"/min an address; answers built once a {http_limits.FRESH_S:.0f} s")
    assert alive
    assert seen.get("status_200", 0) <= allowed(cfg, elapsed_s), seen
    assert 1 <= builds["status"] <= most_builds(cfg, elapsed_s), builds


async def test_a_dashboard_flood_is_held_to_the_addresss_budget(tmp_path, row, monkeypatch):
    """16 connections asking the dashboard's page, snapshot, /status and /metrics in turn get
    at most the address's budget; the status and /metrics are built at most once a moment."""
    r = row(f"42-3d. dashboard flood: {CONNECTIONS} connections from one address, 4 routes")
    cfg = small_cfg(tmp_path)
    async with hub_and_honest_peer(cfg) as (run, honest):
        builds = counting(monkeypatch, dashboard_module, "status")
        collects = counting(monkeypatch, RunCollector, "collect")
        base = f"http://127.0.0.1:{run.dashboard_port}"
        rates, r.honest_training, seen, elapsed_s = await measured(
            run, honest, "http", lambda rep: answered(rep) > 0, connections=CONNECTIONS,
            target=[base + path for path in ("/", "/api/snapshot", "/status", "/metrics")])
        held = await limited(run)
        r.hub_alive = yes(alive := await hub_alive(run))
    r.steps_per_min = rates.cell()
    r.reaction = (f"{told(seen, elapsed_s, held)}; status built {builds['status']} times, "
                  f"/metrics collected {collects['collect']}")
    r.note = "routes /, /api/snapshot, /status, /metrics in turn; no dashboard token (loopback)"
    assert alive
    assert seen.get("status_200", 0) <= allowed(cfg, elapsed_s), seen
    assert 1 <= builds["status"] <= most_builds(cfg, elapsed_s), builds
    assert 1 <= collects["collect"] <= most_builds(cfg, elapsed_s), collects


async def test_a_relay_report_flood_writes_a_bounded_log(tmp_path, row, caplog, monkeypatch):
    """relay_report frames accusing the honest peer, as fast as the socket takes them: the
    hub's log, set up as its main sets it up, gets at most LINES_PER_WINDOW lines of that kind
    a window, and what it held back is told in summary lines without another line to carry
    them."""
    r = row("42-3e. log flood: relay_report accusing the honest peer, one connection")
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")  # what configure sets, undone after
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    filters = {h: list(h.filters) for h in logging.getLogger().handlers}
    start = time.monotonic()
    budget = process.configure("info")  # as echo2-hub's main: every root handler under the budget
    try:
        async with hub_and_honest_peer(small_cfg(tmp_path)) as (run, honest):
            accused = peer_id(run, HONEST)
            rates, r.honest_training, seen, elapsed_s = await measured(
                run, honest, "flood", lambda rep: rep.get("sent", 0) > 0, frame="relay_report",
                accuse=accused)
            r.hub_alive = yes(alive := await hub_alive(run))
            lines = sum(rec.msg == RELAY_LINE for rec in caplog.records)
            windows = (time.monotonic() - start) / WINDOW_S + 1
            closes = {k: n for k, n in seen.items() if k.startswith("closed_")}
            r.reaction = (f"{seen.get('sent', 0)} reports sent in {elapsed_s:.0f} s: {lines} lines "
                          f"of them logged; connection {closes or 'not closed'}")
            assert lines <= LINES_PER_WINDOW * windows, lines  # red without the log budget
            if budget.held_back:  # a frame budget may have stopped the reports before the log
                # each summary is logged once counted in `told`
                await until_logged(lambda: budget.told >= budget.held_back, WINDOW_S + 60)
    finally:
        for handler, kept in filters.items():
            handler.filters[:] = kept
        budget.close()
    told = [rec.getMessage() for rec in caplog.records if rec.name == process.SUMMARY_LOGGER]
    relay_told = sum(int(re.search(r"(\d+) more lines", t).group(1)) for t in told
                     if repr(RELAY_LINE) in t)
    r.steps_per_min = rates.cell()
    r.reaction += (f"; {budget.held_back} lines held back, told in {len(told)} summary lines "
                   f"({relay_told} of the reports)")
    r.note = (f"{LINES_PER_WINDOW} lines of a kind a {WINDOW_S:.0f} s window; the steps lost are the "
              f"reports' own handling, which the frame budget (not this test's) limits")
    assert alive
    assert budget.told == budget.held_back and relay_told <= budget.held_back
