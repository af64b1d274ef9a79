// radixserve cache dashboard: polls /v1/cache/tree and /v1/dashboard/stats of each panel and
// draws an icicle of the radix tree, time series and the top prefixes. No dependencies.
"use strict";

const STATS_MS = 1000;
const TREE_MS = 2000;
const SERIES_POINTS = 300;
const WINDOW_S = 10;
const ROW_MAX = 26;
const ROW_MIN = 3;
const TREE_MAX_PX = 560;
const TIP_TEXT_CHARS = 240;

const state = { config: null, key: sessionStorage.getItem("radixserve-key") || "", panels: [] };
const $ = (sel, root = document) => root.querySelector(sel);

// ------------------------------------------------------------------ helpers

function fmt(n, digits = 0) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return n.toFixed(digits);
}

function fmtAge(s) {
  if (s === null || s === undefined) return "never";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function truncate(text, n) {
  return text.length > n ? text.slice(0, n) + "…" : text;
}

// Colour ramp (dark blue -> teal -> yellow), t in [0, 1].
const RAMP = [[38, 50, 110], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function ramp(t) {
  t = Math.min(1, Math.max(0, t)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(t));
  const f = t - i;
  const c = RAMP[i].map((v, k) => Math.round(v + f * (RAMP[i + 1][k] - v)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

async function getJSON(url) {
  const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
  const r = await fetch(url, { headers, cache: "no-store" });
  if (r.status === 401) {
    $("#key-form").hidden = false;
    throw new Error("the API key is missing or wrong");
  }
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

function setStatus(text, error = false) {
  const el = $("#status");
  el.textContent = text;
  el.classList.toggle("error", error);
}

// Prometheus' histogram_quantile over bucket increments [[le, cumulative count], ...].
function histQuantile(q, buckets) {
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let prevLe = 0;
  let prevCount = 0;
  for (const [bound, count] of buckets) {
    const le = bound === null ? Infinity : bound;
    if (count >= rank) {
      if (!Number.isFinite(le)) return prevLe;
      return prevLe + ((le - prevLe) * (rank - prevCount)) / Math.max(1e-9, count - prevCount);
    }
    prevLe = le;
    prevCount = count;
  }
  return prevLe;
}

// ------------------------------------------------------------------ the icicle

// Lay out `tree.nodes` (parents before children): namespaces side by side at depth 0, each
// node as wide as its subtree's tokens, children sorted widest first.
function layoutTree(tree, width) {
  const nodes = tree.nodes;
  const n = nodes.length;
  const kids = new Array(n);
  const roots = [];
  for (let i = 0; i < n; i++) {
    const p = nodes[i].parent;
    if (p === null) roots.push(i);
    else (kids[p] || (kids[p] = [])).push(i);
  }
  const x = new Float64Array(n);
  const w = new Float64Array(n);
  const depth = new Int32Array(n);
  const total = roots.reduce((s, r) => s + nodes[r].subtree_tokens, 0) || 1;
  let cursor = 0;
  roots.sort((a, b) => nodes[b].subtree_tokens - nodes[a].subtree_tokens);
  for (const r of roots) {
    x[r] = cursor;
    w[r] = (width * nodes[r].subtree_tokens) / total;
    cursor += w[r];
  }
  let maxDepth = 0;
  for (let i = 0; i < n; i++) {  // parents come first, so their x and w are already set
    const c = kids[i];
    if (!c) continue;
    c.sort((a, b) => nodes[b].subtree_tokens - nodes[a].subtree_tokens);
    const scale = w[i] / Math.max(1, nodes[i].subtree_tokens);
    let cx = x[i];
    for (const k of c) {
      x[k] = cx;
      w[k] = nodes[k].subtree_tokens * scale;
      cx += w[k];
      depth[k] = depth[i] + 1;
      if (depth[k] > maxDepth) maxDepth = depth[k];
    }
  }
  return { x, w, depth, maxDepth, roots };
}

function drawTree(panel) {
  const tree = panel.tree;
  if (!tree) return;
  const t0 = performance.now();
  const canvas = panel.canvas;
  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth;
  const lay = layoutTree(tree, cssW);
  const rowH = Math.max(ROW_MIN, Math.min(ROW_MAX, Math.floor(TREE_MAX_PX / (lay.maxDepth + 1))));
  const cssH = Math.max(120, Math.min(TREE_MAX_PX, rowH * (lay.maxDepth + 1)));
  canvas.style.height = cssH + "px";
  canvas.width = Math.round(cssW * dpr);
  canvas.height = Math.round(cssH * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  const nodes = tree.nodes;
  const byHits = $("#colour").value === "hits";
  let maxAge = 1;
  let maxHits = 1;
  for (const nd of nodes) {
    if (nd.age_s !== null && nd.age_s > maxAge) maxAge = nd.age_s;
    if (nd.hits > maxHits) maxHits = nd.hits;
  }
  const levels = [];  // per depth: node indices in x order, for hit testing
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  for (let i = 0; i < nodes.length; i++) {
    const nd = nodes[i];
    const d = lay.depth[i];
    if ((d + 1) * rowH > cssH) continue;
    (levels[d] || (levels[d] = [])).push(i);
    const x = lay.x[i];
    const w = lay.w[i];
    if (w < 0.3) continue;
    const y = d * rowH;
    const isRoot = nd.parent === null;
    let fill;
    if (isRoot) fill = "#3a3f4b";
    else if (nd.aggregated) fill = "#555b66";
    else if (byHits) fill = ramp(Math.log1p(nd.hits) / Math.log1p(maxHits));
    else fill = ramp(nd.age_s === null ? 0 : 1 - Math.log1p(nd.age_s) / Math.log1p(maxAge));
    ctx.fillStyle = fill;
    ctx.fillRect(x, y, Math.max(0.5, w - (w > 3 ? 1 : 0)), rowH - (rowH > 4 ? 1 : 0));
    if (nd.lock_ref > 0 && !isRoot) {  // locked: a red bar on top of the node
      ctx.fillStyle = "#ff4d4d";
      ctx.fillRect(x, y, Math.max(1, w - 1), Math.max(1, Math.min(3, rowH / 4)));
    }
    if (w > 44 && rowH >= 12) {
      let label;
      if (isRoot) label = (nd.namespace === null ? "default" : nd.namespace) + ` · ${fmt(nd.subtree_tokens)} tok`;
      else if (nd.aggregated) label = `+${nd.aggregated} subtrees · ${fmt(nd.tokens)} tok`;
      else label = nd.text !== undefined ? nd.text.replace(/\s+/g, " ") : `${fmt(nd.tokens)} tok`;
      ctx.save();
      ctx.beginPath();
      ctx.rect(x + 2, y, w - 4, rowH);
      ctx.clip();
      ctx.fillStyle = isRoot || nd.aggregated || byHits ? "#f0f0f0" : "#101010";
      if (!isRoot && !nd.aggregated) {
        const t = byHits ? Math.log1p(nd.hits) / Math.log1p(maxHits)
                         : (nd.age_s === null ? 0 : 1 - Math.log1p(nd.age_s) / Math.log1p(maxAge));
        ctx.fillStyle = t > 0.55 ? "#101010" : "#f0f0f0";
      }
      ctx.fillText(label, x + 3, y + rowH / 2);
      ctx.restore();
    }
  }
  panel.layout = { ...lay, rowH, levels };
  const ms = performance.now() - t0;
  panel.renderMs = ms;
  $("#render-ms").textContent = ms.toFixed(1);
  const legend = byHits ? `hits 0 <span class="swatch"></span> ${fmt(maxHits)}`
                        : `age ${fmtAge(maxAge)} <span class="swatch"></span> now`;
  panel.el.querySelector(".legend").innerHTML =
    legend + ' <span><span class="swatch" style="background:#ff4d4d;width:14px"></span>locked</span>' +
    ' <span><span class="swatch" style="background:#555b66;width:14px"></span>folded subtrees</span>';
  const sw = panel.el.querySelector(".legend .swatch");
  sw.style.background = `linear-gradient(90deg, ${ramp(0)}, ${ramp(0.5)}, ${ramp(1)})`;
}

function nodeAt(panel, px, py) {
  const lay = panel.layout;
  if (!lay) return -1;
  const level = lay.levels[Math.floor(py / lay.rowH)];
  if (!level) return -1;
  let lo = 0;
  let hi = level.length - 1;
  // Nodes of one level do not overlap; find the last one starting at or before px.
  const xs = level.map((i) => lay.x[i]);
  const order = level.map((_, k) => k).sort((a, b) => xs[a] - xs[b]);
  while (lo < hi) {
    const mid = (lo + hi + 1) >> 1;
    if (xs[order[mid]] <= px) lo = mid;
    else hi = mid - 1;
  }
  const i = level[order[lo]];
  return i !== undefined && px >= lay.x[i] && px <= lay.x[i] + lay.w[i] ? i : -1;
}

function showTip(panel, ev) {
  const tip = panel.tip;
  const rect = panel.canvas.getBoundingClientRect();
  const px = ev.clientX - rect.left;
  const py = ev.clientY - rect.top;
  const i = nodeAt(panel, px, py);
  if (i < 0) {
    tip.hidden = true;
    return;
  }
  const nd = panel.tree.nodes[i];
  const lines = [];
  if (nd.parent === null) {
    lines.push(`<b>namespace ${escapeHtml(nd.namespace === null ? "default" : nd.namespace)}</b>`);
  } else if (nd.aggregated) {
    lines.push(`<b>${nd.aggregated} smaller subtrees folded</b> (${nd.subtree_nodes} nodes)`);
  } else if (nd.text !== undefined) {
    lines.push(`<b>${escapeHtml(truncate(nd.text, TIP_TEXT_CHARS))}</b>`);
  } else {
    lines.push("<b>(text hidden: the server has an API key; see --dashboard-show-text)</b>");
  }
  lines.push(`tokens ${nd.tokens} · subtree ${nd.subtree_tokens} tok / ${nd.subtree_nodes} nodes`);
  if (nd.parent !== null) {
    lines.push(`prefix ends at token ${nd.depth_tokens + (nd.aggregated ? 0 : 0)} · hits ${nd.hits}`);
    lines.push(`last used ${fmtAge(nd.age_s)} ago · ${nd.lock_ref > 0 ? `locked by ${nd.lock_ref}` : "unlocked"}`);
  }
  tip.innerHTML = lines.join("\n");
  tip.hidden = false;
  const left = Math.min(px + 14, rect.width - tip.offsetWidth - 4);
  tip.style.left = Math.max(0, left) + "px";
  tip.style.top = py + 16 + "px";
}

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// The widest node below the namespace roots, as drawn (used by tests and the summary line).
function widestNode(panel) {
  const lay = panel.layout;
  if (!lay) return null;
  let best = -1;
  panel.tree.nodes.forEach((nd, i) => {
    if (nd.parent !== null && !nd.aggregated && (best < 0 || lay.w[i] > lay.w[best])) best = i;
  });
  if (best < 0) return null;
  const nd = panel.tree.nodes[best];
  return { text: nd.text === undefined ? null : nd.text, tokens: nd.tokens,
           subtree_tokens: nd.subtree_tokens, hits: nd.hits, x_px: lay.x[best], width_px: lay.w[best],
           depth: lay.depth[best] };
}

// ------------------------------------------------------------------ time series

const CHARTS = [
  { id: "hit", title: "prefix hit ratio (10 s window)", unit: "", lines: [["window", "#5ec962"]], max: 1 },
  { id: "ttft", title: "TTFT (10 s window)", unit: " s", lines: [["p50", "#21918c"], ["p99", "#fde725"]] },
  { id: "saved", title: "prefill tokens saved", unit: "/s", lines: [["saved", "#5ec962"]] },
  { id: "pool", title: "KV pool blocks", unit: "",
    lines: [["free", "#8a8f98"], ["cached", "#21918c"], ["locked", "#ff4d4d"], ["private", "#fde725"]] },
  { id: "evict", title: "evicted blocks", unit: "/s", lines: [["evicted", "#f4a261"]] },
  { id: "preempt", title: "preemptions", unit: "/s", lines: [["preempted", "#e76f51"]] },
];

function makeCharts(panel) {
  const box = panel.el.querySelector(".charts");
  panel.series = {};
  panel.charts = {};
  for (const c of CHARTS) {
    const div = document.createElement("div");
    div.className = "chart";
    div.innerHTML = `<div class="label"><span>${c.title}</span><b></b></div><canvas></canvas>`;
    box.appendChild(div);
    panel.charts[c.id] = { spec: c, canvas: $("canvas", div), value: $("b", div) };
    for (const [name] of c.lines) panel.series[`${c.id}.${name}`] = [];
  }
}

function push(panel, key, t, v) {
  const s = panel.series[key];
  s.push([t, v]);
  if (s.length > SERIES_POINTS) s.shift();
}

function drawChart(panel, id, summary) {
  const { spec, canvas, value } = panel.charts[id];
  const dpr = window.devicePixelRatio || 1;
  const W = canvas.clientWidth;
  const H = canvas.clientHeight;
  canvas.width = Math.round(W * dpr);
  canvas.height = Math.round(H * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  const all = spec.lines.map(([name]) => panel.series[`${id}.${name}`]);
  const pts = all.flat().filter((p) => p[1] !== null);
  value.textContent = summary;
  if (!pts.length) return;
  const tMax = Math.max(...pts.map((p) => p[0]));
  const tMin = tMax - SERIES_POINTS * (STATS_MS / 1000);
  const yMax = spec.max || Math.max(1e-9, ...pts.map((p) => p[1])) * 1.1;
  ctx.strokeStyle = "#2a2f3a";
  ctx.beginPath();
  ctx.moveTo(0, H - 0.5);
  ctx.lineTo(W, H - 0.5);
  ctx.stroke();
  ctx.fillStyle = "#8a8f98";
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText(fmt(yMax, yMax < 10 ? 2 : 0) + spec.unit, 2, 10);
  spec.lines.forEach(([name, colour], k) => {
    ctx.strokeStyle = colour;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    const dots = [];
    const line = all[k];
    line.forEach(([t, v], j) => {
      if (v === null) { pen = false; return; }
      const x = ((t - tMin) / (tMax - tMin)) * W;
      const y = H - 2 - (v / yMax) * (H - 14);
      if (pen) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      const next = line[j + 1];
      if (!pen && (!next || next[1] === null)) dots.push([x, y]);  // a point with no line
      pen = true;
    });
    ctx.stroke();
    ctx.fillStyle = colour;
    for (const [x, y] of dots) ctx.fillRect(x - 1.5, y - 1.5, 3, 3);
    ctx.fillStyle = colour;
    ctx.fillText(name, W - 60 * (spec.lines.length - k), 10);
  });
}

// Differences against the stats of WINDOW_S ago give a windowed hit ratio and TTFT quantiles
// (as PromQL's rate() over a range would); rates use the last poll interval.
function onStats(panel, s) {
  const hist = panel.history;
  if (hist.length && s.prefix_cache_queries < hist[hist.length - 1].prefix_cache_queries) {
    hist.length = 0;  // the server restarted: its counters began again
  }
  const prev = hist.length ? hist[hist.length - 1] : null;
  hist.push(s);
  while (hist.length > 2 && s.time - hist[1].time >= WINDOW_S) hist.shift();
  if (!prev) return;
  const base = hist[0];
  const t = s.time;
  const dt = Math.max(1e-3, t - prev.time);
  const dq = s.prefix_cache_queries - base.prefix_cache_queries;
  const dh = s.prefix_cache_hits - base.prefix_cache_hits;
  push(panel, "hit.window", t, dq > 0 ? dh / dq : null);
  const inc = s.ttft.buckets.map(([le, c], k) => [le, c - (base.ttft.buckets[k] ? base.ttft.buckets[k][1] : 0)]);
  push(panel, "ttft.p50", t, histQuantile(0.5, inc));
  push(panel, "ttft.p99", t, histQuantile(0.99, inc));
  push(panel, "saved.saved", t, (s.prefix_cache_hits - prev.prefix_cache_hits) / dt);
  const b = s.blocks;
  push(panel, "pool.free", t, b.free);
  push(panel, "pool.cached", t, b.cached - b.locked);
  push(panel, "pool.locked", t, b.locked);
  push(panel, "pool.private", t, Math.max(0, b.total - b.free - b.cached));
  push(panel, "evict.evicted", t, (s.evicted_blocks - prev.evicted_blocks) / dt);
  push(panel, "preempt.preempted", t, (s.preemptions - prev.preemptions) / dt);
  const overall = s.prefix_cache_queries ? s.prefix_cache_hits / s.prefix_cache_queries : 0;
  const last = (key) => { const a = panel.series[key]; return a.length ? a[a.length - 1][1] : null; };
  drawChart(panel, "hit", `${(overall * 100).toFixed(1)}% overall`);
  drawChart(panel, "ttft", `p50 ${fmt(last("ttft.p50"), 3)} · p99 ${fmt(last("ttft.p99"), 3)}`);
  drawChart(panel, "saved", `${fmt(s.prefix_cache_hits)} total`);
  drawChart(panel, "pool", `${b.free} free / ${b.total}`);
  drawChart(panel, "evict", `${fmt(s.evicted_blocks)} total`);
  drawChart(panel, "preempt", `${fmt(s.preemptions)} total`);
}

// ------------------------------------------------------------------ top prefixes

function drawTop(panel) {
  const body = panel.el.querySelector("table.top tbody");
  const rows = panel.tree.top_prefixes || [];
  body.innerHTML = rows.map((p, k) => {
    let text = "(hidden: token counts only)";
    if (p.text !== undefined) {
      text = p.last_text === p.text ? truncate(p.text, 140) : `${truncate(p.text, 80)} … ${truncate(p.last_text, 60)}`;
    }
    return `<tr><td>${k + 1}</td><td>${escapeHtml(p.namespace === null ? "default" : p.namespace)}</td>` +
      `<td class="text" title="${escapeHtml(text)}">${escapeHtml(text)}</td><td class="num">${p.tokens}</td>` +
      `<td class="num">${p.hits}</td><td class="num">${fmt(p.saved_tokens)}</td>` +
      `<td class="num">${fmtAge(p.age_s)}</td><td>${p.lock_ref > 0 ? "yes" : ""}</td></tr>`;
  }).join("") || '<tr><td colspan="8">no prefix reused yet</td></tr>';
}

// ------------------------------------------------------------------ panels and polling

function makePanel(spec) {
  const el = $("#panel-template").content.firstElementChild.cloneNode(true);
  $("#panels").appendChild(el);
  el.querySelector(".panel-name").textContent = spec.name;
  const panel = { spec, el, canvas: $("canvas.tree", el), tip: $(".tip", el), tree: null,
                  layout: null, history: [], renderMs: null, fetchMs: null, busy: {} };
  makeCharts(panel);
  panel.canvas.addEventListener("mousemove", (ev) => showTip(panel, ev));
  panel.canvas.addEventListener("mouseleave", () => { panel.tip.hidden = true; });
  return panel;
}

async function pollTree(panel) {
  if (panel.busy.tree) return;
  panel.busy.tree = true;
  try {
    const t0 = performance.now();
    const tree = await getJSON(`${panel.spec.base}/cache/tree?max_nodes=${$("#max-nodes").value}`);
    panel.fetchMs = performance.now() - t0;
    $("#fetch-ms").textContent = panel.fetchMs.toFixed(0);
    panel.tree = tree;
    if (tree.enabled === false) {
      panel.el.querySelector(".tree-summary").textContent = "prefix cache disabled on this server";
      return;
    }
    drawTree(panel);
    drawTop(panel);
    const shown = tree.nodes.filter((n) => n.parent !== null).length;
    panel.el.querySelector(".tree-summary").textContent =
      `${fmt(tree.num_nodes)} nodes, ${fmt(tree.cached_tokens)} cached tokens, ` +
      `${tree.num_namespaces} namespace(s); ${shown} drawn` + (tree.text ? "" : "; text hidden (API key)");
    setStatus("live · " + new Date().toLocaleTimeString());
  } catch (e) {
    setStatus(`${panel.spec.name}: ${e.message}`, true);
  } finally {
    panel.busy.tree = false;
  }
}

async function pollStats(panel) {
  if (panel.busy.stats) return;
  panel.busy.stats = true;
  try {
    onStats(panel, await getJSON(`${panel.spec.base}/dashboard/stats`));
  } catch (e) {
    setStatus(`${panel.spec.name}: ${e.message}`, true);
  } finally {
    panel.busy.stats = false;
  }
}

function tick(kind) {
  if ($("#pause").checked) return;
  for (const p of state.panels) (kind === "tree" ? pollTree : pollStats)(p);
}

async function main() {
  const hashKey = new URLSearchParams(location.hash.slice(1)).get("key");
  if (hashKey) {
    state.key = hashKey;
    sessionStorage.setItem("radixserve-key", hashKey);
    history.replaceState(null, "", location.pathname);  // keep the key out of the address bar
  }
  const cfg = await (await fetch("/dashboard/config.json", { cache: "no-store" })).json();
  state.config = cfg;
  $("#title").textContent = cfg.title;
  document.title = cfg.title;
  if (cfg.auth && !state.key) $("#key-form").hidden = false;
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("#key").value.trim();
    sessionStorage.setItem("radixserve-key", state.key);
    $("#key-form").hidden = true;
    tick("tree");
    tick("stats");
  });
  $("#colour").addEventListener("change", () => state.panels.forEach(drawTree));
  $("#max-nodes").addEventListener("change", () => tick("tree"));
  window.addEventListener("resize", () => state.panels.forEach(drawTree));
  state.panels = cfg.panels.map(makePanel);
  tick("tree");
  tick("stats");
  setInterval(() => tick("tree"), TREE_MS);
  setInterval(() => tick("stats"), STATS_MS);
}

// For tests and the curious: the panels' state, the widest node, and a timed render.
window.radixDashboard = {
  state,
  widestNode: (k = 0) => widestNode(state.panels[k]),
  series: (k = 0) => state.panels[k].series,
  renderTree: (k, tree) => { const p = state.panels[k]; p.tree = tree; drawTree(p); return p.renderMs; },
};

main().catch((e) => setStatus("cannot start: " + e.message, true));
