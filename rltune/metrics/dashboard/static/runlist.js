/* rltune dashboard: the run list (a checkbox per run, its newest step, when it last wrote,
   and what is wrong with it) and the run pickers of the rollout filter and the config
   view. app.js builds it with the page's state and helpers; loaded before app.js. Plain
   browser JavaScript, no build. */
"use strict";

window.rltuneRunList = ({ state, el, visible, ago, onToggle }) => {

  /** What is wrong with one run, a line each: its files the server cannot read (as
      /api/runs lists them), an answer for it that failed (the server's message), lines
      of its files skipped as unreadable. Only that run is affected. */
  function problemsOf(run) {
    const lines = new Set((run.info && run.info.errors) || []);
    for (const file of ["metrics", "samples"]) {
      if (run.failed[file]) lines.add(run.failed[file]);
      const bad = run.bad[file];
      if (bad) {
        lines.add(`${bad.count} unreadable line${bad.count === 1 ? "" : "s"} in ${file}.jsonl, skipped`
          + (bad.first ? ` (first: ${bad.first})` : ""));
      }
    }
    return [...lines];
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
      const where = state.roots.map((root) => visible(root.path)).join(", ");
      empty.textContent = `No runs yet in ${where}. A run appears here as soon as training starts writing it.`;
    }
    renderLines(document.getElementById("root-problems"),
      state.roots.filter((root) => root.error).map((root) => visible(root.error)));
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

  /** A list's lines, replaced only when they changed; hidden when there are none. */
  function renderLines(node, lines) {
    const signature = JSON.stringify(lines);
    if (node.dataset.lines === signature) return;
    node.dataset.lines = signature;
    node.replaceChildren(...lines.map((text) => el("li", { text })));
    node.hidden = lines.length === 0;
  }

  function runItem(id) {
    const box = el("input", { type: "checkbox", "aria-label": `show ${id}` });
    box.addEventListener("change", () => onToggle(id, box.checked));
    const swatch = el("span", { class: "swatch" });
    const meta = el("span", { class: "run-meta" });
    const label = el("label", {}, box, swatch, el("span", { class: "run-name", text: visible(id) }), meta);
    const problems = el("ul", { class: "run-problems", hidden: true });
    return { li: el("li", { "data-run": id }, label, problems), label, box, swatch, meta, problems, metaText: "" };
  }

  function updateRunItem(item, run) {
    const info = run.info;
    const selected = state.selected.includes(run.id);
    item.box.checked = selected;
    item.li.classList.toggle("selected", selected);
    item.li.dataset.live = info.live ? "true" : "false";
    item.label.title = visible(info.path);
    item.swatch.style.background = selected ? state.colours.get(run.id) : "";
    const step = info.last_step === null ? "no steps yet" : `step ${info.last_step}`;
    const when = info.live ? "live" : info.last_write === null ? "no files yet" : ago(state.serverNow - info.last_write);
    const text = `${step}|${when}`;
    if (text !== item.metaText) {
      item.metaText = text;
      item.meta.replaceChildren(el("span", { text: step }), el("span", { text: "·" }),
        el("span", { class: info.live ? "live-badge" : "", text: when }));
    }
    const problems = problemsOf(run).map(visible);
    item.li.dataset.problems = String(problems.length);
    renderLines(item.problems, problems);
  }

  /** Replace a select's options only when the choices changed (an open menu stays open). */
  function setOptions(select, choices) {
    const signature = JSON.stringify(choices);
    if (select.dataset.choices === signature) return;
    const current = select.value;
    select.dataset.choices = signature;
    select.replaceChildren(...choices.map(([value, text]) => el("option", { value, text: visible(text) })));
    if (choices.some(([value]) => value === current)) select.value = current;
  }

  /** The run pickers of the rollout filter and the config view. */
  function renderRunChoices() {
    const runFilter = document.getElementById("f-run");
    setOptions(runFilter, [["", "all selected runs"], ...state.selected.map((id) => [id, id])]);

    const configPick = document.getElementById("config-run");
    if (state.configRun && !state.order.includes(state.configRun)) state.configRun = null;
    if (!state.configRun && state.order.length) state.configRun = state.selected[0] || state.order[0];
    setOptions(configPick, state.order.map((id) => [id, id]));
    if (state.configRun && configPick.value !== state.configRun) configPick.value = state.configRun;
  }

  return { renderRunList, problemsOf };
};
