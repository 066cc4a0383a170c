// tierstack dashboard: polls the node's HTTP API once a second and draws SVG by hand
// (no library, no CDN: it must work on a machine without internet).
"use strict";

const LINKS = ["nvme->cpu", "cpu->nvme", "cpu->device", "device->cpu"];
const TIERS = ["device", "cpu", "nvme"];
const COLORS = {"nvme->cpu": "#4fc3f7", "cpu->nvme": "#ffb74d", "cpu->device": "#81c784",
                "device->cpu": "#e57373", device: "#81c784", cpu: "#ba68c8", nvme: "#4fc3f7",
                stall: "#ff8a65"};
const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 1000;
const state = {updates: 0, view: "cluster", links: []};

const $ = (id) => document.getElementById(id);
const linkId = (link) => "link-" + link.replace("->", "-");

function fmtRate(bps) {
  if (!isFinite(bps)) return "–";
  if (bps >= 1e9) return (bps / 1e9).toFixed(2) + " GB/s";
  if (bps >= 1e6) return (bps / 1e6).toFixed(1) + " MB/s";
  if (bps >= 1e3) return (bps / 1e3).toFixed(1) + " kB/s";
  return bps.toFixed(0) + " B/s";
}

function fmtBytes(n) {
  if (n >= 2 ** 30) return (n / 2 ** 30).toFixed(2) + " GiB";
  if (n >= 2 ** 20) return (n / 2 ** 20).toFixed(1) + " MiB";
  if (n >= 2 ** 10) return (n / 2 ** 10).toFixed(1) + " KiB";
  return n + " B";
}

// Names and reasons come from jobs and nodes: show them as text, never as markup.
function esc(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// series: [{points: [[t, v], ...], color, cls}]; peak: a dashed line (or null).
function drawChart(svg, series, peak, t0, t1, fmt) {
  const w = svg.clientWidth || 600, h = svg.clientHeight || 140;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  const left = 4, top = 16, bottom = h - 16, right = w - 4;
  let vmax = peak || 0;
  for (const s of series) for (const [, v] of s.points) vmax = Math.max(vmax, v);
  vmax = vmax > 0 ? vmax * 1.1 : 1;
  const x = (t) => left + (right - left) * (t - t0) / Math.max(1e-9, t1 - t0);
  const y = (v) => bottom - (bottom - top) * v / vmax;
  svg.append(svgEl("line", {class: "axis", x1: left, x2: right, y1: bottom, y2: bottom}));
  svg.append(svgEl("line", {class: "axis", x1: left, x2: right, y1: top, y2: top}));
  svg.append(svgEl("text", {class: "label", x: left, y: top - 4}, fmt(vmax)));
  svg.append(svgEl("text", {class: "label", x: left, y: h - 3}, `-${Math.round(t1 - t0)} s`));
  svg.append(svgEl("text", {class: "label", x: right, y: h - 3, "text-anchor": "end"}, "now"));
  if (peak) {
    const color = series.length ? series[series.length - 1].color : "#888";
    svg.append(svgEl("line", {class: "peak-line", x1: left, x2: right, y1: y(peak), y2: y(peak),
                              stroke: color}));
    svg.append(svgEl("text", {class: "label", x: right, y: y(peak) - 3, "text-anchor": "end"},
                     "peak " + fmt(peak)));
  }
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map(([t, v], i) => `${i ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`).join("");
    svg.append(svgEl("path", {class: s.cls || "line", d, stroke: s.color, "data-series": s.name || ""}));
  }
}

// One card per link the view's machines have (links_present): a node whose workers all run
// on the CPU reads the pool in place, and draws no cpu → device link. Rebuilt when the set
// changes (a first GPU worker reports, or the view changes).
function buildLinkCards(links) {
  if (links.join() === state.links.join()) return;
  state.links = links;
  const root = $("links");
  root.replaceChildren();
  root.className = links.length > 2 ? "grid four" : "grid two";  // no empty columns
  for (const link of links) {
    const card = document.createElement("div");
    card.className = "card link";
    card.id = linkId(link);
    card.innerHTML = `<h3>${link.replace("->", " → ")}</h3>
      <div class="value" data-bytes-per-second="0">–</div><div class="peak">peak –</div>
      <svg class="chart"></svg>`;
    root.append(card);
  }
}

function buildLegend() {
  const legend = $("tier-legend");
  for (const tier of TIERS) {
    legend.insertAdjacentHTML("beforeend", `<span><i style="background:${COLORS[tier]}"></i>${tier}</span>`);
  }
}

function fmtCount(n) {
  if (n >= 1e9) return (n / 1e9).toFixed(2) + " G";
  if (n >= 1e6) return (n / 1e6).toFixed(2) + " M";
  if (n >= 1e4) return (n / 1e3).toFixed(1) + " k";
  return n.toFixed(n >= 100 || Number.isInteger(n) ? 0 : 1);
}

function fmtDuration(s) {
  if (s < 60) return s.toFixed(0) + " s";
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
  return h ? `${h} h ${m} min` : `${m} min ${sec} s`;
}

function fmtLoss(job) {
  if (!job.loss_finite) return "not finite";
  return job.loss === null ? "–" : Number(job.loss.toPrecision(4)).toString();
}

function fmtLearningRate(lr) {
  if (lr === null) return "–";
  return lr !== 0 && Math.abs(lr) < 0.01 ? lr.toExponential(2) : String(Number(lr.toPrecision(4)));
}

// The job's recent losses over its steps, scaled to their own range.
function sparkline(svg, points) {
  const w = svg.clientWidth || 240, h = svg.clientHeight || 36;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  if (points.length < 2) return;
  const steps = points.map((p) => p[0]), losses = points.map((p) => p[1]);
  const s0 = Math.min(...steps), s1 = Math.max(...steps);
  const lo = Math.min(...losses), hi = Math.max(...losses);
  const x = (s) => 2 + (w - 4) * (s - s0) / Math.max(1, s1 - s0);
  const y = (v) => h - 3 - (h - 6) * (hi > lo ? (v - lo) / (hi - lo) : 0.5);
  const d = points.map(([st, v], i) => `${i ? "L" : "M"}${x(st).toFixed(1)},${y(v).toFixed(1)}`).join("");
  svg.append(svgEl("path", {d}));
  svg.append(svgEl("title", {}, `loss ${Number(hi.toPrecision(4))} .. ${Number(lo.toPrecision(4))} ` +
                                `over steps ${s0}..${s1}`));
}

// One card per job: what a training user looks at first. Each figure keeps its number in
// a data attribute ("" where not known), as the link cards do.
function renderTraining(jobs) {
  const root = $("training");
  root.replaceChildren();
  $("no-training").hidden = jobs.length > 0;
  for (const j of jobs) {
    const card = document.createElement("div");
    card.className = "card job";
    card.dataset.job = j.job;
    const of = j.total_steps !== null ? ` / ${j.total_steps}` : "";
    const pct = j.total_steps ? Math.min(100, 100 * j.step / j.total_steps) : 0;
    const figure = (cls, label, text, value) =>
      `<div class="figure ${cls}" data-value="${value === null ? "" : value}">
         <div class="name">${label}</div><div class="value">${esc(text)}</div></div>`;
    card.innerHTML = `<h3>${esc(j.job)} <span class="hint">${j.workers} worker(s)</span></h3>
      <div class="figures">
        ${figure("step", "step", `${j.step}${of}`, j.step)}
        ${figure("loss", "loss" + (j.loss_workers > 1 ? ` (mean of ${j.loss_workers})` : ""),
                 fmtLoss(j), j.loss_finite ? j.loss : "NaN")}
        ${figure("tokens-per-second", "tokens/s", j.tokens_per_second > 0 ? fmtCount(j.tokens_per_second) : "–",
                 j.tokens_per_second)}
        ${figure("learning-rate", "learning rate", fmtLearningRate(j.learning_rate), j.learning_rate)}
        ${figure("eta", "ETA", j.eta_seconds === null ? "–" : fmtDuration(j.eta_seconds), j.eta_seconds)}
      </div>
      <div class="bar"><div style="width:${pct.toFixed(1)}%;background:var(--cpu-device)"></div></div>
      <svg class="sparkline"></svg>`;
    if (!j.loss_finite) card.querySelector(".loss .value").classList.add("not-finite");
    root.append(card);
    sparkline(card.querySelector(".sparkline"), j.loss_history);
  }
}

function seriesOf(history, pick) {
  return history.samples.map((s) => [s.timestamp, pick(s)]);
}

function tierRate(links, tier) {
  return state.links.filter((l) => l.split("->").includes(tier)).reduce((a, l) => a + (links[l] || 0), 0);
}

// What a job's workers report: the plan versions they follow, the plan's predicted step
// and their last measured one (the median over the workers).
function jobSteps(workers) {
  const versions = [...new Set(workers.map((w) => w.plan_version).filter((v) => v > 0))].sort((a, b) => a - b);
  const predicted = Math.max(0, ...workers.map((w) => w.predicted_step_seconds || 0));
  const measured = workers.map((w) => w.step_seconds || 0).filter((s) => s > 0).sort((a, b) => a - b);
  const median = measured.length ? measured[Math.floor(measured.length / 2)] : 0;
  const secs = (s) => s >= 10 ? s.toFixed(1) + " s" : s.toFixed(3) + " s";
  return {
    follow: versions.length ? versions.map((v) => "v" + v).join(", ") : "–",
    predicted: predicted > 0 ? secs(predicted) : "–",
    measured: median > 0 ? secs(median) + (predicted > 0 ? ` (${(median / predicted).toFixed(2)}×)` : "") : "–",
  };
}

function render(cluster, histories) {
  // The view: the cluster total, or one node.
  const select = $("view");
  const names = cluster.nodes.map((n) => n.node);
  const known = [...select.options].map((o) => o.value);
  for (const name of names) if (!known.includes(name)) select.append(new Option("node " + name, name));
  const nodeView = state.view !== "cluster" && names.includes(state.view);
  const snap = nodeView ? cluster.nodes.find((n) => n.node === state.view) : cluster;
  const history = nodeView ? histories.nodes.find((h) => h.node === state.view) || histories.total
                           : histories.total;
  // The x axis spans the window, or only the history there is (a run that just began).
  const now = Date.now() / 1000;
  const first = history.samples.length ? history.samples[0].timestamp : now - 60;
  const t0 = Math.max(now - Number($("window").value), Math.min(first, now - 30));

  renderTraining(snap.training || []);
  buildLinkCards(snap.links_present || LINKS);
  for (const link of state.links) {
    const card = $(linkId(link));
    const fig = snap.links[link];
    const value = card.querySelector(".value");
    value.textContent = fmtRate(fig.bandwidth_bytes_per_second);
    value.dataset.bytesPerSecond = String(fig.bandwidth_bytes_per_second);
    card.querySelector(".peak").textContent =
      `peak ${fmtRate(fig.peak_bytes_per_second)} · ${fmtBytes(fig.bytes_total)} moved`;
    const series = [];
    if (!nodeView && histories.nodes.length > 1) {
      for (const h of histories.nodes) {
        series.push({name: h.node, cls: "node-line", color: COLORS[link],
                     points: seriesOf(h, (s) => s.links[link])});
      }
    }
    series.push({name: nodeView ? state.view : "total", color: COLORS[link],
                 points: seriesOf(history, (s) => s.links[link])});
    drawChart(card.querySelector("svg"), series, fig.peak_bytes_per_second, t0, now, fmtRate);
  }

  drawChart($("tier-chart"), TIERS.map((tier) => ({
    name: tier, color: COLORS[tier], points: seriesOf(history, (s) => tierRate(s.links, tier))})),
    null, t0, now, fmtRate);

  const occ = $("occupancy");
  occ.replaceChildren();
  for (const tier of TIERS) {
    const t = snap.tiers[tier];
    const pct = t.capacity_bytes ? 100 * t.used_bytes / t.capacity_bytes : 0;
    occ.insertAdjacentHTML("beforeend", `<div class="tier" id="tier-${tier}">${tier}:
      ${fmtBytes(t.used_bytes)} of ${fmtBytes(t.capacity_bytes)} (${pct.toFixed(0)}%) ·
      ${fmtRate(t.bandwidth_bytes_per_second)}</div>
      <div class="bar"><div style="width:${pct.toFixed(1)}%;background:${COLORS[tier]}"></div></div>`);
  }

  const stallNow = history.samples.length ? history.samples[history.samples.length - 1].stall_seconds_per_second : 0;
  $("stall-value").textContent = `${(100 * stallNow).toFixed(1)}% of the time · ` +
    `${snap.stall_seconds_total.toFixed(1)} s in total`;
  drawChart($("stall-chart"), [{name: "stall", color: COLORS.stall,
    points: seriesOf(history, (s) => s.stall_seconds_per_second)}], null, t0, now,
    (v) => (100 * v).toFixed(0) + "%");

  // "Plan" is the scheduler's plan (per job); the access order workers declare is
  // shown apart from it: both drive which tensor the node evicts.
  const when = (t) => t ? new Date(t * 1000).toLocaleTimeString() : "–";
  const plan = $("plan");
  plan.replaceChildren();
  plan.insertAdjacentHTML("beforeend", "<tr><th>node</th><th>job</th><th>plan version</th>" +
    "<th>reason</th><th>tensors</th><th>since</th><th>workers follow</th>" +
    "<th>predicted step</th><th>measured step</th></tr>");
  const order = $("access-order");
  order.replaceChildren();
  order.insertAdjacentHTML("beforeend", "<tr><th>node</th><th>declared</th>" +
    "<th>keys</th><th>updated</th><th>eviction rules, in order</th></tr>");
  for (const n of nodeView ? [snap] : cluster.nodes) {
    const p = n.plan;
    if (!p.jobs.length) {
      plan.insertAdjacentHTML("beforeend", `<tr><td>${esc(n.node)}</td><td>none</td>
        <td class="num">0</td><td>${p.scheduler ? "no plan from the scheduler yet" : "no scheduler"}</td>
        <td class="num">–</td><td>–</td><td>–</td><td class="num">–</td><td class="num">–</td></tr>`);
    }
    for (const j of p.jobs) {
      const steps = jobSteps(n.workers.filter((w) => w.job === j.job));
      plan.insertAdjacentHTML("beforeend", `<tr class="job-plan"><td>${esc(n.node)}</td><td>${esc(j.job)}</td>
        <td class="num">${j.version}</td><td>${esc(j.reason)}</td>
        <td class="num">${j.tensor_keys}</td><td>${when(j.applied_at)}</td>
        <td>${steps.follow}</td><td class="num predicted">${steps.predicted}</td>
        <td class="num measured">${steps.measured}</td></tr>`);
    }
    order.insertAdjacentHTML("beforeend", `<tr><td>${esc(n.node)}</td>
      <td class="num">${p.access_order_version}</td><td class="num">${p.access_order_keys}</td>
      <td>${when(p.access_order_updated_at)}</td><td>${esc(p.eviction_policy)}</td></tr>`);
  }

  const nodes = $("nodes");
  nodes.replaceChildren();
  const columns = cluster.links_present || LINKS;
  nodes.insertAdjacentHTML("beforeend", "<tr><th>node</th>" +
    columns.map((l) => `<th>${l.replace("->", " → ")}</th>`).join("") +
    "<th>workers</th><th>queues</th><th>evictions</th><th>checksum failures</th></tr>");
  for (const n of cluster.nodes) {
    const has = n.links_present || LINKS;
    const cells = columns.map((l) => has.includes(l)
      ? `<td class="num">${fmtRate(n.links[l].bandwidth_bytes_per_second)}
      / ${fmtRate(n.links[l].peak_bytes_per_second)}</td>` : `<td class="num">no link</td>`).join("");
    const queues = Object.entries(n.queues).map(([k, v]) => `${k} ${v}`).join(", ");
    nodes.insertAdjacentHTML("beforeend", `<tr><td>${esc(n.node)}</td>${cells}
      <td class="num">${n.workers.length}</td><td>${queues}</td>
      <td class="num">${n.evictions_total}</td><td class="num">${n.checksum_failures_total}</td></tr>`);
  }
  $("unreachable").textContent = cluster.unreachable.map((u) => `${u.node}: ${u.error}`).join("; ");
}

async function refresh() {
  const status = $("status");
  try {
    const windowSeconds = $("window").value;
    const [cluster, histories] = await Promise.all([
      fetch("../api/v1/cluster").then((r) => r.ok ? r.json() : Promise.reject(r.statusText)),
      fetch(`../api/v1/cluster/history?window_seconds=${windowSeconds}`)
        .then((r) => r.ok ? r.json() : Promise.reject(r.statusText)),
    ]);
    render(cluster, histories);
    state.updates += 1;
    status.dataset.updates = String(state.updates);
    status.className = "";
    status.textContent = `${cluster.nodes.length} node(s) · ${cluster.workers} worker(s) · ` +
      `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    status.className = "error";
    status.textContent = "cannot reach the node's API: " + e;
  }
}

buildLegend();
$("view").addEventListener("change", (e) => { state.view = e.target.value; refresh(); });
$("window").addEventListener("change", refresh);
refresh();
setInterval(refresh, POLL_MS);
