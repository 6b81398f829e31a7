// The barrier's live dashboard: polls /v1/status and /v1/history about once a second and redraws.
// URLs are relative to the page: the barrier may be served under a prefix (rank 0's /barrier/ with --peer-list).
// Served by a node of an asynchronous run (`sync: "async"` in its /v1/status; no barrier, no rounds), or by the
// barrier that counts and collects one (compose's), the page polls every member's /v1/status instead (their
// addresses are in the node's, or the barrier's `members`) and shows each node's steps, inbox and queue depths and
// the staleness of its last aggregation, over the time since the page opened.
// No build step, no network: uPlot (vendored beside this file) draws the charts.
"use strict";

const POLL_MS = 1000;
const OFFLINE_POLL_MS = 2000;
const CHART_HEIGHT = 190;
const COLORS = {
  nodeAverage: "#2563eb", averageModel: "#ea580c", consensus: "#7c3aed", spread: "#0d9488",
  train: "#93c5fd", send: "#6ee7b7", wait: "#fcd34d", aggregate: "#fca5a5", duration: "#4b5563", loss: "#be185d",
  stragglers: "#f97316", dropped: "#991b1b",
};
const PHASES = ["train", "send", "wait", "aggregate"];
const NODE_COLORS = ["#2563eb", "#ea580c", "#16a34a", "#7c3aed", "#db2777", "#0d9488", "#ca8a04", "#4b5563"];
const ASYNC_SAMPLES_KEPT = 3600;  // an hour of polls

const state = {
  runId: null,
  nextRound: 0,       // the first released round not fetched yet
  nextEval: 0,        // the first evaluation round not fetched yet
  rounds: [],         // /v1/history "rounds" entries, in round order
  evaluations: [],    // /v1/history "evaluations" rows, in round order
  status: null,
  lastSeen: null,
  charts: {},
  asyncStart: null,   // an asynchronous run: when the page first heard from it (Date.now())
  asyncSamples: [],   // ... and one sample per poll: {t: s since then, nodes: [{steps, inbox, queue, lag} or null]}
};
window.mosaicDashboard = state;  // for tests and curious people: state.charts.accuracy.data, ...

const $ = (id) => document.getElementById(id);

function fmt(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return String(Number(v.toPrecision(digits)));
}

async function getJSON(path) {
  const resp = await fetch(path, { cache: "no-store" });
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

// -- polling ---------------------------------------------------------------------------------------------
async function poll() {
  let delay = POLL_MS;
  try {
    const status = await getJSON("v1/status");
    const members = asyncMembers(status);
    if (status.sync === "async" || members) {
      await pollAsync(members || status);
      setTimeout(poll, delay);
      return;
    }
    if (state.runId !== null && (status.run_id !== state.runId || status.round < (state.status?.round ?? 0))) {
      location.reload();  // another run on this port
      return;
    }
    state.runId = status.run_id;
    const since = Math.min(state.nextRound, state.nextEval);
    const history = await getJSON(`v1/history?since=${since}`);
    absorb(history);
    state.status = status;
    state.lastSeen = Date.now();
    render();
  } catch (err) {
    delay = OFFLINE_POLL_MS;
    showOffline(err);
  }
  setTimeout(poll, delay);
}

// The barrier of an asynchronous run (compose's: it counts the nodes and collects their reports, no rounds): its
// members as a node of the run names them, so that the page shows the nodes as a node's page does; null for any
// other status (and while the nodes register)
function asyncMembers(status) {
  if (status.role !== "barrier" || !status.settings || status.settings.sync !== "async" || !status.members.length) {
    return null;
  }
  const ranked = [...status.members].sort((a, b) => a.rank - b.rank);
  return { run_id: status.run_id, exchange: status.settings.exchange, settings: status.settings,
           iterations: status.settings.rounds, addresses: ranked.map((m) => m.address), rank: -1 };
}

async function pollAsync(own) {
  if (state.runId !== null && own.run_id !== state.runId) {
    location.reload();  // another run on this port
    return;
  }
  state.runId = own.run_id;
  // the other members answer from their own host:port (their /v1/status lets any origin read it)
  const nodes = await Promise.all(own.addresses.map((address, rank) => (rank === own.rank ? Promise.resolve(own)
    : getJSON(`${location.protocol}//${address}/v1/status`).catch(() => null))));
  state.asyncStart ??= Date.now();
  state.asyncSamples.push({
    t: (Date.now() - state.asyncStart) / 1000,
    nodes: nodes.map((n) => n && { steps: n.steps, inbox: n.inbox, queue: n.queue_fragments,
                                   lag: n.last_aggregation ? n.last_aggregation.lag_steps_mean : null }),
  });
  if (state.asyncSamples.length > ASYNC_SAMPLES_KEPT) state.asyncSamples.shift();
  const finished = nodes.every((n) => n && n.phase === "finished");
  state.status = { ...own, nodes, phase: finished ? "finished" : "training" };
  state.lastSeen = Date.now();
  renderAsync();
}

function absorb(history) {
  for (const r of history.rounds || []) {
    if (r.round >= state.nextRound) { state.rounds.push(r); state.nextRound = r.round + 1; }
  }
  for (const e of history.evaluations || []) {
    if (e.round >= state.nextEval) { state.evaluations.push(e); state.nextEval = e.round + 1; }
  }
}

function showOffline(err) {
  const badge = $("phase");
  if (state.status && state.status.phase === "finished") {
    $("connection").textContent = state.status.sync === "async" ? "the nodes have exited; showing the run as it ended"
      : "the barrier has exited; showing the run as it ended";
  } else {
    badge.textContent = "offline";
    badge.className = "badge offline";
    const ago = state.lastSeen ? ` (last answer ${Math.round((Date.now() - state.lastSeen) / 1000)} s ago)` : "";
    const who = state.status && state.status.sync === "async" ? "node" : "barrier";
    $("connection").textContent = `${who} not reachable${ago}: ${err.message}`;
  }
}

// -- rendering ------------------------------------------------------------------------------------------
function render() {
  const s = state.status;
  $("run-id").textContent = `run ${s.run_id}`;
  const badge = $("phase");
  badge.textContent = s.phase;
  badge.className = `badge ${s.phase}`;
  $("round").textContent = Math.min(s.round, s.rounds);  // rounds + 1 once finished
  $("rounds").textContent = s.rounds;
  $("progress").max = s.rounds;
  $("progress").value = Math.min(s.round, s.rounds);
  const members = s.members.length;
  $("membership").textContent = s.phase === "registering"
    ? `registered ${s.registered} of ${s.expected || "?"}`
    : `live ${s.live.length} / ${members}` + (s.dropped.length ? `, dropped ${s.dropped.join(", ")}` : "")
      + ((s.left || []).length ? `, left ${s.left.join(", ")}` : "");
  $("connection").textContent = "";
  renderSettings(s.settings);
  renderNodes(s);
  renderCharts();
}

function renderSettings(run) {
  if (!run) return;
  const rows = [
    ["task", run.task], ["nodes n", run.nodes], ["rounds T", run.rounds], ["fragments K", run.fragments],
    ["fanout s", run.fanout], ["sampler", run.sampler], ["fragmentation", run.strategy],
    ["partition", run.partition === "dirichlet" ? `dirichlet (α ${run.alpha})` : run.partition],
    ["seed", run.seed], ["training", run.train ? `H ${run.local_steps}, lr ${run.lr}, B ${run.batch_size}` : "off"],
    ["evaluate every", run.eval_every ? `${run.eval_every} rounds` : "end only"],
  ];
  if (run.task === "quadratic") rows.push(["model size d", run.dim]);
  const key = JSON.stringify(rows);
  const dl = $("settings");
  if (dl.dataset.key === key) return;
  dl.dataset.key = key;
  dl.replaceChildren(...rows.flatMap(([k, v]) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = fmt(v);
    return [dt, dd];
  }));
}

function renderNodes(s) {
  const latest = state.evaluations[state.evaluations.length - 1];
  const metricOf = {};
  if (latest && latest.per_node) {
    (latest.nodes || []).forEach((rank, i) => { metricOf[rank] = latest.per_node[i]; });
  }
  if (latest) {
    $("metric-header").textContent = latest.metric;
    const reported = latest.reported  // a training loop's own metrics, node-averaged (Peer.gossip(metrics=...))
      ? "; reported: " + Object.entries(latest.reported).map(([k, v]) => `${k} ${fmt(v)}`).join(", ") : "";
    $("latest-eval").textContent = `(${latest.metric} at round ${latest.round}${reported})`;
  }
  const stragglers = new Set(s.stragglers), dropped = new Set(s.dropped);
  const rows = s.members.map((m) => {
    const tr = document.createElement("tr");
    tr.dataset.rank = m.rank;
    const st = dropped.has(m.rank) ? "dropped" : stragglers.has(m.rank) ? "straggler" : "live";
    if (st !== "live") tr.className = st;
    const cells = [m.rank, m.address, st, m.last_round, m.missed, `${fmt(m.last_contact_s, 2)} s ago`,
                   fmt(metricOf[m.rank])];
    return withCells(tr, cells);
  });
  showRows(rows);
}

// a table row's cells, as text; the node table's rows, replaced whole
function withCells(tr, cells) {
  for (const c of cells) {
    const td = document.createElement("td");
    td.textContent = c;
    tr.appendChild(td);
  }
  return tr;
}

function showRows(rows) {
  const table = $("node-table");
  table.tBodies[0].replaceChildren(...rows);
  table.dataset.rows = rows.length;
}

// -- an asynchronous run ----------------------------------------------------------------------------------
function renderAsync() {
  const s = state.status, nodes = s.nodes, live = nodes.filter(Boolean);
  $("run-id").textContent = `run ${s.run_id} (asynchronous, ${s.exchange})`;
  const badge = $("phase");
  badge.textContent = s.phase;
  badge.className = `badge ${s.phase === "training" ? "running" : s.phase}`;
  $("progress-label").textContent = "steps of the slowest node";
  const slowest = live.length ? Math.min(...live.map((n) => n.steps)) : 0;
  $("round").textContent = slowest;
  $("rounds").textContent = s.iterations;
  $("progress").max = s.iterations;
  $("progress").value = slowest;
  $("membership").textContent = `reachable ${live.length} / ${nodes.length}, finished `
    + `${live.filter((n) => n.phase === "finished").length}`;
  $("connection").textContent = "";
  $("barrier-charts").hidden = true;
  $("async-charts").hidden = false;
  renderSettings(s.settings);
  renderAsyncNodes(s);
  renderAsyncCharts(nodes.length);
}

const ASYNC_COLUMNS = ["rank", "address", "state", "steps", "steps/s", "inbox (oldest)", "queue (fragments)",
                       "copies", "lag mean / max", "wait mean / max", "sent", "stale", "superseded",
                       "refused (max-norm)"];

// a node's state as `mosaicd status` says it: a finished node's says what ended its iterations ("finished (budget)")
function asyncState(n) {
  return n.stopped_by ? `${n.phase} (${n.stopped_by})` : n.phase;
}

function renderAsyncNodes(s) {
  const header = $("node-header");
  if (header.dataset.async !== "1") {
    header.dataset.async = "1";
    header.replaceChildren(...ASYNC_COLUMNS.map((name) => {
      const th = document.createElement("th"); th.textContent = name; return th;
    }));
    $("latest-eval").textContent = "(lag: the node's step less the step of the copies its last aggregation "
      + "averaged; wait: their time in its inbox, s)";
  }
  const rows = s.addresses.map((address, rank) => {
    const n = s.nodes[rank], last = n && n.last_aggregation;
    const tr = document.createElement("tr");
    tr.dataset.rank = rank;
    if (!n) tr.className = "dropped";
    const cells = !n ? [rank, address, "unreachable", ...ASYNC_COLUMNS.slice(3).map(() => "–")] : [
      rank, address, asyncState(n), `${n.steps} / ${n.iterations}`, fmt(n.steps_per_s, 3),
      n.inbox + (n.inbox_oldest_s === null ? "" : ` (${fmt(n.inbox_oldest_s, 2)} s)`),
      `${n.queue} (${n.queue_fragments})`, last ? last.copies : "–",
      last ? `${fmt(last.lag_steps_mean, 2)} / ${fmt(last.lag_steps_max)}` : "–",
      last ? `${fmt(last.wait_s_mean, 2)} / ${fmt(last.wait_s_max, 2)}` : "–", n.sent, n.stale, n.superseded,
      `${n.refused} (${n.out_of_range ?? 0})`,
    ];
    return withCells(tr, cells);
  });
  showRows(rows);
}

function renderAsyncCharts(n) {
  const samples = state.asyncSamples, x = samples.map((p) => p.t), ranks = [...Array(n).keys()];
  const perNode = (key) => ranks.map((r) => samples.map((p) => (p.nodes[r] ? num(p.nodes[r][key]) : null)));
  const nodeSeries = ranks.map((r) => ({ label: `node ${r}`, stroke: NODE_COLORS[r % NODE_COLORS.length], width: 1.5,
                                         value: (u, v) => fmt(v) }));
  const xLabel = "seconds since the page opened";
  update("steps", "chart-steps", (data) => makeChart("chart-steps", nodeSeries, data,
    { xLabel, yLabel: "steps" }), [x, ...perNode("steps")]);
  const total = (key) => samples.map((p) => p.nodes.reduce((acc, v) => acc + (v ? v[key] : 0), 0));
  update("depths", "chart-depths", (data) => makeChart("chart-depths", [
    { label: "inbox", stroke: COLORS.nodeAverage, width: 2, value: (u, v) => fmt(v) },
    { label: "queue", stroke: COLORS.averageModel, width: 2, value: (u, v) => fmt(v) },
  ], data, { xLabel, yLabel: "fragments" }), [x, total("inbox"), total("queue")]);
  update("lag", "chart-lag", (data) => makeChart("chart-lag", nodeSeries, data,
    { xLabel, yLabel: "steps behind" }), [x, ...perNode("lag")]);
}

// -- charts ---------------------------------------------------------------------------------------------
function chartWidth(el) { return Math.max(300, el.clientWidth); }

function makeChart(id, series, data, opts = {}) {
  const el = $(id);
  el.replaceChildren();
  const chart = new uPlot({
    width: chartWidth(el), height: CHART_HEIGHT,
    scales: { x: { time: false }, y: opts.y || {} },
    axes: [{ label: opts.xLabel || "round" }, { label: opts.yLabel || "", size: 60 }],
    legend: { live: true },
    cursor: { drag: { x: true, y: false } },
    series: [{ label: opts.xLabel || "round" }, ...series],
    bands: opts.bands,
  }, data, el);
  chart.mosaicIdle = true;
  el.addEventListener("mouseenter", () => { chart.mosaicIdle = false; });
  el.addEventListener("mouseleave", () => { chart.mosaicIdle = true; showLatest(chart); });
  return chart;
}

function showLatest(chart) {
  const n = chart.data[0].length;
  if (n && chart.mosaicIdle) chart.setLegend({ idx: n - 1 });
}

function update(name, id, build, data) {
  const el = $(id);
  if (!data[0].length) {
    if (!el.firstChild) {
      const p = document.createElement("div");
      p.className = "empty";
      p.textContent = "no data yet";
      el.appendChild(p);
    }
    return;
  }
  let chart = state.charts[name];
  if (!chart) {
    chart = state.charts[name] = build(data);
  } else {
    chart.setData(data);
  }
  showLatest(chart);
  el.dataset.points = data[0].length;
}

const positive = (v) => (typeof v === "number" && v > 0 ? v : null);
const num = (v) => (typeof v === "number" ? v : null);

function renderCharts() {
  const evals = state.evaluations;
  const x = evals.map((e) => e.round);
  const first = evals[0];
  if (first) {
    $("accuracy-caption").textContent =
      `${first.metric} vs round (${first.higher_is_better ? "higher" : "lower"} is better)`;
    $("spread-caption").textContent = `Node spread vs round (std of the nodes' ${first.metric})`;
  }
  const logMetric = first && !first.higher_is_better;
  update("accuracy", "chart-accuracy", (data) => makeChart("chart-accuracy", [
    { label: "node average", stroke: COLORS.nodeAverage, width: 2, value: (u, v) => fmt(v) },
    { label: "average model", stroke: COLORS.averageModel, width: 2, value: (u, v) => fmt(v) },
  ], data, { yLabel: first.metric, y: logMetric ? { distr: 3 } : {} }), [
    x,
    evals.map((e) => (logMetric ? positive(e.node_average) : num(e.node_average))),
    evals.map((e) => (logMetric ? positive(e.average_model) : num(e.average_model))),
  ]);
  update("consensus", "chart-consensus", (data) => makeChart("chart-consensus", [
    { label: "consensus distance", stroke: COLORS.consensus, width: 2, value: (u, v) => fmt(v) },
  ], data, { yLabel: "mean ‖xᵢ − x̄‖", y: { distr: 3 } }), [x, evals.map((e) => positive(e.consensus_distance))]);
  update("spread", "chart-spread", (data) => makeChart("chart-spread", [
    { label: "node spread", stroke: COLORS.spread, width: 2, value: (u, v) => fmt(v) },
  ], data, { yLabel: "std over nodes" }), [x, evals.map((e) => num(e.node_spread))]);

  update("loss", "chart-loss", (data) => makeChart("chart-loss", [
    { label: "training loss", stroke: COLORS.loss, width: 2, value: (u, v) => fmt(v) },
  ], data, { yLabel: "loss", y: { distr: 3 } }), [x, evals.map((e) => positive(e.train_loss))]);

  // round duration: the phases stacked (each series is the running sum; the legend shows the phase's own seconds);
  // rounds 0..T-1 only: the release at T is the final arrival, no round
  const total = state.status.rounds;
  const rounds = state.rounds.filter((r) => r.round < total);
  const rx = rounds.map((r) => r.round);
  const own = PHASES.map((p) => rounds.map((r) => num(r[`${p}_s`]) ?? 0));
  state.phaseSeconds = own;  // the legend's values (the formatters below outlive this call)
  const stacked = own.map((_, i) => rx.map((_, j) => own.slice(0, i + 1).reduce((acc, col) => acc + col[j], 0)));
  // drawn top of the stack first, so each lower band paints over the one above it
  const order = [3, 2, 1, 0];
  // a start-up spike (round 0 trains cold) would flatten the rest: cut the axis at 3x the 90th percentile
  const totals = rounds.map((r, j) => Math.max(stacked[3][j], num(r.duration_s) ?? 0)).sort((a, b) => a - b);
  const p90 = totals.length ? totals[Math.floor(0.9 * (totals.length - 1))] : 0;
  state.durationCap = totals.length && totals[totals.length - 1] > 3 * p90 && p90 > 0 ? 3 * p90 : null;
  $("duration-note").textContent = state.durationCap ? `; axis cut at ${fmt(state.durationCap, 2)} s, hover for spikes` : "";
  update("duration", "chart-duration", (data) => makeChart("chart-duration", [
    ...order.map((i) => ({
      label: PHASES[i], stroke: COLORS[PHASES[i]], fill: COLORS[PHASES[i]], width: 1,
      value: (u, v, si, idx) => (idx === null || idx === undefined ? "–" : `${fmt(state.phaseSeconds[i][idx] ?? null, 3)} s`),
    })),
    { label: "between releases", stroke: COLORS.duration, width: 1.5, dash: [4, 4],
      value: (u, v) => (v === null || v === undefined ? "–" : `${fmt(v, 3)} s`) },
  ], data, { yLabel: "seconds", y: { range: (u, min, max) => [0, state.durationCap ?? Math.max(max, 1e-3) * 1.05] } }),
  [rx, ...order.map((i) => stacked[i]), rounds.map((r) => num(r.duration_s))]);

  let dropped = 0;
  const releases = state.rounds;
  const droppedSoFar = releases.map((r) => (dropped += (r.dropped || []).length));
  update("stragglers", "chart-stragglers", (data) => makeChart("chart-stragglers", [
    { label: "stragglers", stroke: COLORS.stragglers, fill: COLORS.stragglers + "99",
      paths: uPlot.paths.bars({ size: [0.8, 40] }), points: { show: false } },
    { label: "dropped so far", stroke: COLORS.dropped, width: 2, paths: uPlot.paths.stepped({ align: 1 }),
      points: { show: false } },
  ], data, { yLabel: "nodes", y: { range: (u, min, max) => [0, Math.max(2, max + 1)] } }),
  [releases.map((r) => r.round), releases.map((r) => (r.stragglers || []).length), droppedSoFar]);
  renderStragglerList(releases);
  renderRefusals(releases);
}

// refusals by reason: the run's totals, then the last rounds that had any
function renderRefusals(rounds) {
  const totals = {};
  for (const r of rounds) {
    for (const [reason, n] of Object.entries(r.refused || {})) totals[reason] = (totals[reason] || 0) + n;
  }
  state.refusals = totals;  // for tests
  const text = (counts) => Object.entries(counts).sort().map(([k, n]) => `${k}: ${n}`).join(", ");
  const items = [];
  const all = document.createElement("li");
  all.textContent = Object.keys(totals).length ? `whole run: ${text(totals)}` : "no refusals so far";
  items.push(all);
  for (const r of rounds.filter((r) => Object.keys(r.refused || {}).length).slice(-10).reverse()) {
    const li = document.createElement("li");
    li.textContent = `round ${r.round}: ${text(r.refused)}`;
    items.push(li);
  }
  $("refusal-list").replaceChildren(...items);
}

function renderStragglerList(rounds) {
  const late = rounds.filter((r) => (r.stragglers || []).length || (r.dropped || []).length).slice(-20).reverse();
  const items = late.map((r) => {
    const li = document.createElement("li");
    const parts = [];
    if (r.stragglers.length) parts.push(`late: ${r.stragglers.join(", ")}`);
    if (r.dropped.length) parts.push(`dropped: ${r.dropped.join(", ")}`);
    li.textContent = `round ${r.round}: ${parts.join("; ")}`;
    return li;
  });
  if (!items.length && rounds.length) {
    const li = document.createElement("li");
    li.textContent = "no stragglers so far";
    items.push(li);
  }
  $("straggler-list").replaceChildren(...items);
}

window.addEventListener("resize", () => {
  for (const [name, chart] of Object.entries(state.charts)) {
    chart.setSize({ width: chartWidth($(`chart-${name}`)), height: CHART_HEIGHT });
  }
});

poll();
