/* echo2p2p's dashboard page: draws the hub's api/snapshot with uPlot and keeps it live from the
 * events stream (server-sent events), refetching the snapshot when the hub it talks to is a new
 * run or restarted behind it. Knows only the JSON shapes of the dashboard's contract, nothing of
 * the hub. Every field a peer sent is hostile: its text reaches the page only through
 * textContent, cut to a bound and stripped of control and direction characters, and a number
 * that is not finite shows as "–". Keeps at most MAX_POINTS points per series (halved by
 * pairwise means beyond), draws at most once per animation frame, and shows the first
 * TABLE_ROWS peers of the sorted, filtered table. `window.dashboard` exposes the state, the
 * charts and timings for the tests and benches.
 * Over 400 lines: index.html loads one script of ours (no build step, no modules), in three
 * parts: the run's state and its events, the peers table, the charts. */
(function () {
  "use strict";

  const MAX_POINTS = 4000;
  const TABLE_ROWS = 200;
  const MAX_VERSIONS = 200;  // the propagation records kept, as the snapshot keeps them
  const CDF_VERSIONS = 5;
  const PLOT_HEIGHT = 210;  // pixels of a chart's canvas, axes included; its legend goes below
  const TEXT_MAX = 48;  // characters of a peer's name or engine shown
  const STEP_KEYS = ["step", "time_s", "reward", "busy", "rollouts_per_s", "staleness_mean",
    "usd_total", "usd_per_hour", "mismatch_kl", "ratio_mean", "clip_frac"];
  const PEER_STATES = ["active", "standby", "quarantined"];
  const BLUE = "#1f6fb4", ORANGE = "#e07b12", GREEN = "#2b9348", RED = "#c0392b", PURPLE = "#7b4fb3";

  const token = new URLSearchParams(location.search).get("token");
  const withToken = (path) => token ? path + "?token=" + encodeURIComponent(token) : path;

  const state = {
    runId: null, step: null, maxLag: null, kappa: null,
    steps: emptySteps(), last: null, evals: {version: [], accuracy: []}, versions: [],
    staleness: {trained: {}, dropped: {}}, status: null,
    sort: {key: "name", dir: 1}, filter: "",
  };
  // What the page spent, in ms (performance.now()): per event kind, applying its last event
  // and the draw that followed; the first full render counts from the navigation's start.
  const timings = {snapshot_bytes: 0, snapshot_ms: null, first_render_ms: null, table_ms: null,
    events: {}};
  const undrawn = new Set();  // event kinds applied since the last draw
  let loading = false, reloadWanted = false;
  const pending = [];  // events that came while a snapshot was on its way
  const dirty = new Set();

  // ---- hostile values ----

  function num(v) { return typeof v === "number" && isFinite(v) ? v : null; }

  function fixed(v, digits) { v = num(v); return v === null ? "–" : v.toFixed(digits); }

  /** A rate as every view writes it (echo2p2p/rates.py, rate_text): one decimal from 1/s, none
   * from 100/s, two significant figures below 1/s (a peer at 0.4/s shows 0.4, not 0). */
  function rate(v) {
    v = num(v);
    if (v === null) return "–";
    const size = Math.abs(v);
    if (size >= 100) return v.toFixed(0);
    if (size >= 1) return v.toFixed(1);
    return String(Number(v.toPrecision(2)));
  }

  function peerText(v) {
    const s = (typeof v === "string" ? v : "").replace(/[\u0000-\u001f\u007f-\u009f\u200e\u200f\u202a-\u202e\u2066-\u2069]/g, "");
    return s.length > TEXT_MAX ? s.slice(0, TEXT_MAX - 1) + "…" : s;
  }

  function bytes(v) {
    v = num(v);
    if (v === null) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
    return (i === 0 ? v.toFixed(0) : String(Number(v.toPrecision(3)))) + " " + units[i];
  }

  function usd(v, digits) { v = num(v); return v === null ? "–" : "$" + v.toFixed(digits); }

  // ---- the run's history ----

  function emptySteps() {
    const steps = {};
    STEP_KEYS.forEach((k) => { steps[k] = []; });
    return steps;
  }

  function pairMean(a, b) {
    if (a === null) return b;
    if (b === null) return a;
    return (a + b) / 2;
  }

  /** Halve every column of `columns` (equal lengths) by pairwise means while over MAX_POINTS. */
  function keepBounded(columns) {
    const keys = Object.keys(columns);
    while (columns[keys[0]].length > MAX_POINTS) {
      keys.forEach((k) => {
        const a = columns[k], out = [];
        for (let i = 0; i + 1 < a.length; i += 2) out.push(pairMean(a[i], a[i + 1]));
        if (a.length % 2) out.push(a[a.length - 1]);
        columns[k] = out;
      });
    }
  }

  function applySnapshot(snap) {
    state.runId = peerText(snap.run_id);
    state.step = num(snap.step);
    state.maxLag = num(snap.max_lag);
    state.kappa = num(snap.kappa);
    state.steps = emptySteps();
    STEP_KEYS.forEach((k) => {
      state.steps[k] = ((snap.steps || {})[k] || []).map(num);
    });
    keepBounded(state.steps);
    const n = state.steps.step.length;
    state.last = n ? Object.fromEntries(STEP_KEYS.map((k) => [k, state.steps[k][n - 1]])) : null;
    const evals = snap.evals || {};
    state.evals = {version: (evals.version || []).map(num), accuracy: (evals.accuracy || []).map(num)};
    keepBounded(state.evals);
    state.versions = (snap.versions || []).slice(-MAX_VERSIONS);
    state.staleness = staleness(snap.staleness || {});
    state.status = snap.status || null;
    markDirty("charts", "tiles", "table");
  }

  function staleness(totals) { return {trained: counts(totals.trained), dropped: counts(totals.dropped)}; }

  function counts(groups) {
    const out = {};
    Object.entries(groups || {}).forEach(([lag, n]) => {
      if (/^\d{1,4}$/.test(lag) && num(n) !== null) out[lag] = n;
    });
    return out;
  }

  function addCounts(into, groups) {
    Object.entries(counts(groups)).forEach(([lag, n]) => { into[lag] = (into[lag] || 0) + n; });
  }

  function applyStep(point) {
    const step = num(point.step);
    const steps = state.steps;
    const lastStep = steps.step.length ? steps.step[steps.step.length - 1] : null;
    if (step === null || (lastStep !== null && step <= lastStep)) return;  // in the snapshot already
    STEP_KEYS.forEach((k) => { steps[k].push(num(point[k])); });
    keepBounded(steps);
    state.last = Object.fromEntries(STEP_KEYS.map((k) => [k, num(point[k])]));
    state.step = step + 1;  // the hub's step counts the steps done
    addCounts(state.staleness.trained, point.staleness);
    markDirty("charts", "tiles");
  }

  function applyEval(e) {
    const version = num(e.version), evals = state.evals;
    if (version === null) return;
    const at = evals.version.indexOf(version);
    if (at >= 0) { evals.accuracy[at] = num(e.accuracy); } else {
      evals.version.push(version);
      evals.accuracy.push(num(e.accuracy));
    }
    keepBounded(evals);
    markDirty("charts", "tiles");
  }

  function applyVersion(record) {
    const version = num(record.version);
    if (version === null) return;
    const at = state.versions.findIndex((r) => r.version === version);
    if (at >= 0) { state.versions[at] = record; } else { state.versions.push(record); }
    state.versions = state.versions.slice(-MAX_VERSIONS);
    markDirty("charts");
  }

  function applyStatus(status) {
    state.status = status;
    markDirty("tiles", "table");
    const totals = status && status.staleness ? staleness(status.staleness) : null;  // the run's
    if (totals && JSON.stringify(totals) !== JSON.stringify(state.staleness)) {
      state.staleness = totals;
      markDirty("charts");
    }
  }

  const HANDLERS = {step: applyStep, eval: applyEval, version: applyVersion, status: applyStatus};

  function onEvent(kind, data) {
    if (loading) { pending.push([kind, data]); return; }
    const start = performance.now();
    HANDLERS[kind](data);
    timings.events[kind] = {apply_ms: performance.now() - start, draw_ms: null};
    undrawn.add(kind);
  }

  // ---- drawing ----

  function markDirty(...parts) {
    const first = dirty.size === 0;
    parts.forEach((p) => dirty.add(p));
    if (first) requestAnimationFrame(draw);
  }

  function draw() {
    const start = performance.now();
    if (dirty.has("charts")) drawCharts();
    if (dirty.has("tiles")) drawTiles();
    if (dirty.has("table")) drawTable();
    dirty.clear();
    undrawn.forEach((kind) => { timings.events[kind].draw_ms = performance.now() - start; });
    undrawn.clear();
    if (timings.first_render_ms === null && state.runId !== null) timings.first_render_ms = performance.now();
  }

  function setText(id, value) { document.getElementById(id).textContent = value; }

  function drawTiles() {
    const last = state.last || {}, status = state.status || {}, cost = status.cost || {};
    setText("run-id", state.runId || "–");
    setText("max-lag", state.maxLag === null ? "–" : state.maxLag);
    setText("kappa", state.kappa === null ? "–" : state.kappa);
    setText("tile-step", fixed(last.step, 0));
    setText("tile-version", fixed(status.published_version, 0));
    setText("tile-reward", fixed(last.reward, 3));
    const n = state.evals.version.length;
    setText("tile-accuracy", n ? fixed(state.evals.accuracy[n - 1], 3) : "–");
    setText("tile-accuracy-version", n ? "v" + fixed(state.evals.version[n - 1], 0) : "");
    setText("tile-evaluating", evaluating(status.evaluating));
    setText("tile-busy", num(last.busy) === null ? "–" : (100 * last.busy).toFixed(0) + " %");
    setText("tile-rate", rate(last.rollouts_per_s));
    const byState = {active: 0, standby: 0, quarantined: 0};
    Object.values(status.peers || {}).forEach((p) => { if (p && p.state in byState) byState[p.state] += 1; });
    setText("tile-peers", PEER_STATES.map((s) => byState[s]).join(" · "));
    setText("tile-usd-hour", usd(pick(cost["cost/usd_per_hour"], last.usd_per_hour), 3));
    setText("tile-usd-total", usd(pick(cost["cost/usd_total"], last.usd_total), 4));
    setText("tile-usd-1k", usd(cost["cost/usd_per_1k_rollouts"], 4));
    // No requirement, no bound: the capacity model's own sentence says why (e.g. no step
    // timed yet, or a broadcast slower than a publication period).
    const why = (status.capacity || {})["capacity/required_why"];
    setText("tile-lp-bound", usd(cost.lp_bound_usd_per_hour, 3));
    setText("tile-lp-why", num(cost.lp_bound_usd_per_hour) === null && typeof why === "string"
      ? "no required rate: " + peerText(why) : "");
  }

  function pick(v, otherwise) { return num(v) === null ? otherwise : v; }

  /** "evaluating v0: 128/200" for the status's evaluation under way; "" when none runs. */
  function evaluating(e) {
    if (!e || typeof e !== "object") return "";
    const version = num(e.version), done = num(e.done), total = num(e.total);
    if (version === null || done === null || total === null) return "";
    return "evaluating v" + version.toFixed(0) + ": " + done.toFixed(0) + "/" + total.toFixed(0);
  }

  // ---- the connection ----

  function setConnection(kind, reason) {
    const el = document.getElementById("connection");
    el.className = "connection " + kind;
    el.textContent = reason ? kind + ": " + peerText(reason) : kind;
  }

  async function loadSnapshot() {
    if (loading) { reloadWanted = true; return; }  // one at a time: the later one is newer
    loading = true;
    const start = performance.now();
    try {
      const response = await fetch(withToken("api/snapshot"), {cache: "no-store"});
      const body = await response.text();
      if (!response.ok) { setConnection("refused", response.status + " " + body.split("\n")[0]); return; }
      timings.snapshot_bytes = body.length;
      applySnapshot(JSON.parse(body));
      timings.snapshot_ms = performance.now() - start;
    } catch (err) {
      setConnection("reconnecting");
    } finally {
      loading = false;
      if (reloadWanted) {
        reloadWanted = false;
        loadSnapshot();
      } else {
        pending.splice(0).forEach(([kind, data]) => onEvent(kind, data));
      }
    }
  }

  function onHello(hello) {
    setConnection("live");
    // A new run, a restarted hub (its step lower than ours) or steps missed while away.
    if (hello.run_id !== state.runId || hello.step !== state.step) loadSnapshot();
  }

  function connect() {
    const source = new EventSource(withToken("events"));
    source.addEventListener("hello", (e) => onHello(JSON.parse(e.data)));
    Object.keys(HANDLERS).forEach((kind) => {
      source.addEventListener(kind, (e) => onEvent(kind, JSON.parse(e.data)));
    });
    source.onerror = () => {
      setConnection("reconnecting");
      if (source.readyState === EventSource.CLOSED) {  // refused (not 200): EventSource gives up
        setTimeout(connect, 2000);
        loadSnapshot();  // shows why, if the hub says
      }
    };
  }

  window.dashboard = {state, timings, charts: {},
    lengths: () => ({steps: state.steps.step.length, evals: state.evals.version.length,
      versions: state.versions.length, peers: Object.keys((state.status || {}).peers || {}).length,
      rows: document.querySelectorAll("#peers tbody tr").length})};

  // ======== peers table ========

  const COLUMNS = [
    {key: "name", text: true}, {key: "engine", text: true},
    {key: "held_version", show: (v) => fixed(v, 0)},
    {key: "admitted_per_s", show: rate},
    {key: "gen_rollouts_per_s", show: rate},
    {key: "upload_mbps", show: (v) => fixed(v, 1)},
    {key: "trust", show: (v) => fixed(v, 3)},
    {key: "price_per_hour", show: (v) => usd(v, 3)},
    {key: "usd", show: (v) => usd(v, 4)},
    {key: "state", text: true},
    {key: "last_seen_s", show: (v) => num(v) === null ? "–" : v.toFixed(1) + " s ago"},
  ];

  function peerRows() {
    return Object.values((state.status || {}).peers || {}).map((p) => {
      const row = {};
      COLUMNS.forEach((c) => { row[c.key] = c.text ? peerText(p[c.key]) : num(p[c.key]); });
      if (!PEER_STATES.includes(row.state)) row.state = "";
      return row;
    });
  }

  function compareRows(key, dir) {
    return (a, b) => {
      const x = a[key], y = b[key];
      if (x === y) return 0;
      if (x === null || x === "") return 1;  // blanks last either way
      if (y === null || y === "") return -1;
      return dir * (typeof x === "string" ? x.localeCompare(y) : x - y);
    };
  }

  function drawTable() {
    const start = performance.now();
    const filter = state.filter.toLowerCase();
    const all = peerRows();
    const rows = filter ? all.filter((r) => (r.name + " " + r.engine + " " + r.state).toLowerCase().includes(filter)) : all;
    rows.sort(compareRows(state.sort.key, state.sort.dir));
    const body = document.querySelector("#peers tbody"), shown = rows.slice(0, TABLE_ROWS);
    // The rows stay and only changed cells are rewritten: a status of 1,000 peers every 2 s
    // costs a sort and a few text writes, not 2,000 new elements.
    while (body.rows.length < shown.length) body.appendChild(emptyRow());
    while (body.rows.length > shown.length) body.lastChild.remove();
    shown.forEach((r, i) => fillRow(body.rows[i], r));
    document.querySelectorAll("#peers th").forEach((th) => {
      const on = th.dataset.key === state.sort.key;
      th.classList.toggle("sorted", on);
      th.classList.toggle("up", on && state.sort.dir > 0);
      th.classList.toggle("down", on && state.sort.dir < 0);
    });
    setText("peer-count", rows.length > shown.length
      ? `the first ${shown.length} of ${rows.length}` + (filter ? " matching" : "")
      : `${rows.length} ${rows.length === 1 ? "peer" : "peers"}` + (filter ? ` of ${all.length}` : ""));
    timings.table_ms = performance.now() - start;
  }

  function emptyRow() {
    const tr = document.createElement("tr");
    COLUMNS.forEach((c) => {
      const td = document.createElement("td");
      if (!c.text) td.className = "num";
      tr.appendChild(td);
    });
    return tr;
  }

  function fillRow(tr, r) {
    COLUMNS.forEach((c, i) => {
      const td = tr.cells[i], shown = c.text ? r[c.key] : c.show(r[c.key]);
      if (td.textContent !== shown) td.textContent = shown;
    });
    const stateCell = tr.cells[COLUMNS.findIndex((c) => c.key === "state")];
    stateCell.className = r.state ? "state state-" + r.state : "";
    tr.cells[0].title = r.name;
  }

  function setUpTable() {
    document.querySelectorAll("#peers th").forEach((th) => {
      th.addEventListener("click", () => {
        const key = th.dataset.key;
        state.sort = {key, dir: state.sort.key === key ? -state.sort.dir : (COLUMNS.find((c) => c.key === key).text ? 1 : -1)};
        markDirty("table");
      });
    });
    document.getElementById("peer-filter").addEventListener("input", (e) => {
      state.filter = e.target.value;
      markDirty("table");
    });
  }

  // ======== charts ========

  const charts = window.dashboard.charts;

  /** A y axis as wide as its longest tick label (11px text: ~6.5 px a character), plus the
   * rotated label and the ticks. */
  function fitted(u, values) {
    const longest = Math.max(3, ...(values || []).map((v) => String(v).length));
    return Math.ceil(longest * 6.5) + 30;
  }

  function axis(label, values, extra) {
    return Object.assign({label, labelSize: 18, size: fitted, stroke: "#3a4250",
      grid: {stroke: "#eceef2", width: 1}, ticks: {stroke: "#d4d8df", width: 1},
      font: "11px system-ui, sans-serif", labelFont: "12px system-ui, sans-serif"},
    values ? {values: (u, splits) => splits.map(values)} : {}, extra || {});
  }

  const xAxis = (label) => axis(label, null, {size: 40});
  const integers = (u, splits) => splits.map((v) => Number.isInteger(v) ? String(v) : "");
  const small = (v) => (v > 0 && v < 0.01 ? v.toExponential(1) : v.toPrecision(2));

  function line(label, stroke, extra) {
    return Object.assign({label, stroke, width: 2, points: {show: false}, spanGaps: true}, extra || {});
  }

  function bars(label, fill, align) {
    return {label, stroke: fill, fill, width: 1, points: {show: false},
      paths: uPlot.paths.bars({size: [0.42, 36], align})};
  }

  const padded = (u, min, max) => (min === null ? [0, 1] : [min - 0.5, max + 0.5]);

  /** Charts, each: series (legend), axes, scales and the aligned data it draws now. */
  const CHARTS = {
    "chart-reward": () => ({
      series: [{label: "step"}, line("reward (train)", BLUE),
        line("held-out accuracy", ORANGE, {points: {show: true, size: 6, fill: ORANGE}})],
      axes: [xAxis("step"), axis("reward / accuracy")],
      scales: {y: {range: (u, min, max) => [Math.min(0, min ?? 0), Math.max(1, max ?? 1)]}},
      data: uPlot.join([[state.steps.step, state.steps.reward], [state.evals.version, state.evals.accuracy]]),
    }),
    "chart-busy": () => ({
      series: [{label: "step"}, line("learner busy", GREEN, {fill: "rgba(43,147,72,0.12)"})],
      axes: [xAxis("step"), axis("busy (% of wall time)", (v) => (100 * v).toFixed(0))],
      scales: {y: {range: [0, 1]}},
      data: [state.steps.step, state.steps.busy],
    }),
    "chart-rate": () => ({
      series: [{label: "step"}, line("rollouts admitted/s", PURPLE)],
      axes: [xAxis("step"), axis("rollouts/s")],
      scales: {y: {range: (u, min, max) => [0, Math.max(1, (max ?? 1) * 1.1)]}},
      data: [state.steps.step, state.steps.rollouts_per_s],
    }),
    "chart-staleness": stalenessChart,
    // mismatch: lag-0 tokens only (the engines' numerics); ratio, clip: every lag (staleness too)
    "chart-offpolicy": () => ({
      series: [{label: "step"},
        line("engine mismatch KL", RED, {points: {show: true, size: 4, fill: RED}}),
        line("importance ratio (mean)", BLUE, {scale: "ratio"}),
        line("clipped share", PURPLE, {scale: "ratio", dash: [6, 4]})],
      axes: [xAxis("step"), axis("mismatch KL (nats)", small),
        axis("ratio / share", null, {side: 1, scale: "ratio", grid: {show: false}})],
      scales: {y: {range: (u, min, max) => [0, Math.max(1e-6, (max ?? 0) * 1.1)]},
        ratio: {range: (u, min, max) => [0, Math.max(1.2, (max ?? 1) * 1.1)]}},
      data: [state.steps.step, state.steps.mismatch_kl, state.steps.ratio_mean,
        state.steps.clip_frac],
    }),
    "chart-cdf": cdfChart,
    "chart-bcast": () => versionChart([
      line("T_bcast (90 % serving)", BLUE, {points: {show: true, size: 5, fill: BLUE}}),
      line("predicted", ORANGE, {dash: [6, 4]})], ["t_bcast_s", "predicted_bcast_s"],
    axis("seconds")),
    "chart-sources": () => versionChart([line("from the hub", BLUE, {fill: "rgba(31,111,180,0.10)"}),
      line("from peers", GREEN, {fill: "rgba(43,147,72,0.10)"})],
    ["bytes_from_hub", "bytes_from_peers"], axis("bytes", bytes)),
    "chart-wire": () => versionChart([line("full", BLUE, {points: {show: true, size: 4, fill: BLUE}}),
      line("delta", GREEN, {points: {show: true, size: 4, fill: GREEN}})],
    ["full_wire_bytes", "delta_wire_bytes"], axis("bytes on the wire", bytes)),
    "chart-cost": () => ({
      series: [{label: "step"}, line("$ total", ORANGE), line("$/h", BLUE, {scale: "rate", dash: [6, 4]})],
      axes: [xAxis("step"), axis("$ total", (v) => "$" + v.toPrecision(2)),
        axis("$/h", (v) => "$" + v.toPrecision(2), {side: 1, scale: "rate", grid: {show: false}})],
      scales: {y: {range: (u, min, max) => [0, Math.max(0.01, (max ?? 0) * 1.1)]},
        rate: {range: (u, min, max) => [0, Math.max(0.01, (max ?? 0) * 1.1)]}},
      data: [state.steps.step, state.steps.usd_total, state.steps.usd_per_hour],
    }),
  };

  function stalenessChart() {
    const {trained, dropped} = state.staleness;
    const top = Math.max(state.maxLag ?? 0, ...Object.keys(trained).map(Number), ...Object.keys(dropped).map(Number));
    const lags = Array.from({length: top + 1}, (_, i) => i);
    return {
      series: [{label: "lag"}, bars("trained", BLUE, -1), bars("dropped as stale", RED, 1)],
      axes: [axis("lag (versions behind)", null, {size: 40, values: integers}), axis("groups")],
      scales: {x: {range: padded}, y: {range: (u, min, max) => [0, Math.max(1, (max ?? 1) * 1.1)]}},
      data: [lags, lags.map((l) => trained[l] || 0), lags.map((l) => dropped[l] || 0)],
    };
  }

  function cdfChart() {
    const shown = state.versions.filter((r) => Array.isArray(r.cdf_s) && r.cdf_s.length === 11).slice(-CDF_VERSIONS);
    const percent = Array.from({length: 11}, (_, i) => 10 * i);
    const shades = ["#86b6e0", "#5597d2", "#2f77bd", "#1a5697", "#0b3570"].slice(-shown.length);
    return {
      series: [{label: "% of peers"}, ...shown.map((r, i) => line("v" + fixed(r.version, 0), shades[i],
        {points: {show: true, size: 4, fill: shades[i]}}))],
      axes: [xAxis("% of peers holding it"), axis("seconds since publication")],
      scales: {x: {range: [0, 100]}, y: {range: (u, min, max) => [0, Math.max(0.1, (max ?? 0) * 1.1)]}},
      data: [percent, ...shown.map((r) => r.cdf_s.map(num))],
    };
  }

  function versionChart(series, keys, yAxis) {
    const versions = state.versions.map((r) => num(r.version));
    return {
      series: [{label: "version"}, ...series],
      axes: [axis("version", null, {size: 40, values: integers}), yAxis],
      scales: {y: {range: (u, min, max) => [0, Math.max(1, (max ?? 1) * 1.1)]}},
      data: [versions, ...keys.map((k) => state.versions.map((r) => num(r[k])))],
    };
  }

  /** (Re)draw every chart; one is made anew when its series (legend) changed. */
  function drawCharts() {
    Object.entries(CHARTS).forEach(([id, spec]) => {
      const want = spec();
      const labels = want.series.map((s) => s.label).join("|");
      const have = charts[id];
      if (have && have.labels === labels) { have.plot.setData(want.data); return; }
      if (have) have.plot.destroy();
      charts[id] = {labels, plot: makePlot(id, want)};
    });
  }

  function makePlot(id, spec) {
    const el = document.getElementById(id);
    const scales = Object.assign({x: {}}, spec.scales);
    scales.x = Object.assign({time: false}, scales.x);
    const opts = {width: el.clientWidth, height: PLOT_HEIGHT, series: spec.series, axes: spec.axes,
      scales, legend: {live: false}, cursor: {drag: {x: false, y: false}}};
    return new uPlot(opts, spec.data, el);
  }

  function fitCharts() {
    Object.entries(charts).forEach(([id, c]) => {
      const el = document.getElementById(id);
      c.plot.setSize({width: el.clientWidth, height: PLOT_HEIGHT});
    });
  }

  setUpTable();
  new ResizeObserver(fitCharts).observe(document.querySelector(".grid"));
  setConnection("connecting");
  connect();
})();
