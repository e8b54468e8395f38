/* rltune dashboard: polls the JSON API for new rows only and keeps the charts, the
   rollout table and the config view up to date. Plain browser JavaScript, no build. */
(() => {
  "use strict";

  const POLL_MS = 1500;
  const PAGE_ROWS = 25;
  const TRUNCATE_AT = 240;
  const PALETTE = ["#2563eb", "#e4572e", "#0f9f6e", "#9b51e0", "#d4a017", "#0891b2",
    "#db2777", "#65a30d", "#475569", "#b45309"];
  const DASHES = [[], [6, 4], [2, 3], [10, 3, 2, 3], [1, 2]];

  /** Metric names, as the server's /api/keys gives them (rltune/metrics/keys.py): the
      page holds no list of names of its own. Set by defineCharts before the first chart. */
  let K = null;
  let CHARTS = [];
  let chartKeys = new Set();

  /** The reward function a key is the mean of (reward/NAME), or null for a statistic of the total or a nested key. */
  function rewardFnName(key) {
    const prefix = K.reward + K.sep;
    if (!key.startsWith(prefix)) return null;
    const name = key.slice(prefix.length);
    return name.includes(K.sep) || K.reward_stats.includes(name) ? null : name;
  }
  const isRewardFnKey = (key) => rewardFnName(key) !== null;

  function defineCharts(keys) {
    K = keys;
    CHARTS = [
      {
        id: "reward", title: "Reward", note: "mean · per function · eval",
        series: (run) => [
          { key: K.reward_mean, label: "mean", width: 2.25 },
          ...run.rewardFns().map((key, i) => ({
            key, label: rewardFnName(key), width: 1.25, dash: DASHES[1 + (i % (DASHES.length - 1))], fade: 0.35,
          })),
          { key: K.eval_reward_mean, label: "eval", width: 2, dash: [2, 3], points: true },
        ],
      },
      { id: "grad_norm", title: "Gradient norm", series: () => [{ key: K.grad_norm, label: "grad norm" }] },
      {
        id: "kl", title: "KL divergence", note: `${K.kl} · ${K.approx_kl}`,
        series: () => [{ key: K.kl, label: "kl" }, { key: K.approx_kl, label: "approx kl", dash: [6, 4], fade: 0.3 }],
      },
      { id: "entropy", title: "Entropy", series: () => [{ key: K.entropy, label: "entropy" }] },
      {
        id: "length", title: "Response length", note: "tokens · mean and max",
        series: () => [{ key: K.length_mean, label: "mean" }, { key: K.length_max, label: "max", dash: [6, 4], fade: 0.3 }],
      },
      {
        id: "throughput", title: "Throughput", note: "samples/s (left) · tokens/s (right)",
        rightAxis: "tokens",
        series: () => [
          { key: K.samples_per_s, label: "samples/s" },
          { key: K.tokens_per_s, label: "tokens/s", dash: [6, 4], fade: 0.3, scale: "tokens" },
        ],
      },
      {
        id: "time", title: "Time per step", note: "seconds by phase",
        series: () => K.time_phases.map(([key, phase], i) => ({
          key, label: phase, dash: DASHES[i % DASHES.length], fade: Math.min(0.6, i * 0.14),
        })),
      },
      { id: "loss", title: "Loss", series: () => [{ key: K.loss, label: "loss" }] },
    ];
    chartKeys = new Set([K.eval_reward_mean, K.reward_mean]);
    for (const chart of CHARTS) {
      if (chart.id !== "reward") chart.series(null).forEach((s) => chartKeys.add(s.key));
    }
  }
  const isChartKey = (key) => chartKeys.has(key) || isRewardFnKey(key);

  // ---------------------------------------------------------------- state

  class RunState {
    constructor(id) {
      this.id = id;
      this.info = null;
      this.metricsCursor = null;
      this.series = new Map(); // key -> {x: [], y: []}, sorted by step
      this.samplesCursor = null;
      this.samples = [];
      this.nextSeq = 0;
    }

    rewardFns() {
      return [...this.series.keys()].filter(isRewardFnKey).sort();
    }

    clearMetrics() { this.series = new Map(); }

    clearSamples() { this.samples = []; }

    addMetricsRow(row) {
      const step = row.step;
      if (typeof step !== "number") return;
      for (const [key, value] of Object.entries(row)) {
        if (key === "step" || !isChartKey(key)) continue;
        if (value !== null && typeof value !== "number") continue;
        let series = this.series.get(key);
        if (!series) this.series.set(key, (series = { x: [], y: [] }));
        addPoint(series, step, value);
      }
    }
  }

  /** Put (step, value) into a step-sorted series; a repeated step replaces the value. */
  function addPoint(series, step, value) {
    const xs = series.x;
    const n = xs.length;
    if (n === 0 || step > xs[n - 1]) {
      xs.push(step);
      series.y.push(value);
      return;
    }
    let lo = 0;
    let hi = n;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (xs[mid] < step) lo = mid + 1; else hi = mid;
    }
    if (xs[lo] === step) series.y[lo] = value;
    else { xs.splice(lo, 0, step); series.y.splice(lo, 0, value); }
  }

  const state = {
    runs: new Map(),
    order: [],
    selected: [],
    colours: new Map(),
    roots: [],
    sampleCap: 5000,
    serverNow: 0,
    metricsDirty: true,
    samplesDirty: true,
    pendingSamples: 0,
    configRun: null,
    configShown: null,
    charts: new Map(),
    items: new Map(),
    table: { sortKey: "step", sortDir: "desc", shown: PAGE_ROWS, expanded: new Set() },
    firstList: true,
  };

  // ---------------------------------------------------------------- small utilities

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else if (name.startsWith("data-")) node.dataset[toCamel(name.slice(5))] = value;
      else node.setAttribute(name, value === true ? "" : value);
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);
    }
    return node;
  }

  const toCamel = (name) => name.replace(/-([a-z])/g, (_, c) => c.toUpperCase());

  /** Control characters made visible (U+2400 block); newlines and tabs kept. */
  const visible = (text) => String(text).replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g,
    (ch) => (ch === "\u007f" ? "\u2421" : String.fromCharCode(0x2400 + ch.charCodeAt(0))));

  function fmtNum(value) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    if (value === 0) return "0";
    const abs = Math.abs(value);
    if (abs >= 1e6 || abs < 1e-3) return value.toExponential(2);
    return String(Number(value.toPrecision(4)));
  }

  function fmtAxis(value) {
    if (value === 0) return "0";
    const abs = Math.abs(value);
    if (abs >= 1e6 || abs < 1e-3) return value.toExponential(1);
    if (abs >= 1e4) return `${Number((value / 1e3).toPrecision(3))}k`;
    return String(Number(value.toPrecision(3)));
  }

  function ago(seconds) {
    if (seconds < 5) return "just now";
    if (seconds < 90) return `${Math.round(seconds)} s ago`;
    if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
    if (seconds < 129600) return `${Math.round(seconds / 3600)} h ago`;
    return `${Math.round(seconds / 86400)} d ago`;
  }

  /** Mix a #rrggbb colour towards white by `amount` (0..1). */
  function fade(hex, amount) {
    if (!amount) return hex;
    const n = parseInt(hex.slice(1), 16);
    const mix = (c) => Math.round(c + (255 - c) * amount);
    const [r, g, b] = [(n >> 16) & 255, (n >> 8) & 255, n & 255].map(mix);
    return `#${((1 << 24) | (r << 16) | (g << 8) | b).toString(16).slice(1)}`;
  }

  class HttpError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function getJSON(path) {
    const response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
    if (!response.ok) {
      let detail = "";
      try { detail = (await response.json()).error || ""; } catch (_) { /* a text body */ }
      throw new HttpError(response.status, `${path}: ${response.status} ${detail}`.trim());
    }
    return response.json();
  }

  const query = (params) => new URLSearchParams(
    Object.entries(params).filter(([, v]) => v !== null && v !== undefined)).toString();

  function setStatus(kind, text) {
    const node = document.getElementById("status");
    node.dataset.state = kind;
    node.textContent = text;
  }

  // ---------------------------------------------------------------- runs

  async function refreshRuns() {
    const body = await getJSON("/api/runs");
    state.roots = body.roots;
    state.sampleCap = body.sample_cap;
    state.serverNow = body.now;
    const known = new Set(state.order);
    for (const info of body.runs) {
      if (!state.runs.has(info.id)) state.runs.set(info.id, new RunState(info.id));
      state.runs.get(info.id).info = info;
    }
    state.order = body.runs.map((info) => info.id);
    if (state.firstList && body.runs.length) {
      state.firstList = false;
      const newest = [...body.runs].sort((a, b) => (b.last_write || 0) - (a.last_write || 0)).slice(0, 4);
      const chosen = new Set(newest.map((info) => info.id));
      state.order.filter((id) => chosen.has(id)).forEach(select);
    } else {
      // a run that starts while the dashboard is open is shown at once, up to 4 runs
      for (const info of body.runs) {
        const fresh = !known.has(info.id);
        if (fresh && (state.selected.length === 0 || (info.live && state.selected.length < 4))) select(info.id);
      }
    }
    renderRunList();
  }

  function select(id) {
    if (state.selected.includes(id)) return;
    const used = new Set(state.selected.map((other) => state.colours.get(other)));
    const own = state.colours.get(id);
    const colour = own && !used.has(own) ? own : PALETTE.find((c) => !used.has(c)) ||
      PALETTE[state.selected.length % PALETTE.length];
    state.colours.set(id, colour);
    state.selected.push(id);
    state.metricsDirty = true;
    state.samplesDirty = true;
    if (!state.configRun) state.configRun = id;
  }

  function deselect(id) {
    state.selected = state.selected.filter((other) => other !== id);
    state.metricsDirty = true;
    state.samplesDirty = true;
  }

  /** The run list, updated in place: an item is made once per run, so a click or the
      keyboard focus is never lost to a redraw. */
  function renderRunList() {
    const list = document.getElementById("run-list");
    const empty = document.getElementById("run-empty");
    const count = document.getElementById("run-count");
    count.textContent = state.order.length ? `${state.selected.length} of ${state.order.length} shown` : "";
    empty.hidden = state.order.length > 0;
    if (!state.order.length) {
      const where = state.roots.map((root) => root.path).join(", ");
      empty.textContent = `No runs yet in ${where}. A run appears here as soon as training starts writing it.`;
    }
    for (const id of state.order) {
      if (!state.items.has(id)) state.items.set(id, runItem(id));
      updateRunItem(state.items.get(id), state.runs.get(id));
    }
    const wanted = state.order.map((id) => state.items.get(id).li);
    if (wanted.length !== list.children.length || wanted.some((li, i) => list.children[i] !== li)) {
      list.replaceChildren(...wanted);
    }
    renderRunChoices();
  }

  function runItem(id) {
    const box = el("input", { type: "checkbox", "aria-label": `show ${id}` });
    box.addEventListener("change", () => {
      if (box.checked) select(id); else deselect(id);
      renderRunList();
      renderAll();
      poll.now();
    });
    const swatch = el("span", { class: "swatch" });
    const meta = el("span", { class: "run-meta" });
    const label = el("label", {}, box, swatch, el("span", { class: "run-name", text: id }), meta);
    return { li: el("li", { "data-run": id }, label), label, box, swatch, meta, metaText: "" };
  }

  function updateRunItem(item, run) {
    const info = run.info;
    const selected = state.selected.includes(run.id);
    item.box.checked = selected;
    item.li.classList.toggle("selected", selected);
    item.li.dataset.live = info.live ? "true" : "false";
    item.label.title = info.path;
    item.swatch.style.background = selected ? state.colours.get(run.id) : "";
    const step = info.last_step === null ? "no steps yet" : `step ${info.last_step}`;
    const when = info.live ? "live" : info.last_write === null ? "no files yet" : ago(state.serverNow - info.last_write);
    const text = `${step}|${when}`;
    if (text !== item.metaText) {
      item.metaText = text;
      item.meta.replaceChildren(el("span", { text: step }), el("span", { text: "·" }),
        el("span", { class: info.live ? "live-badge" : "", text: when }));
    }
  }

  /** Replace a select's options only when the choices changed (an open menu stays open). */
  function setOptions(select, choices) {
    const signature = JSON.stringify(choices);
    if (select.dataset.choices === signature) return;
    const current = select.value;
    select.dataset.choices = signature;
    select.replaceChildren(...choices.map(([value, text]) => el("option", { value, text })));
    if (choices.some(([value]) => value === current)) select.value = current;
  }

  /** The run pickers of the rollout filter and the config view. */
  function renderRunChoices() {
    const runFilter = document.getElementById("f-run");
    setOptions(runFilter, [["", "all selected runs"], ...state.selected.map((id) => [id, id])]);

    const configPick = document.getElementById("config-run");
    if (state.configRun && !state.runs.has(state.configRun)) state.configRun = null;
    if (!state.configRun && state.order.length) state.configRun = state.selected[0] || state.order[0];
    setOptions(configPick, state.order.map((id) => [id, id]));
    if (state.configRun && configPick.value !== state.configRun) configPick.value = state.configRun;
  }

  // ---------------------------------------------------------------- data

  async function pullMetrics(run) {
    for (let round = 0; round < 20; round++) {
      const body = await getJSON(`/api/metrics?${query({ run: run.id, cursor: run.metricsCursor })}`);
      if (body.reset) run.clearMetrics();
      body.rows.forEach((row) => run.addMetricsRow(row));
      if (body.reset || body.rows.length) state.metricsDirty = true;
      run.metricsCursor = body.cursor;
      if (!body.more) return;
    }
  }

  async function pullSamples(run) {
    for (let round = 0; round < 10; round++) {
      const body = await getJSON(`/api/samples?${query({ run: run.id, cursor: run.samplesCursor })}`);
      if (body.reset) run.clearSamples();
      for (const row of body.rows) {
        row._run = run.id;
        row._seq = run.nextSeq++;
        run.samples.push(row);
      }
      if (run.samples.length > state.sampleCap) run.samples.splice(0, run.samples.length - state.sampleCap);
      if (body.reset || body.rows.length) {
        state.samplesDirty = true;
        state.pendingSamples += body.rows.length;
      }
      run.samplesCursor = body.cursor;
      if (!body.more) return;
    }
  }

  async function pullConfig() {
    const id = state.configRun;
    if (!id || state.configShown === id) return;
    const body = await getJSON(`/api/config?${query({ run: id })}`);
    if (state.configRun !== id) return;
    const text = document.getElementById("config-text");
    text.dataset.run = id;
    text.textContent = body.text === null ? "This run has no config.yaml yet." : body.text;
    document.getElementById("config-path").textContent = body.path;
    if (body.text !== null) state.configShown = id;
  }

  // ---------------------------------------------------------------- charts

  function buildChartCards() {
    const grid = document.getElementById("chart-grid");
    for (const spec of CHARTS) {
      const plot = el("div", { class: "plot" });
      const empty = el("div", { class: "no-data", text: "no data" });
      const card = el("div", { class: "card", id: `chart-${spec.id}`, "data-chart": spec.id, "data-newest-step": "" },
        el("div", { class: "card-head" },
          el("span", { class: "card-title", text: spec.title }),
          spec.note ? el("span", { class: "card-note", text: spec.note }) : null),
        plot, empty);
      grid.append(card);
      state.charts.set(spec.id, { spec, card, plot, empty, uplot: null, signature: "", zoomed: false });
    }
    const resize = new ResizeObserver(() => requestAnimationFrame(resizeCharts));
    resize.observe(grid);
  }

  function resizeCharts() {
    for (const chart of state.charts.values()) {
      if (chart.uplot && chart.plot.clientWidth) {
        const width = chart.plot.clientWidth;
        if (Math.abs(width - chart.uplot.width) > 1) chart.uplot.setSize({ width, height: chartHeight() });
      }
    }
  }

  const chartHeight = () => 210;

  /** The drawable series of one chart: per selected run, each of its keys with data. */
  function chartSeries(spec) {
    const out = [];
    for (const id of state.selected) {
      const run = state.runs.get(id);
      if (!run) continue;
      for (const def of spec.series(run)) {
        const data = run.series.get(def.key);
        if (data && data.x.length) out.push({ run, def, data, colour: state.colours.get(id) });
      }
    }
    return out;
  }

  /** Align series on the union of their steps: missing points are undefined (spanned),
      a null the run wrote stays null (a gap in the line). */
  function align(parts) {
    const steps = new Set();
    for (const part of parts) for (const x of part.data.x) steps.add(x);
    const xs = [...steps].sort((a, b) => a - b);
    const index = new Map(xs.map((x, i) => [x, i]));
    const columns = parts.map((part) => {
      const ys = new Array(xs.length).fill(undefined);
      part.data.x.forEach((x, i) => { ys[index.get(x)] = part.data.y[i]; });
      return ys;
    });
    return [xs, ...columns];
  }

  function renderCharts() {
    for (const chart of state.charts.values()) {
      const parts = chartSeries(chart.spec);
      if (!parts.length) {
        if (chart.uplot) { chart.uplot.destroy(); chart.uplot = null; chart.signature = ""; }
        chart.plot.hidden = true;
        chart.empty.hidden = false;
        chart.empty.textContent = state.selected.length ? "no data" : state.order.length ? "no run selected" : "no runs yet";
        chart.card.dataset.newestStep = "";
        continue;
      }
      chart.plot.hidden = false;
      chart.empty.hidden = true;
      const data = align(parts);
      const signature = parts.map((p) => `${p.run.id}\u0000${p.def.key}\u0000${p.colour}`).join("|");
      if (!chart.uplot || chart.signature !== signature) {
        if (chart.uplot) chart.uplot.destroy();
        chart.zoomed = false;
        chart.uplot = makePlot(chart, parts, data);
        chart.signature = signature;
      } else {
        chart.uplot.setData(data, !chart.zoomed);
      }
      const newest = Math.max(...parts.map((p) => p.data.x[p.data.x.length - 1]));
      chart.card.dataset.newestStep = String(newest);
    }
  }

  /** uPlot's padded range, except for a flat line: a constant 0 (no clipping, KL without
      a reference model) gets 0..1 instead of 0..100, any other constant ±10 %. */
  function valueRange(u, min, max) {
    if (min === null || max === null) return [0, 1];
    if (min === max) {
      if (min === 0) return [0, 1];
      const pad = Math.abs(min) * 0.1;
      return [min - pad, max + pad];
    }
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  function makePlot(chart, parts, data) {
    const axisStyle = {
      stroke: "#677283",
      grid: { stroke: "#eef0f3", width: 1 },
      ticks: { stroke: "#e3e6eb", width: 1, size: 4 },
      font: "11px system-ui, sans-serif",
    };
    const many = state.selected.length > 1;
    const series = [{ label: "step", value: (u, v) => (v === null || v === undefined ? "–" : String(v)) }];
    for (const part of parts) {
      series.push({
        label: many ? `${part.run.id} · ${part.def.label}` : part.def.label,
        stroke: fade(part.colour, part.def.fade || 0),
        width: part.def.width || 1.5,
        dash: part.def.dash && part.def.dash.length ? part.def.dash : undefined,
        scale: part.def.scale || "y",
        spanGaps: false,
        // uPlot shows points by itself where they are sparse (a run with a few steps)
        points: part.def.points ? { show: true, size: 5, fill: "#fff" } : { size: 4 },
        value: (u, v) => fmtNum(v),
      });
    }
    const axes = [
      { ...axisStyle, values: (u, splits) => splits.map((v) => String(v)) },
      { ...axisStyle, size: 52, values: (u, splits) => splits.map(fmtAxis) },
    ];
    const scales = { x: { time: false }, y: { range: valueRange } };
    if (chart.spec.rightAxis && parts.some((p) => p.def.scale === chart.spec.rightAxis)) {
      axes.push({ ...axisStyle, scale: chart.spec.rightAxis, side: 1, size: 52, grid: { show: false },
        values: (u, splits) => splits.map(fmtAxis) });
      scales[chart.spec.rightAxis] = { range: valueRange };
    }
    const options = {
      width: Math.max(200, chart.plot.clientWidth),
      height: chartHeight(),
      series,
      axes,
      scales,
      legend: { live: true },
      cursor: { sync: { key: "rltune-steps" }, drag: { x: true, y: false }, points: { size: 6 } },
      hooks: {
        setScale: [(u, key) => {
          if (key !== "x") return;
          const xs = u.data[0];
          chart.zoomed = xs.length > 1 && (u.scales.x.min > xs[0] || u.scales.x.max < xs[xs.length - 1]);
        }],
      },
    };
    return new uPlot(options, data, chart.plot);
  }

  // ---------------------------------------------------------------- rollouts

  function sampleFilters() {
    const num = (id) => {
      const value = document.getElementById(id).value.trim();
      return value === "" ? null : Number(value);
    };
    return {
      run: document.getElementById("f-run").value,
      stepMin: num("f-step-min"),
      stepMax: num("f-step-max"),
      rewardMin: num("f-reward-min"),
      rewardMax: num("f-reward-max"),
      errorsOnly: document.getElementById("f-errors").checked,
      text: document.getElementById("f-text").value.trim().toLowerCase(),
    };
  }

  function promptText(prompt) {
    if (Array.isArray(prompt)) return prompt.map((m) => `${m.role}: ${m.content}`).join("\n");
    return prompt === null || prompt === undefined ? "" : String(prompt);
  }

  function searchText(sample) {
    if (sample._search === undefined) {
      const turns = Array.isArray(sample.turns) ? sample.turns.map((t) => t.content).join("\n") : "";
      sample._search = [promptText(sample.prompt), sample.completion, sample.reward_error, turns, sample.prompt_id]
        .filter((part) => part).join("\n").toLowerCase();
    }
    return sample._search;
  }

  function matches(sample, f) {
    if (f.run && sample._run !== f.run) return false;
    if (f.stepMin !== null && !(sample.step >= f.stepMin)) return false;
    if (f.stepMax !== null && !(sample.step <= f.stepMax)) return false;
    const reward = typeof sample.reward === "number" ? sample.reward : null;
    if (f.rewardMin !== null && !(reward !== null && reward >= f.rewardMin)) return false;
    if (f.rewardMax !== null && !(reward !== null && reward <= f.rewardMax)) return false;
    if (f.errorsOnly && !sample.reward_error) return false;
    if (f.text && !searchText(sample).includes(f.text)) return false;
    return true;
  }

  function compareSamples(a, b) {
    const { sortKey, sortDir } = state.table;
    const sign = sortDir === "asc" ? 1 : -1;
    const va = sortKey === "reward" ? (typeof a.reward === "number" ? a.reward : null) : a.step;
    const vb = sortKey === "reward" ? (typeof b.reward === "number" ? b.reward : null) : b.step;
    if (va === null && vb !== null) return 1; // no score: always last
    if (vb === null && va !== null) return -1;
    if (va !== vb) return sign * (va - vb);
    return b._seq - a._seq || (a._run < b._run ? -1 : a._run > b._run ? 1 : 0);
  }

  function renderSamples() {
    const filters = sampleFilters();
    const all = state.selected.flatMap((id) => (state.runs.get(id) ? state.runs.get(id).samples : []));
    const shown = all.filter((sample) => matches(sample, filters)).sort(compareSamples);
    const page = shown.slice(0, state.table.shown);
    document.getElementById("sample-rows").replaceChildren(...page.map(sampleRow));
    const empty = document.getElementById("sample-empty");
    empty.hidden = page.length > 0;
    empty.textContent = all.length ? "No rollout matches these filters." : "No rollouts yet.";
    const more = document.getElementById("sample-more");
    more.hidden = shown.length <= page.length;
    more.textContent = `Show ${Math.min(PAGE_ROWS, shown.length - page.length)} more`;
    document.getElementById("sample-summary").textContent = all.length
      ? `${page.length} shown of ${shown.length} matching · newest ${state.sampleCap} per run kept` : "";
    for (const button of document.querySelectorAll("button.sort")) {
      const active = button.dataset.sort === state.table.sortKey;
      button.setAttribute("aria-sort", active ? (state.table.sortDir === "asc" ? "ascending" : "descending") : "none");
    }
    state.pendingSamples = 0;
  }

  function sampleRow(sample) {
    const key = `${sample._run}:${sample._seq}`;
    const reward = typeof sample.reward === "number" ? sample.reward : null;
    const row = el("tr", {
      "data-run": sample._run, "data-step": String(sample.step), "data-reward": reward === null ? "" : String(reward),
      class: sample.reward_error ? "has-error" : "",
    });
    const chip = el("span", { class: "run-chip" }, el("span", { class: "swatch" }), el("span", { text: sample._run }));
    chip.firstChild.style.background = state.colours.get(sample._run) || "";
    row.append(
      el("td", { "data-col": "run" }, chip),
      el("td", { "data-col": "step", class: "num" }, String(sample.step)),
      el("td", { "data-col": "prompt" }, promptCell(sample.prompt, `${key}:p`)),
      el("td", { "data-col": "completion" }, completionCell(sample, key)),
      el("td", { "data-col": "reward", class: "num" }, rewardCell(sample, reward)),
      el("td", { "data-col": "rewards" }, breakdown(sample.rewards)),
      el("td", { "data-col": "error" }, sample.reward_error
        ? el("span", { class: "error-text" }, textBlock(sample.reward_error, `${key}:e`, 120)) : ""),
      el("td", { "data-col": "finish", text: sample.finish_reason || "" }),
      el("td", { "data-col": "length", class: "num", text: sample.length === undefined ? "" : String(sample.length) }),
    );
    return row;
  }

  /** Text cut at `limit` characters with a toggle to show all; the state survives redraws. */
  function textBlock(text, key, limit = TRUNCATE_AT) {
    const full = visible(text === null || text === undefined ? "" : text);
    const span = el("span", { class: "text" });
    if (full.length <= limit) {
      span.textContent = full;
      return span;
    }
    const wrap = el("span", { class: "truncated", "data-expanded": "false" });
    const button = el("button", { type: "button", class: "more" });
    const draw = () => {
      const open = state.table.expanded.has(key);
      span.textContent = open ? full : `${full.slice(0, limit)}…`;
      button.textContent = open ? "show less" : `show all (${full.length} chars)`;
      wrap.dataset.expanded = open ? "true" : "false";
    };
    button.addEventListener("click", () => {
      if (state.table.expanded.has(key)) state.table.expanded.delete(key); else state.table.expanded.add(key);
      draw();
    });
    draw();
    wrap.append(span, button);
    return wrap;
  }

  function promptCell(prompt, key) {
    if (!Array.isArray(prompt)) return textBlock(prompt, key);
    const box = el("div");
    prompt.forEach((message, i) => {
      box.append(el("div", { class: "msg" },
        el("span", { class: "role", text: message.role || "?" }), textBlock(message.content, `${key}:${i}`, 160)));
    });
    return box;
  }

  function completionCell(sample, key) {
    if (!Array.isArray(sample.turns) || !sample.turns.length) return textBlock(sample.completion, `${key}:c`);
    const box = el("div", { class: "turns" });
    sample.turns.forEach((turn, i) => {
      const masked = turn.trained === false;
      box.append(el("div", { class: masked ? "turn masked" : "turn", "data-trained": masked ? "false" : "true" },
        el("span", { class: "role", text: turn.role || "?" }),
        masked ? el("span", { class: "badge masked", text: "masked" }) : null,
        typeof turn.tokens === "number" ? el("span", { class: "badge", text: `${turn.tokens} tok` }) : null,
        el("div", {}, textBlock(turn.content, `${key}:t${i}`, 160))));
    });
    if (typeof sample.trained_tokens === "number" || typeof sample.masked_tokens === "number") {
      box.append(el("div", { class: "turn-summary",
        text: `trained ${sample.trained_tokens ?? "?"} tokens · masked ${sample.masked_tokens ?? "?"}` }));
    }
    return box;
  }

  function rewardCell(sample, reward) {
    const box = el("div");
    box.append(reward === null ? el("span", { class: "reward none", text: "no score" })
      : el("span", { class: "reward", text: fmtNum(reward) }));
    if (sample.dropped) box.append(el("div", {}, el("span", { class: "badge dropped", text: "dropped" })));
    return box;
  }

  function breakdown(rewards) {
    const box = el("div", { class: "fns" });
    for (const [name, value] of Object.entries(rewards || {})) {
      box.append(el("span", { text: name, title: name }),
        value === null ? el("span", { class: "none", text: "none" }) : el("span", { text: fmtNum(value) }));
    }
    return box;
  }

  function bindSampleControls() {
    const rerender = () => { state.table.shown = PAGE_ROWS; renderSamples(); };
    let timer = null;
    document.getElementById("f-text").addEventListener("input", () => {
      clearTimeout(timer);
      timer = setTimeout(rerender, 200);
    });
    for (const id of ["f-run", "f-step-min", "f-step-max", "f-reward-min", "f-reward-max", "f-errors"]) {
      document.getElementById(id).addEventListener("change", rerender);
    }
    document.getElementById("f-follow").addEventListener("change", () => renderSamples());
    document.getElementById("sample-filters").addEventListener("submit", (event) => event.preventDefault());
    for (const button of document.querySelectorAll("button.sort")) {
      button.addEventListener("click", () => {
        const table = state.table;
        if (table.sortKey === button.dataset.sort) table.sortDir = table.sortDir === "asc" ? "desc" : "asc";
        else { table.sortKey = button.dataset.sort; table.sortDir = "desc"; }
        rerender();
      });
    }
    document.getElementById("sample-more").addEventListener("click", () => {
      state.table.shown += PAGE_ROWS;
      renderSamples();
    });
    document.getElementById("config-run").addEventListener("change", (event) => {
      state.configRun = event.target.value;
      state.configShown = null;
      poll.now();
    });
  }

  // ---------------------------------------------------------------- loop

  function renderAll() {
    if (state.metricsDirty) {
      state.metricsDirty = false;
      renderCharts();
    }
    const follow = document.getElementById("f-follow").checked;
    if (state.samplesDirty && (follow || !document.getElementById("sample-rows").children.length)) {
      state.samplesDirty = false;
      renderSamples();
    } else if (state.samplesDirty && state.pendingSamples) {
      document.getElementById("sample-summary").textContent =
        `${state.pendingSamples} new rollouts (tick "follow live" to show them)`;
    }
  }

  async function tick() {
    if (K === null) {
      defineCharts(await getJSON("/api/keys"));
      buildChartCards();
    }
    await refreshRuns();
    for (const id of state.selected) {
      const run = state.runs.get(id);
      await pullMetrics(run);
      await pullSamples(run);
    }
    await pullConfig();
    renderAll();
    const live = state.selected.some((id) => state.runs.get(id).info.live);
    const clock = new Date().toLocaleTimeString();
    setStatus(live ? "live" : "idle", `${live ? "live" : "idle"} · updated ${clock}`);
  }

  const poll = {
    timer: null,
    busy: false,
    again: false,
    async run() {
      if (this.busy) { this.again = true; return; }
      this.busy = true;
      clearTimeout(this.timer);
      try {
        await tick();
      } catch (err) {
        const unauthorized = err instanceof HttpError && err.status === 401;
        setStatus("offline", unauthorized ? "unauthorized: open the page as /?token=TOKEN"
          : `cannot reach the dashboard server (${err.message})`);
      } finally {
        this.busy = false;
        const soon = this.again;
        this.again = false;
        this.timer = setTimeout(() => this.run(), soon ? 0 : POLL_MS);
      }
    },
    now() { this.run(); },
  };

  function start() {
    bindSampleControls();
    renderSamples();
    poll.now();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
