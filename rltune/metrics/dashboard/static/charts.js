/* rltune dashboard: the chart cards and their uPlot charts, one series per selected run
   and key. app.js builds them with the page's state, helpers and chart specs; loaded
   before app.js. Plain browser JavaScript, no build. */
"use strict";

window.rltuneCharts = ({ state, el, fmtNum, fmtAxis, fade, specs }) => {

  function buildChartCards() {
    const grid = document.getElementById("chart-grid");
    for (const spec of specs()) {
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

  return { buildChartCards, renderCharts };
};
