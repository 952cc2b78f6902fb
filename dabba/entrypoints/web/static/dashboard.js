// The dashboard: engine snapshots from /engine/stats/stream (one per step or per 250 ms, whichever
// is rarer), drawn as cards, two charts over the last five minutes, and the KV blocks as a grid.
"use strict";

const $ = (id) => document.getElementById(id);
const WINDOW_MS = 5 * 60 * 1000;
const RATE_MS = 5000;  // the throughput card's window
const BLOCK_COLOURS = { ".": "--free", c: "--cached", u: "--used", s: "--shared" };
const points = [];  // {t, generated, prompt, running, waiting, stepTokens}: one per snapshot or idle second
let last = null;  // the latest snapshot
let lastAt = 0;  // when it came (this page's clock)

function cssColour(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// Tokens per second between the newest point and the one about ms before it.
function rate(key, ms) {
  if (points.length < 2) return 0;
  const end = points[points.length - 1];
  let start = points[0];
  for (let i = points.length - 2; i >= 0; i--) {
    start = points[i];
    if (end.t - points[i].t >= ms) break;
  }
  return end.t > start.t ? (end[key] - start[key]) / ((end.t - start.t) / 1000) : 0;
}

function addPoint(t, snapshot) {
  points.push({ t, generated: snapshot.generated_tokens, prompt: snapshot.prompt_tokens, running: snapshot.running,
                waiting: snapshot.waiting, stepTokens: snapshot.step_tokens });
  while (points.length && points[0].t < t - WINDOW_MS) points.shift();
}

function onSnapshot(snapshot) {
  last = snapshot;
  lastAt = performance.now();
  addPoint(lastAt, snapshot);
  $("running").textContent = snapshot.running;
  $("waiting").textContent = snapshot.waiting;
  // data-parallel replicas: the cards sum them; each one's share under the sums
  const replicas = snapshot.replicas;
  $("running-sub").textContent = replicas
    ? `replicas: ${replicas.map((r) => r.running).join(" · ")}` : "requests in the batch";
  $("step-tokens").textContent = snapshot.step_tokens;
  $("step").textContent = `step ${snapshot.step}`;
  const prefix = snapshot.prefix_cache;
  $("prefix-hit").textContent = `${formatNumber(100 * prefix.hit_rate, 0)}%`;
  $("prefix-tokens").textContent = `${prefix.hit_tokens} of ${prefix.queried_tokens} prompt tokens`;
  const kv = snapshot.kv;
  $("kv-usage").textContent = `${formatNumber(100 * kv.usage, 1)}%`;
  $("kv-blocks").textContent = replicas
    ? `replicas: ${replicas.map((r) => `${formatNumber(100 * r.kv_usage, 1)}%`).join(" · ")}`
    : `${kv.blocks_in_use} of ${kv.blocks} blocks in use`;
  $("generated").textContent = snapshot.generated_tokens;
  $("prompted").textContent = `tokens in all; ${snapshot.prompt_tokens} prompt tokens`;
  $("preemptions").textContent = snapshot.preemptions;
  const spec = snapshot.spec_decode;
  $("spec").textContent = spec.draft_tokens ? `drafts accepted: ${formatNumber(100 * spec.acceptance_rate, 0)}%` : "\u00a0";
  $("kv-total").textContent = kv.blocks;
  $("kv-block-size").textContent = kv.block_size;
  for (const key of ["free", "cached", "used", "shared"]) $(`kv-${key}`).textContent = kv[key];
  drawGrid(kv.grid);
  refresh();
}

// Cards and charts that move with time: the throughput falls to zero when no step comes.
function refresh() {
  $("throughput").textContent = formatNumber(rate("generated", RATE_MS));
  const seconds = last ? Math.round((performance.now() - lastAt) / 1000) : null;
  $("status").textContent = last ? (seconds < 2 ? "live" : `idle · last step ${seconds} s ago`) : "connecting…";
  drawCharts();
}

function fitCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

// Lines of series [{values, colour}] over the last WINDOW_MS, ending now.
function drawLines(canvas, times, series) {
  const { ctx, width, height } = fitCanvas(canvas);
  const now = performance.now();
  const top = Math.max(1, ...series.flatMap((s) => s.values));
  ctx.strokeStyle = cssColour("--line");
  ctx.fillStyle = cssColour("--muted");
  ctx.font = "11px system-ui";
  ctx.beginPath();
  ctx.moveTo(0, height - 0.5);
  ctx.lineTo(width, height - 0.5);
  ctx.stroke();
  ctx.fillText(formatNumber(top, 0), 4, 12);
  for (const { values, colour } of series) {
    ctx.strokeStyle = colour;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    values.forEach((v, i) => {
      const x = width * (1 - (now - times[i]) / WINDOW_MS);
      const y = height - 2 - (height - 16) * (v / top);
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
  }
}

function drawCharts() {
  const times = [], generated = [], prompt = [];
  for (let i = 1; i < points.length; i++) {
    const dt = (points[i].t - points[i - 1].t) / 1000;
    if (dt <= 0) continue;
    times.push(points[i].t);
    generated.push((points[i].generated - points[i - 1].generated) / dt);
    prompt.push((points[i].prompt - points[i - 1].prompt) / dt);
  }
  drawLines($("throughput-chart"), times, [{ values: generated, colour: "#2f6fdf" }, { values: prompt, colour: "#e09a2d" }]);
  drawLines($("batch-chart"), points.map((p) => p.t), [
    { values: points.map((p) => p.running), colour: "#3fa66b" },
    { values: points.map((p) => p.waiting), colour: "#c23b3b" },
    { values: points.map((p) => p.stepTokens / 16), colour: "#6b7280" },
  ]);
}

// A square cell per block, as large as the panel allows.
function drawGrid(grid) {
  const canvas = $("kv-grid");
  const { ctx, width, height } = fitCanvas(canvas);
  const n = grid.length;
  if (!n) return;
  let cell = Math.max(1, Math.floor(Math.sqrt((width * height) / n)));
  while (cell > 1 && Math.floor(width / cell) * Math.floor(height / cell) < n) cell--;
  const perRow = Math.max(1, Math.floor(width / cell));
  const gap = cell >= 6 ? 1 : 0;
  const colours = Object.fromEntries(Object.entries(BLOCK_COLOURS).map(([k, v]) => [k, cssColour(v)]));
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = colours[grid[i]];
    ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - gap, cell - gap);
  }
}

async function connect() {
  // a server of several models: the one chosen (a new choice reloads the page: its charts are that engine's)
  const model = await pickModel($("model"), (id) => { location.search = `?model=${encodeURIComponent(id)}`; }, true);
  const query = model ? `?model=${encodeURIComponent(model)}` : "";
  for (;;) {
    try {
      const response = await apiFetch(`/engine/stats/stream${query}`);
      if (!response.ok) throw new Error(await errorText(response));
      await readEvents(response, (data) => onSnapshot(JSON.parse(data)));
      $("status").textContent = "disconnected; reconnecting…";
    } catch (e) {
      $("status").textContent = `${e.message}; reconnecting…`;
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

// With no snapshot for a second the engine is idle: a point at the last totals keeps the
// charts moving (and the throughput falling to zero).
setInterval(() => {
  if (last && performance.now() - points[points.length - 1].t >= 1000) addPoint(performance.now(), last);
  refresh();
}, 1000);
window.addEventListener("resize", () => last && drawGrid(last.kv.grid));
connect();
