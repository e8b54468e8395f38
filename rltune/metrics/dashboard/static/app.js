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
      this.failed = { metrics: null, samples: null }; // the server's message when a pull failed
      this.bad = { metrics: null, samples: null }; // {count, first}: lines the server skipped
    }

    rewardFns() {
      return [...this.series.keys()].filter(isRewardFnKey).sort();
    }

    clearMetrics() { this.series = new Map(); this.bad.metrics = null; }

    clearSamples() { this.samples = []; this.bad.samples = null; }

    /** Count the lines an answer says the server skipped; the first one is kept to show. */
    noteBad(file, body) {
      if (!body.bad_lines) return;
      if (!this.bad[file]) this.bad[file] = { count: 0, first: body.first_bad || null };
      this.bad[file].count += body.bad_lines;
    }

    addMetricsRow(row) {
      const step = row.step; // an integer: the server skips (and counts) rows without one
      if (typeof step !== "number") return;
      for (const [key, value] of Object.entries(row)) {
        if (key === "step" || !isChartKey(key)) continue;
        if (value !== null && typeof value !== "number") continue;
        let series = this.series.get(key);
        if (!series) this.series.set(key, (series = { x: [], y: [] }));
        addPoint(series, step, Number.isFinite(value) ? value : null); // an integer beyond a double: a gap too
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

  /** Control characters made visible (U+2400 block); newlines and tabs kept. Other
      invisible controls and the marks that reorder text (U+202E would show text
      reversed) are written as [U+XXXX]. */
  const visible = (text) => String(text).replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g,
    (ch) => (ch === "\u007f" ? "\u2421" : String.fromCharCode(0x2400 + ch.charCodeAt(0))))
    .replace(/[\u0080-\u009f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g,
      (ch) => `[U+${ch.charCodeAt(0).toString(16).toUpperCase().padStart(4, "0")}]`);

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

  /** The server answered with an error; `detail` is its message (names the file and why). */
  class HttpError extends Error {
    constructor(status, message, detail) { super(message); this.status = status; this.detail = detail; }
  }

  /** The server could not be reached at all. */
  class NetworkError extends Error {}

  async function getJSON(path) {
    let response;
    try {
      response = await fetch(path, { credentials: "same-origin", cache: "no-store" });
    } catch (err) {
      throw new NetworkError(err.message);
    }
    if (!response.ok) {
      let detail = "";
      try { detail = (await response.json()).error || ""; } catch (_) { /* a text body */ }
      throw new HttpError(response.status, `${path}: ${response.status} ${detail}`.trim(), detail);
    }
    return response.json();
  }

  /** Whether an error stops the whole page (the server is gone, or wants its token)
      rather than one run. */
  const stopsPage = (err) => err instanceof NetworkError || (err instanceof HttpError && err.status === 401);

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
    state.selected.filter((id) => !state.order.includes(id)).forEach(deselect); // deleted since
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
    const run = state.runs.get(id);
    if (run) run.failed = { metrics: null, samples: null };
    state.metricsDirty = true;
    state.samplesDirty = true;
  }

  // ---------------------------------------------------------------- run list (runlist.js)

  const { renderRunList, problemsOf } = window.rltuneRunList({
    state, el, visible, ago,
    onToggle: (id, checked) => {
      if (checked) select(id); else deselect(id);
      renderRunList();
      renderAll();
      poll.now();
    },
  });

  // ---------------------------------------------------------------- data

  async function pullMetrics(run) {
    for (let round = 0; round < 20; round++) {
      const body = await getJSON(`/api/metrics?${query({ run: run.id, cursor: run.metricsCursor })}`);
      if (body.reset) run.clearMetrics();
      run.noteBad("metrics", body);
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
      run.noteBad("samples", body);
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

  /** One file of one run; a failure is that run's own (shown in its entry of the run
      list, with the server's message), so the other runs keep updating. */
  async function pullRun(run, file, pull) {
    try {
      await pull(run);
      run.failed[file] = null;
    } catch (err) {
      if (stopsPage(err)) throw err;
      run.failed[file] = err instanceof HttpError ? err.detail || err.message : `page error: ${err.message}`;
    }
  }

  async function pullConfig() {
    const id = state.configRun;
    if (!id || state.configShown === id) return;
    const text = document.getElementById("config-text");
    let body;
    try {
      body = await getJSON(`/api/config?${query({ run: id })}`);
    } catch (err) {
      if (stopsPage(err) || !(err instanceof HttpError) || state.configRun !== id) throw err;
      text.dataset.run = id;
      text.dataset.error = "true";
      text.textContent = `config.yaml of ${visible(id)} cannot be shown: ${visible(err.detail || err.message)}`;
      return;
    }
    if (state.configRun !== id) return;
    text.dataset.run = id;
    text.dataset.error = "false";
    text.textContent = body.text === null ? "This run has no config.yaml yet." : visible(body.text);
    document.getElementById("config-path").textContent = visible(body.path);
    if (body.text !== null) state.configShown = id;
  }

  // ---------------------------------------------------------------- charts (charts.js)

  const { buildChartCards, renderCharts } = window.rltuneCharts({
    state, el, fmtNum, fmtAxis, fade, specs: () => CHARTS,
  });

  // ---------------------------------------------------------------- rollouts (rollouts.js)

  const { renderSamples, bindSampleControls } = window.rltuneRollouts({
    state, el, visible, fmtNum, PAGE_ROWS, TRUNCATE_AT, refresh: () => poll.now(),
  });

  // ---------------------------------------------------------------- loop

  /** Redraw what changed; a part is marked clean only once it was drawn. */
  function renderAll() {
    if (state.metricsDirty) {
      renderCharts();
      state.metricsDirty = false;
    }
    const follow = document.getElementById("f-follow").checked;
    if (state.samplesDirty && (follow || !document.getElementById("sample-rows").children.length)) {
      renderSamples();
      state.samplesDirty = false;
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
      await pullRun(run, "metrics", pullMetrics);
      await pullRun(run, "samples", pullSamples);
    }
    await pullConfig();
    renderRunList(); // with what this poll found wrong with each run
    renderAll();
    const live = state.selected.some((id) => state.runs.get(id).info.live);
    const troubled = state.selected.filter((id) => problemsOf(state.runs.get(id)).length).length;
    const note = troubled ? ` · ${troubled} run${troubled === 1 ? " has" : "s have"} problems (see Runs)` : "";
    const clock = new Date().toLocaleTimeString();
    setStatus(live ? "live" : "idle", `${live ? "live" : "idle"} · updated ${clock}${note}`);
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
          : err instanceof NetworkError ? `cannot reach the dashboard server (${err.message})`
            : err instanceof HttpError ? `the dashboard server answered an error (${err.message})`
              : `the page failed to update (${err.message})`);
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
