"""The hub's /metrics: a real run with real peers scraped over HTTP and read by prometheus_client's
parser; the names' rules; the bound on per-peer series; the example Grafana dashboard naming
only what the hub and the peers export."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from echo2p2p.runtime.prometheus import label_text
from echo2p2p.hub.view.metrics import (MAX_PEER_SERIES, lag_histogram, labelled_peers,
                                  metrics_handler, ratio_gauges)
from echo2p2p.hub.run.start import start_hub
from echo2p2p.peer.client import PeerClient
from echo2p2p.peer.config import PeerConfig
from echo2p2p.peer.metrics import peer_registry

from tests.conftest import running_peers, serving, until

DASHBOARD = Path(__file__).resolve().parents[3] / "examples" / "grafana-dashboard.json"
NAME = re.compile(r"echo2_[a-z0-9]+(_[a-z0-9]+)*")
# Units Prometheus wants spelled as base units, and our run log's short forms of them.
NOT_BASE = re.compile(r"_(ms|us|ns|s|kb|mb|gb|kib|mib|gib|bps|mbps|frac|pct|percent)(_|$)")
HOSTILE_NAME = 'evil"}<b>script' * 6  # printable, so the hub admits it; not a safe label
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "info": ("_info",),
            "histogram": ("_bucket", "_sum", "_count")}


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, sample_name: str, **labels: str) -> float | None:
    """The value of the one sample named `sample_name` whose labels include `labels`."""
    found = [s.value for f in fams.values() for s in f.samples
             if s.name == sample_name and labels.items() <= s.labels.items()]
    assert len(found) <= 1, f"{sample_name}{labels}: {len(found)} samples"
    return found[0] if found else None


def naming_faults(fams: dict) -> list[str]:
    """Every breach of the naming rules: echo2_ and lower snake case, base units, `_total` on
    counters only, a help text, samples named as their type says."""
    faults = []
    for name, f in fams.items():
        if not NAME.fullmatch(name) or NOT_BASE.search(name):
            faults.append(f"{name}: not echo2_ lower snake case in base units")
        if f.type != "counter" and name.endswith("_total"):
            faults.append(f"{name}: _total on a {f.type}")
        if not f.documentation:
            faults.append(f"{name}: no help")
        allowed = {name + suffix for suffix in SUFFIXES.get(f.type, ())}
        faults += [f"{s.name}: not a {f.type}'s sample" for s in f.samples if s.name not in allowed]
    return faults


def exported_names(*texts: str) -> set[str]:
    """The sample names the expositions `texts` can have, from their families' types (a family
    whose value is not known yet is listed without samples)."""
    return {f.name + suffix for text in texts for f in text_string_to_metric_families(text)
            for suffix in SUFFIXES[f.type]}


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        return await response.text()


def peer_labels(fams: dict) -> set[str]:
    return {s.labels["peer"] for name, f in fams.items() if name.startswith("echo2_hub_peer")
            for s in f.samples}


async def test_a_real_run_scraped_over_http_agrees_with_the_hub(hub_cfg, monkeypatch):
    """Hub + 2 peers, 3 steps: /metrics parses, follows the naming rules, and says what the
    hub's own statistics, records and propagation say; a bound of 1 leaves 1 peer labelled."""
    # each scrape below must see the hub as it is then (the peers gone a moment ago), not the
    # exposition kept for a second against floods (test_the_exposition_is_built_once_a_moment)
    monkeypatch.setattr("echo2p2p.hub.serving.http_limits.FRESH_S", 0.0)
    cfg = hub_cfg.replace(max_steps=3, max_lag=2, publish_every=1, eval_every=3, eval_problems=4)
    async with start_hub(cfg, stream=None) as run:
        seen: list[dict] = []
        run.runlog.listeners.append(seen.append)
        app = web.Application()  # beside the dashboard's /metrics: one with a bound of 1
        app.router.add_get("/one", metrics_handler(run, max_peer_series=1))
        async with serving(app) as port, aiohttp.ClientSession() as http:
            dashboard = f"http://127.0.0.1:{run.dashboard_port}/metrics"
            async with running_peers(run.url, 2, metrics_port=0, name=HOSTILE_NAME) as peers:
                await asyncio.wait_for(run.finished.wait(), 120)
                await until(run.hub, lambda: any(r.get("event") == "propagation" and
                                                 r["version"] == 3 for r in seen))
                before = run.hub.statistics()
                live = families(await scrape(http, dashboard))
                after = run.hub.statistics()
                one = families(await scrape(http, f"http://127.0.0.1:{port}/one"))
                worker, made = peers[0].statistics(), peers[0].worker.tokens_generated
                own = families(await scrape(http, peers[0].metrics_url))
                worker_after, made_after = peers[0].statistics(), peers[0].worker.tokens_generated
            await until(run.hub, lambda: len(run.hub.peer_views()) == 0)
            await until(run.hub, lambda: run.hub.statistics().judging == 0)
            quiet = families(await scrape(http, dashboard))
            in_queue = run.hub.statistics().stale_in_queue
            stats = run.hub.statistics()
            scoring = stats.scoring
    assert naming_faults(live) == []
    assert before.admitted_groups <= value(live, "echo2_admitted_groups_total") <= after.admitted_groups
    assert value(live, "echo2_step") == 3 and value(live, "echo2_published_version") == 3
    last = run.records[-1]
    assert value(live, "echo2_reward_mean") == last["train/reward_mean"]
    assert value(live, "echo2_learner_busy_ratio") == last["hub/learner_busy_frac"]
    assert value(live, "echo2_eval_accuracy") == last["eval/accuracy"]
    assert value(live, "echo2_eval_version") == 3
    assert value(live, "echo2_mismatch_kl") == last.get("mismatch_kl")  # None: no lag-0 token
    assert value(live, "echo2_importance_ratio_mean", lag="all") == last["ratio_mean"]
    for lag, by_lag in last["by_lag"].items():
        assert value(live, "echo2_importance_clip_ratio", lag=lag) == by_lag["clip_frac"]
    trained = sum(int(n) for r in run.records if "step" in r for n in r["rollout/staleness_hist"].values())
    assert trained == 3 * cfg.grpo.prompts_per_step
    assert value(live, "echo2_trained_group_lag_versions_count") == trained
    assert value(live, "echo2_trained_group_lag_versions_bucket", le="+Inf") == trained
    assert value(live, "echo2_trained_group_lag_versions_sum") == sum(
        int(lag) * n for r in run.records if "step" in r
        for lag, n in r["rollout/staleness_hist"].items())
    spread = next(r for r in seen if r.get("event") == "propagation" and r["version"] == 3)
    assert value(live, "echo2_propagation_version") == 3
    assert value(live, "echo2_propagation_seconds", share="0.9") == spread["t90_s"]
    assert value(live, "echo2_propagation_bytes", source="hub") == spread["bytes_from_hub"]
    assert value(live, "echo2_peers", state="active") + value(live, "echo2_peers", state="standby") == 2
    assert peer_labels(live) == {"p1", "p2"}
    assert value(live, "echo2_hub_peer_held_version", peer="p1") == 3
    assert value(live, "echo2_hub_peer_info", peer="p2", name="evil___b_scriptevil___b_scriptev") == 1
    assert value(live, "echo2_peers_unlabelled") == 0
    assert len(peer_labels(one)) == 1 and value(one, "echo2_peers_unlabelled") == 1
    assert naming_faults(own) == [] and value(own, "echo2_peer_held_version") == 3
    assert 0 < made <= value(own, "echo2_peer_generated_tokens_total") <= made_after
    assert 0 < worker.acked <= value(own, "echo2_peer_acked_groups_total") <= worker_after.acked
    assert worker.submitted <= value(own, "echo2_peer_submitted_groups_total") <= worker_after.submitted
    # Peers gone, nothing being judged: the hub is still, and the scrape says exactly what it says.
    for name, field in (("echo2_admitted_groups_total", "admitted_groups"),
                        ("echo2_admitted_rollouts_total", "admitted_samples"),
                        ("echo2_rejected_submissions_total", "rejected"),
                        ("echo2_spot_checks_total", "spot_checked")):
        assert value(quiet, name) == getattr(stats, field), name
    assert value(quiet, "echo2_stale_groups_total", where="arrival") == stats.stale_on_arrival
    assert value(quiet, "echo2_stale_groups_total", where="queue") == in_queue
    assert value(quiet, "echo2_dropped_group_lag_versions_count") == stats.stale_on_arrival + in_queue
    assert value(quiet, "echo2_scored_completions_total") == scoring.completions
    assert value(quiet, "echo2_cost_dollars_total") == run.hub.statistics().cost["cost/usd_total"]
    assert peer_labels(quiet) == set() and value(quiet, "echo2_peers", state="active") == 0


def test_labelled_peers_are_the_most_admitted_and_bounded():
    """200 peers: the 64 with the most admitted completions get series, ties to the earliest
    joined; fewer peers than the bound all get theirs."""
    rng = random.Random(7)
    ids = [f"p{i}" for i in range(1, 201)]
    admitted = {pid: rng.randrange(20) for pid in ids}
    chosen = labelled_peers(ids, admitted)
    assert len(chosen) == MAX_PEER_SERIES == 64
    floor = min(admitted[p] for p in chosen)
    assert all(admitted[p] <= floor for p in ids if p not in chosen)
    tied = [p for p in ids if admitted[p] == floor]  # the cut falls inside this tie: earliest win
    assert [p for p in tied if p in chosen] == tied[:len([p for p in tied if p in chosen])]
    assert sorted(labelled_peers(ids[:5], {})) == sorted(ids[:5])


def test_lag_histograms_keep_their_buckets_whatever_the_lags():
    """A lag of a million (a peer's claim) lands in +Inf only: buckets stay as given, the count
    and sum take every group."""
    family = lag_histogram("echo2_dropped_group_lag_versions", "x",
                           Counter({3: 2, 5: 1, 10**6: 4}), range(3, 7))
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    assert buckets == {"3.0": 2, "4.0": 2, "5.0": 3, "6.0": 3, "+Inf": 7}
    assert [s.value for s in family.samples if s.name.endswith("_sum")] == [6 + 5 + 4 * 10**6]


def test_peer_sent_text_is_cut_to_a_safe_label():
    """A hostile name keeps only [A-Za-z0-9._-] and at most 32 characters."""
    assert label_text('evil"} 1\n# TYPE x counter<script>' * 3) == "evil___1___TYPE_x_counter_script"
    assert label_text("node-7.lab_a") == "node-7.lab_a"


def test_importance_ratio_gauges_have_a_series_per_lag_and_one_for_all():
    """A step record's by_lag becomes one labelled series per lag plus "all"; a record without
    diagnostics lists the families with no samples."""
    record = {"ratio_mean": 1.1, "ratio_min": 0.5, "ratio_max": 2.0, "clip_frac": 0.25,
              "by_lag": {"0": {"n_tokens": 3, "ratio_mean": 1.0, "ratio_min": 0.9,
                               "ratio_max": 1.1, "clip_frac": 0.0},
                         "2": {"n_tokens": 1, "ratio_mean": 1.4, "ratio_min": 1.4,
                               "ratio_max": 1.4, "clip_frac": 1.0}}}
    fams = {f.name: f for f in ratio_gauges(record)}
    assert value(fams, "echo2_importance_ratio_mean", lag="2") == 1.4
    assert value(fams, "echo2_importance_clip_ratio", lag="all") == 0.25
    assert value(fams, "echo2_importance_tokens", lag="0") == 3
    assert value(fams, "echo2_importance_tokens", lag="all") is None
    assert all(not f.samples for f in ratio_gauges({}))


def test_the_naming_check_sees_bad_names():
    """The rule check itself fails on a millisecond gauge, a _total gauge and upper case."""
    text = ("# HELP echo2_step_ms x\n# TYPE echo2_step_ms gauge\necho2_step_ms 1\n"
            "# HELP echo2_done_total x\n# TYPE echo2_done_total gauge\necho2_done_total 1\n"
            "# HELP echo2_Peers x\n# TYPE echo2_Peers gauge\necho2_Peers 1\n")
    assert len(naming_faults(families(text))) == 3


async def test_the_grafana_dashboard_names_only_exported_metrics(hub_cfg):
    """Every echo2_ name in examples/grafana-dashboard.json's PromQL is one the hub or a peer
    exports (from their families, listed even before they have a value)."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39
    assert any(v["type"] == "datasource" for v in dashboard["templating"]["list"])
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    targets = [t for p in panels for t in p.get("targets", [])]
    assert all(t["datasource"]["uid"] == "${datasource}" for t in targets)
    exprs = [t["expr"] for t in targets]
    used = {name for expr in exprs for name in re.findall(r"\becho2_[a-z0-9_]+", expr)}
    async with start_hub(hub_cfg, stream=None) as run, aiohttp.ClientSession() as http:
        hub_text = await scrape(http, f"http://127.0.0.1:{run.dashboard_port}/metrics")
    peer_text = generate_latest(peer_registry(PeerClient(PeerConfig()))).decode()
    assert naming_faults(families(peer_text)) == []
    assert len(used) >= 30 and used <= exported_names(hub_text, peer_text), \
        used - exported_names(hub_text, peer_text)

