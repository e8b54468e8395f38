/* rltune dashboard: the rollout browser (filters, sorting, the sample table). app.js
   builds it with the page's state and helpers; loaded before app.js. Plain browser
   JavaScript, no build. */
"use strict";

window.rltuneRollouts = ({ state, el, visible, fmtNum, PAGE_ROWS, TRUNCATE_AT, refresh }) => {

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

  /** Any value of a row as text: a string as it is, anything else (a number, an object
      where text was expected) as JSON, nothing as "". */
  const asText = (value) => (value === null || value === undefined ? ""
    : typeof value === "string" ? value : JSON.stringify(value));

  /** A chat message's role and content; anything else in a list of messages is shown as
      its JSON under the role "?". */
  const message = (m) => (m && typeof m === "object" && !Array.isArray(m)
    ? { role: asText(m.role) || "?", content: m.content } : { role: "?", content: asText(m) });

  function promptText(prompt) {
    if (Array.isArray(prompt)) return prompt.map(message).map((m) => `${m.role}: ${contentText(m.content)}`).join("\n");
    return asText(prompt);
  }

  /** A message's content as text: a list of parts (vision-language prompts) as its text
      parts, an image part as "[image]" (the sample's `images` show it). */
  function contentText(content) {
    if (!Array.isArray(content)) return asText(content);
    return content.map((part) => (part && part.type === "text" ? String(part.text ?? "")
      : part && String(part.type || "").startsWith("image") ? "[image]" : JSON.stringify(part))).join("");
  }

  function searchText(sample) {
    if (sample._search === undefined) {
      const turns = Array.isArray(sample.turns)
        ? sample.turns.map((t) => contentText(message(t).content)).join("\n") : "";
      const images = Array.isArray(sample.images) ? sample.images.map((image) => image && image.source).join("\n") : "";
      sample._search = [promptText(sample.prompt), sample.completion, sample.reward_error, turns, sample.prompt_id, images]
        .map(asText).filter((part) => part).join("\n").toLowerCase();
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
    document.getElementById("sample-rows").replaceChildren(...page.map(safeRow));
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

  /** A row of the table; a row the page cannot draw is shown as such, with why, and the
      other rows are drawn as usual. */
  function safeRow(sample) {
    try {
      return sampleRow(sample);
    } catch (err) {
      return el("tr", { class: "bad-row", "data-run": sample._run, "data-step": asText(sample.step) },
        el("td", { "data-col": "run", text: visible(sample._run) }),
        el("td", { "data-col": "step", class: "num", text: asText(sample.step) }),
        el("td", { colspan: "7", text: `unreadable row of samples.jsonl (${err.message})` }));
    }
  }

  function sampleRow(sample) {
    const key = `${sample._run}:${sample._seq}`;
    const reward = typeof sample.reward === "number" ? sample.reward : null;
    const row = el("tr", {
      "data-run": sample._run, "data-step": String(sample.step), "data-reward": reward === null ? "" : String(reward),
      class: sample.reward_error ? "has-error" : "",
    });
    const chip = el("span", { class: "run-chip" }, el("span", { class: "swatch" }), el("span", { text: visible(sample._run) }));
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
      el("td", { "data-col": "finish", text: visible(asText(sample.finish_reason)) }),
      el("td", { "data-col": "length", class: "num", text: asText(sample.length) }),
    );
    return row;
  }

  /** Text cut at `limit` characters with a toggle to show all; the state survives redraws. */
  function textBlock(text, key, limit = TRUNCATE_AT) {
    const full = visible(asText(text));
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
    prompt.map(message).forEach((m, i) => {
      box.append(el("div", { class: "msg" },
        el("span", { class: "role", text: visible(m.role) }), textBlock(contentText(m.content), `${key}:${i}`, 160)));
    });
    return box;
  }

  /** The prompt's images (vision-language runs) as thumbnails, each a link to the full
      image; served by the dashboard from the run's images/ folder. */
  function thumbnails(sample) {
    if (!Array.isArray(sample.images) || !sample.images.length) return null;
    const box = el("div", { class: "thumbs" });
    for (const image of sample.images) {
      if (!image || typeof image.path !== "string") continue;
      const src = `/image?run=${encodeURIComponent(sample._run)}&path=${encodeURIComponent(image.path)}`;
      const label = typeof image.source === "string" ? image.source : image.path;
      box.append(el("a", { href: src, target: "_blank", rel: "noopener", title: label },
        el("img", { class: "thumb", src, alt: label, loading: "lazy", decoding: "async" })));
    }
    return box;
  }

  function completionCell(sample, key) {
    const images = thumbnails(sample);
    const text = completionText(sample, key);
    if (!images) return text;
    return el("div", { class: "with-images" }, images, el("div", {}, text));
  }

  function completionText(sample, key) {
    if (!Array.isArray(sample.turns) || !sample.turns.length) return textBlock(sample.completion, `${key}:c`);
    const box = el("div", { class: "turns" });
    sample.turns.forEach((turn, i) => {
      const shaped = turn && typeof turn === "object" && !Array.isArray(turn);
      const masked = shaped && turn.trained === false;
      box.append(el("div", { class: masked ? "turn masked" : "turn", "data-trained": masked ? "false" : "true" },
        el("span", { class: "role", text: visible(message(turn).role) }),
        shaped ? null : el("span", { class: "badge", text: "not a turn" }),
        masked ? el("span", { class: "badge masked", text: "masked" }) : null,
        shaped && typeof turn.tokens === "number" ? el("span", { class: "badge", text: `${turn.tokens} tok` }) : null,
        el("div", {}, textBlock(contentText(message(turn).content), `${key}:t${i}`, 160))));
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
    if (rewards === null || rewards === undefined) return box;
    if (typeof rewards !== "object" || Array.isArray(rewards)) {
      box.append(el("span", { class: "none", text: `not a table of rewards: ${visible(asText(rewards))}` }));
      return box;
    }
    for (const [name, value] of Object.entries(rewards)) {
      box.append(el("span", { text: visible(name), title: visible(name) }),
        value === null ? el("span", { class: "none", text: "none" })
          : el("span", { text: typeof value === "number" ? fmtNum(value) : visible(asText(value)) }));
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
      refresh();
    });
  }

  return { renderSamples, bindSampleControls };
};
