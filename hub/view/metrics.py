"""Prometheus /metrics of a running hub, read from the run at scrape time (prometheus_client).

`RunCollector` turns what the hub keeps anyway into metric families at each scrape: the hub's
`statistics()` (its counters, the scorer's and the queue's) and `peer_views()`, the staleness of
what was trained
and of what was dropped, the last step record, the cost meter, the capacity estimates, the
newest logged propagation and per-peer series. Nothing is counted for Prometheus on the hub's
paths: a scrape only reads, and the one run log listener it adds keeps a reference to the
newest propagation and eval records.

Names: `echo2_` then the thing, in base units (`_seconds`, `_bytes`, dollars, `_ratio` for a
fraction), `_total` on counters only. The `echo2_peer_` names are a peer's own /metrics
(`echo2p2p.peer.metrics`); the hub's view of a peer is `echo2_hub_peer_...{peer="p3"}`.

Per-peer series are bounded: at most MAX_PEER_SERIES connected peers get a `peer` label, whose
value is the hub's id of the peer, never a name the peer sent. `labelled_peers` picks them: the
most admitted completions first, ties to the earliest joined; the others count in the totals
only (and in `echo2_peers_unlabelled`). A peer's name and engine appear in one info metric, cut
to `[A-Za-z0-9._-]` and 32 characters (`echo2p2p.runtime.prometheus`). With the hub's request
budget (`echo2p2p.request_budget`), its counts too: `echo2_http_requests_total{route}` and
`echo2_http_requests_limited_total{route,outcome}`. The exposition is built at most once a
moment (`hub.serving.http_limits.Recent`): a flood of scrapes costs one collection a second.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, InfoMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

from echo2p2p import messages as m
from echo2p2p.request_budget import OUTCOMES, RequestBudget
from echo2p2p.frame_budget import HUB_RATES
from echo2p2p.runtime.prometheus import gauge, label_text

from ..serving.http_limits import Recent

if TYPE_CHECKING:
    from ..serving.counters import HubStatistics, PeerView
    from .status import HubRun

MAX_PEER_SERIES = 64  # peers with series of their own; 1,000 peers would be 10,000 series
PEER_STATES = ("active", "standby", "quarantined")  # what `PeerView.state` says
DROPPED_BUCKETS = 4  # lags past S with a bucket of their own

# (name, help, HubStatistics field): running totals of the hub (hub.serving.counters).
HUB_COUNTERS = (
    ("echo2_admitted_groups", "Prompt groups admitted for training.", "admitted_groups"),
    ("echo2_admitted_rollouts", "Completions admitted (the samples of admitted groups).",
     "admitted_samples"),
    ("echo2_rejected_submissions", "Rollout submissions rejected (not stale ones).", "rejected"),
    ("echo2_duplicate_submissions", "Submissions of a lease already answered.", "duplicates"),
    ("echo2_protocol_closes", "Peer connections closed for breaking the protocol.",
     "closed_for_protocol"),
    ("echo2_refused_joins", "Joins refused (no valid token, too many from one address).",
     "refused"),
    ("echo2_cut_off_peers", "Peers cut off because they stopped reading.", "cut_off"),
    ("echo2_joins_too_often", "Connections and hellos refused by the join limits (per "
     "address, network, key, token, and the hub's join budget).", "joins_too_often"),
    ("echo2_flood_closes", "Peer connections closed for sending one kind of frame far past "
     "its rate.", "closed_for_flooding"),
    ("echo2_catch_up_builds", "Catch-up deltas encoded.", "catch_up_builds"),
    ("echo2_catch_up_shared", "Catch-up deltas a peer got from another's encode.",
     "catch_up_shared"),
    ("echo2_spot_checks", "Submissions whose logprobs or version tag were checked.",
     "spot_checked"),
    ("echo2_spot_check_failures", "Spot-checked submissions found forged.", "spot_failed"),
    ("echo2_withdrawn_groups", "Admitted groups withdrawn untrained: their peer was quarantined.",
     "withdrawn_groups"),
)
# (name, help, ScorerStats field): the hub's reward workers.
SCORER_COUNTERS = (
    ("echo2_score_calls", "Batches of completions sent to the hub's scorer.", "calls"),
    ("echo2_scored_completions", "Completions the hub's scorer scored (or gave up on).",
     "completions"),
    ("echo2_score_timeouts", "Completions whose reward was killed at its deadline.", "timeouts"),
    ("echo2_score_failures", "Completions whose reward raised or was not finite.", "failures"),
    ("echo2_scorer_restarts", "Reward worker processes started to replace a dead one.",
     "restarts"),
)
# (run log key, name, help): the last learner step's record.
STEP_GAUGES = (
    ("train/reward_mean", "echo2_reward_mean", "Mean reward (the hub's scores) of the last step."),
    ("train/reward_std", "echo2_reward_std", "Standard deviation of the last step's rewards."),
    ("train/loss", "echo2_train_loss", "The last step's loss."),
    ("train/kl", "echo2_train_kl", "The last step's KL estimate against the reference."),
    ("train/grad_norm", "echo2_train_grad_norm", "The last step's gradient norm, before clipping."),
    ("train/clip_frac", "echo2_train_clip_ratio", "Share of trained tokens the ratio clip hit."),
    ("train/step_s", "echo2_train_step_seconds", "Seconds of the last step's forward, backward "
                                                 "and optimiser."),
    ("train/tokens_per_s", "echo2_train_tokens_per_second", "Tokens trained per second, last step."),
    ("hub/learner_busy_frac", "echo2_learner_busy_ratio", "Share of the last 60 s the learner "
                                                          "did not wait for rollouts (run log's)."),
    ("rollout/per_s", "echo2_admitted_rollouts_per_second", "Completions admitted per second over "
                                                            "the last 60 s (the run log's)."),
    ("rollout/staleness_mean", "echo2_trained_lag_mean_versions", "Mean lag, in versions, of the "
                                                                  "groups the last step trained on."),
    ("time_s", "echo2_train_elapsed_seconds", "Seconds of learner loop over the run (a resumed "
                                              "run's go on from its checkpoint's)."),
    ("mismatch_kl", "echo2_mismatch_kl", "Engine mismatch of the last step: mean k3 KL (nats) "
                    "of the peers' logprobs from the learner's, on lag-0 tokens."),
    ("mismatch_abs_mean", "echo2_mismatch_abs_logprob_mean", "Mean |learner - peer| logprob "
                          "(nats) of the last step's lag-0 tokens."),
    ("mismatch_abs_max", "echo2_mismatch_abs_logprob_max", "Largest |learner - peer| logprob "
                         "(nats) of the last step's lag-0 tokens."),
)
# (by_lag key, name, help): the last step's importance ratios, one series per lag ("all": the
# step's every trained token); at most S + 2 series, lags past S are never trained.
RATIO_GAUGES = (
    ("ratio_mean", "echo2_importance_ratio_mean", "Mean pi_learner / pi_behaviour of the last "
                                                  "step's trained tokens, by lag."),
    ("ratio_min", "echo2_importance_ratio_min", "Smallest importance ratio of the last step."),
    ("ratio_max", "echo2_importance_ratio_max", "Largest importance ratio of the last step."),
    ("clip_frac", "echo2_importance_clip_ratio", "Share of the last step's trained tokens "
                                                 "whose ratio is outside 1 +- clip_eps."),
    ("n_tokens", "echo2_importance_tokens", "Trained tokens of the last step, by lag."),
)
# (capacity_metrics key, name, help)
CAPACITY_GAUGES = (
    ("capacity/train_step_s", "echo2_capacity_train_step_seconds",
     "T_train, the EWMA of the learner loop's time per step, waiting for rollouts aside."),
    ("capacity/bcast_s", "echo2_capacity_bcast_seconds", "T_bcast, the EWMA of a version's "
                                                         "broadcast."),
    ("capacity/gen_rollouts_per_s", "echo2_capacity_gen_rollouts_per_second",
     "Completions per second the active peers make while busy, summed (not the admitted rate)."),
    ("capacity/required_rollouts_per_s", "echo2_capacity_required_rollouts_per_second",
     "Completions per second the capacity model asks the active peers for."),
    ("capacity/predicted_busy_frac", "echo2_capacity_predicted_busy_ratio",
     "Learner busy share the capacity model predicts for the active peers."),
)


def labelled_peers(peer_ids: Iterable[str], admitted: Mapping[str, int],
                   limit: int = MAX_PEER_SERIES) -> list[str]:
    """The peers that get series of their own: the `limit` with the most admitted completions,
    ties to the earliest joined (`peer_ids` in join order, as `Hub.peer_views()` gives them)."""
    return heapq.nsmallest(limit, peer_ids, key=lambda pid: -admitted.get(pid, 0))  # stable


class RecordWatch:
    """The newest propagation and evaluation records, as the run log hands them on."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.propagation: dict[str, Any] | None = None  # only ever in the run log's events
        self.evaluation = next((r for r in reversed(records) if "eval/accuracy" in r), None)

    def __call__(self, record: dict[str, Any]) -> None:
        if record.get("event") == "propagation":
            self.propagation = record
        elif "eval/accuracy" in record:
            self.evaluation = record


class RunCollector:
    """Reads the run each scrape: nothing is counted twice, nothing on the hub's hot paths."""

    def __init__(self, run: HubRun, watch: RecordWatch, max_peer_series: int = MAX_PEER_SERIES,
                 budget: RequestBudget | None = None):
        self.run, self.watch, self.max_peer_series = run, watch, max_peer_series
        self.budget = budget

    def collect(self) -> Iterator[Metric]:
        stats = self.run.hub.statistics()
        yield from self._hub(stats)
        yield from self._staleness(stats)
        yield from self._last_step()
        yield from self._cost(stats)
        yield from self._propagation()
        yield from self._peers()
        if self.budget is not None:
            yield from http_families(self.budget)

    def _hub(self, stats: HubStatistics) -> Iterator[Metric]:
        hub, cfg = self.run.hub, self.run.cfg
        yield InfoMetricFamily("echo2_run", "The run this hub trains.",
                               value={"run_id": label_text(hub.core.run_id)})
        yield gauge("echo2_step", "The learner's step (the newest version trained).", stats.step)
        yield gauge("echo2_published_version", "The newest version published to peers.",
                     stats.newest_version)
        yield gauge("echo2_training", "1 while a learner step runs, else 0.", int(stats.training))
        yield gauge("echo2_max_lag_versions", "S: the most versions a trained rollout may lag.",
                     cfg.staleness.max_lag)
        yield gauge("echo2_publish_every_steps", "kappa: a version is published every this many "
                                                  "steps.", cfg.staleness.kappa)
        yield gauge("echo2_queued_groups", "Admitted groups waiting for the learner.",
                     stats.queued_groups)
        yield gauge("echo2_open_leases", "Leases granted and not yet answered.", stats.open_leases)
        yield gauge("echo2_judging_submissions", "Submissions being scored or spot-checked.",
                     stats.judging)
        for name, doc, field in HUB_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        stale = CounterMetricFamily("echo2_stale_groups", "Groups dropped as too stale to train: "
                                    "on arrival, or aged out in the queue.", labels=["where"])
        stale.add_metric(["arrival"], stats.stale_on_arrival)
        stale.add_metric(["queue"], stats.stale_in_queue)
        yield stale
        rejected = CounterMetricFamily("echo2_groups_rejected", "Groups turned away (stale ones "
                                       "included), by the hub's reason.", labels=["reason"])
        for reason, n in sorted(stats.rejected_by.items()):  # the hub's own words: bounded
            rejected.add_metric([reason], n)
        yield rejected
        dropped = CounterMetricFamily("echo2_frames_dropped", "Frames from peers dropped past "
                                      "their kind's rate (echo2p2p.frame_budget).",
                                      labels=["kind"])
        for kind in HUB_RATES:  # the only kinds with a rate
            dropped.add_metric([kind], stats.frames_dropped.get(kind, 0))
        yield dropped
        relays = CounterMetricFamily("echo2_relay_reports", "Accusations of a relay heard from "
                                     "peers, by fault.", labels=["reason"])
        for reason in m.RELAY_FAULTS:  # the only reasons the hub keeps
            relays.add_metric([reason], sum(n for (_, r), n in stats.relay_reports_by.items()
                                            if r == reason))
        yield relays
        if stats.scoring is not None:
            for name, doc, field in SCORER_COUNTERS:
                yield CounterMetricFamily(name, doc, value=getattr(stats.scoring, field))

    def _staleness(self, stats: HubStatistics) -> Iterator[Metric]:
        """Lags in versions (learner step minus the rollout's version) as histograms: of the
        groups trained on, a bucket per lag up to S (none lags more); of the groups dropped as
        too stale, a bucket per lag from S + 1 to S + DROPPED_BUCKETS, the rest in +Inf only (a
        peer can make a lag as large as it likes: the series stay bounded)."""
        s = self.run.cfg.staleness.max_lag
        yield lag_histogram("echo2_trained_group_lag_versions", "Lag of the groups trained on.",
                            self.run.runlog.staleness, range(s + 1))
        yield lag_histogram("echo2_dropped_group_lag_versions", "Lag of the groups dropped as "
                            "too stale (on arrival or in the queue).",
                            stats.dropped_lags,
                            range(s + 1, s + 1 + DROPPED_BUCKETS))

    def _last_step(self) -> Iterator[Metric]:
        records = self.run.records
        last = records[-1] if records and "step" in records[-1] else {}
        for key, name, doc in STEP_GAUGES:
            yield gauge(name, doc, last.get(key))
        yield from ratio_gauges(last)
        evaluation = self.watch.evaluation or {}
        yield gauge("echo2_eval_accuracy", "Held-out reward of the newest evaluated version.",
                     evaluation.get("eval/accuracy"))
        yield gauge("echo2_eval_version", "The version the held-out reward was measured on.",
                     evaluation.get("version"))
        capacity = self.run.capacity_metrics()
        for key, name, doc in CAPACITY_GAUGES:
            yield gauge(name, doc, capacity.get(key))

    def _cost(self, stats: HubStatistics) -> Iterator[Metric]:
        meter = stats.cost
        yield CounterMetricFamily("echo2_cost_dollars", "Dollars accrued by active peers at their "
                                  "declared prices (peers gone included).",
                                  value=meter["cost/usd_total"])
        yield gauge("echo2_cost_dollars_per_hour", "What the active peers cost now.",
                     meter["cost/usd_per_hour"])
        per_1k = meter["cost/usd_per_1k_rollouts"]
        yield gauge("echo2_cost_dollars_per_rollout", "Dollars so far per admitted completion.",
                     None if per_1k is None else per_1k / 1000)
        yield gauge("echo2_cost_lp_bound_dollars_per_hour", "The LP relaxation's lower bound on "
                     "what the required throughput costs.", stats.lp_bound_usd_per_hour)

    def _propagation(self) -> Iterator[Metric]:
        """The newest propagation record: how the last version that spread did."""
        r = self.watch.propagation or {}
        yield gauge("echo2_propagation_version", "The version the echo2_propagation_ metrics "
                     "describe: the newest whose spread was logged.", r.get("version"))
        yield gauge("echo2_propagation_peers", "Peers expected to fetch that version.",
                     r.get("peers"))
        reach = GaugeMetricFamily("echo2_propagation_seconds", "Seconds from publication until "
                                  "this share of the expected peers had all of its chunks.",
                                  labels=["share"])
        for share, key in (("0.5", "t50_s"), ("0.9", "t90_s"), ("1", "t100_s")):
            if r.get(key) is not None:
                reach.add_metric([share], r[key])
        yield reach
        yield gauge("echo2_propagation_bcast_seconds", "T_bcast of that version: until 90 % of "
                     "the expected peers generated with it (reload included).", r.get("t_bcast_s"))
        sources = GaugeMetricFamily("echo2_propagation_bytes", "Chunk bytes of that version "
                                    "served by the hub and, as peers report, by peers.",
                                    labels=["source"])
        if r:
            sources.add_metric(["hub"], r["bytes_from_hub"])
            sources.add_metric(["peers"], r["bytes_from_peers"])
        yield sources

    def _peers(self) -> Iterator[Metric]:
        views = list(self.run.hub.peer_views().values())
        states = [view.state for view in views]
        by_state = GaugeMetricFamily("echo2_peers", "Connected peers by state.", labels=["state"])
        for state in PEER_STATES:
            by_state.add_metric([state], states.count(state))
        yield by_state
        by_id = {view.peer_id: view for view in views}
        chosen = labelled_peers(by_id, {v.peer_id: v.account.get("admitted", 0) for v in views},
                                self.max_peer_series)
        yield gauge("echo2_peers_unlabelled", "Connected peers without echo2_hub_peer_ series "
                     f"(only the {self.max_peer_series} most admitted have them).",
                     len(views) - len(chosen))
        yield from _peer_series([by_id[p] for p in chosen])


def _peer_series(views: list[PeerView]) -> Iterator[Metric]:
    """The hub's view of each of `views`, one series per family each."""
    info = InfoMetricFamily("echo2_hub_peer", "What a peer says it is (cut to a safe label).",
                            labels=["peer"])
    state = GaugeMetricFamily("echo2_hub_peer_state", "1 for the peer's state.",
                              labels=["peer", "state"])
    families = {key: cls(name, doc, labels=["peer"]) for key, (cls, name, doc) in {
        "held": (GaugeMetricFamily, "echo2_hub_peer_held_version", "The version a peer serves."),
        "gen": (GaugeMetricFamily, "echo2_hub_peer_gen_rollouts_per_second",
                "A peer's completions per second while busy, over the last 60 s."),
        "admitted_rate": (GaugeMetricFamily, "echo2_hub_peer_admitted_rollouts_per_second",
                          "A peer's completions admitted per second, over the last 60 s."),
        "upload": (GaugeMetricFamily, "echo2_hub_peer_upload_bytes_per_second",
                   "A peer's upload as other peers measured it (0 until known)."),
        "trust": (GaugeMetricFamily, "echo2_hub_peer_trust", "A peer's trust score (1 = clean)."),
        "price": (GaugeMetricFamily, "echo2_hub_peer_price_dollars_per_hour",
                  "The price a peer declared."),
        "silent": (GaugeMetricFamily, "echo2_hub_peer_silent_seconds",
                   "Seconds since the hub last heard from a peer."),
        "usd": (CounterMetricFamily, "echo2_hub_peer_cost_dollars", "Dollars a peer accrued."),
        "admitted": (CounterMetricFamily, "echo2_hub_peer_admitted_rollouts",
                     "Completions of a peer admitted."),
    }.items()}
    for view in views:
        pid, account = view.peer_id, view.account
        info.add_metric([pid], {"name": label_text(view.name), "engine": label_text(view.engine)})
        state.add_metric([pid, view.state], 1)
        values = {"held": view.held_version, "gen": account.get("gen_rollouts_per_s"),
                  "admitted_rate": account.get("admitted_per_s"),
                  "upload": view.upload_bps / 8, "trust": view.trust,
                  "price": account.get("price_per_hour"), "silent": view.silent_s,
                  "usd": account.get("usd"), "admitted": account.get("admitted")}
        for key, value in values.items():
            if value is not None:
                families[key].add_metric([pid], value)
    yield info
    yield state
    yield from families.values()


def lag_histogram(name: str, doc: str, lags: Counter[int], bounds: range) -> Metric:
    """A histogram of `lags` (lag -> groups) with a bucket at each of `bounds` and +Inf."""
    buckets = [(floatToGoString(b), sum(n for lag, n in lags.items() if lag <= b)) for b in bounds]
    return HistogramMetricFamily(name, doc, buckets=[*buckets, ("+Inf", sum(lags.values()))],
                                 sum_value=sum(lag * n for lag, n in lags.items()))


def ratio_gauges(record: Mapping[str, Any]) -> Iterator[Metric]:
    """The importance-ratio gauges of a step record, labelled by lag (and "all")."""
    by_lag = {**record.get("by_lag", {}), "all": record}
    for key, name, doc in RATIO_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["lag"])
        for lag, values in by_lag.items():
            if values.get(key) is not None:
                family.add_metric([lag], values[key])
        yield family


def http_families(budget: RequestBudget) -> Iterator[Metric]:
    """The hub's HTTP request budget: requests served and limited, by route class (a handful:
    `echo2p2p.request_budget`) and outcome; requests open now."""
    stats = budget.statistics()
    served = CounterMetricFamily("echo2_http_requests", "HTTP requests served (websocket "
                                 "upgrades aside), by route class.", labels=["route"])
    limited = CounterMetricFamily("echo2_http_requests_limited", "HTTP requests over their "
                                  "address's budget: delayed (served late), refused (429) or "
                                  "dropped (429 and the connection closed).",
                                  labels=["route", "outcome"])
    for route in budget.limits:
        served.add_metric([route], stats.served.get(route, 0))
        for outcome in OUTCOMES:
            limited.add_metric([route, outcome], stats.limited.get((route, outcome), 0))
    yield served
    yield limited
    yield gauge("echo2_http_requests_open", "HTTP requests being answered or waiting their "
                 "turn.", stats.open)


def metrics_handler(run: HubRun, max_peer_series: int = MAX_PEER_SERIES,
                    budget: RequestBudget | None = None
                    ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /metrics: the text exposition of `run`'s metrics, with at most `max_peer_series`
    peers' own series and `budget`'s counts, collected at most once a moment."""
    watch = RecordWatch(run.records)
    run.runlog.listeners.append(watch)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(run, watch, max_peer_series, budget))
    recent = Recent()

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=recent.get("metrics", lambda: generate_latest(registry)),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle
