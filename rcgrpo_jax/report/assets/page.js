// report.html's script: inflates plotly.js and the run's data, then draws four views.
// Every text that comes from a run (model output above all) goes in with textContent, never
// innerHTML: a sampled "<script>" shows as the characters the model wrote.
"use strict";

const PAGE_GROUPS = 40; // groups drawn at a time in the rollout browser ("more" adds as many)
const TOKENS = { high: "<|high_reward|>", low: "<|low_reward|>", none: "no token" };

// ------------------------------------------------------------------ helpers

async function inflate(id) {
  // base64 -> bytes -> gunzip (the browser's DecompressionStream) -> text
  const b64 = document.getElementById(id).textContent.trim();
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return await new Response(stream).text();
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

const pct = (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1));
const pts = (x) => (x === null || x === undefined ? "-" : (x >= 0 ? "+" : "") + (100 * x).toFixed(1));
const num = (x, d = 3) => (x === null || x === undefined ? "-" : Number(x).toFixed(d));
const show = (v) => (v === null || v === undefined ? "-" : typeof v === "object" ? JSON.stringify(v) : String(v));

function table(head, rows, left = 1) {
  // head: column titles; rows: arrays of cell texts; the first `left` columns left-aligned
  const t = el("table");
  t.append(el("tr", {}, ...head.map((h, i) => el("th", { class: i < left ? "l" : "", text: h }))));
  for (const r of rows)
    t.append(el("tr", {}, ...r.map((c, i) => el("td", { class: i < left ? "l" : "", text: show(c) }))));
  return t;
}

function select(id, label, options, onchange) {
  // options: [[value, text], ...]
  const s = el("select", { id, onchange });
  for (const [v, t] of options) s.append(el("option", { value: v, text: t }));
  return [el("label", { for: id, text: label }), s];
}

// ------------------------------------------------------------------ overview

function overview(D) {
  const root = document.getElementById("overview");
  if (D.kind === "study") return studyOverview(D, root);
  const rows = Object.values(D.arms).map((a) => a.row);
  const summary = D.summary_rows || {};
  root.append(el("h2", { text: "RL arms" }));
  root.append(table(
    ["arm", "start %", "end %", "change pts", "area %", "degenerate %", "iterations", "trajectories", "ended"],
    rows.map((r) => [r.name, pct(r.start), pct(r.end), pts(r.change), pct(r.auc),
      pct((summary[r.name] || {}).degenerate_frac ?? meanOf(D.arms[r.name].metrics, "degenerate_frac")),
      r.iterations, r.trajectories, r.ended]),
  ));
  if (D.stage_rows && Object.keys(D.stage_rows).length) {
    root.append(el("h2", { text: "Stage 1" }));
    root.append(table(["stage", "held-out %", "under high %", "under low %"],
      Object.entries(D.stage_rows).map(([n, r]) => [n, pct(r.heldout_success), pct(r.success_high), pct(r.success_low)])));
  }
  if (D.targets) {
    root.append(el("h2", { text: "Targets" }));
    const mark = (v) => (v === null || v === undefined ? "-" : v ? "yes" : "NO");
    root.append(table(["target", "met"], [
      ["SFT in its band from a base below it", mark(D.targets.sft_in_band)],
      ["RCTP: success under high − under low ≥ the gap", mark(D.targets.rctp_controllable)],
      ["RC-GRPO less degenerate than SFT → GRPO", mark(D.targets.rcgrpo_less_degenerate)],
    ]));
  }
  const times = [];
  for (const [n, t] of Object.entries(D.stage_times || {})) times.push([n, t.wall_s, t.compile_s, t.programs]);
  for (const [n, a] of Object.entries(D.arms)) if (a.time) times.push([n, a.time.wall_s, a.time.compile_s, a.time.programs]);
  if (D.wall_s !== undefined && D.wall_s !== null) times.push(["whole run (this invocation)", D.wall_s, null, null]);
  if (times.length) {
    root.append(el("h2", { text: "Wall and compile time per stage (s)" }));
    root.append(table(["stage", "wall s", "compile s", "programs"], times));
  }
  if (D.machine) {
    root.append(el("h2", { text: "Machine" }));
    root.append(table(["field", "value"], Object.entries(D.machine).map(([k, v]) => [k, show(v)]), 2));
  }
  configBlock(D, root);
  if (D.table) {
    root.append(el("h2", { text: "table.txt" }));
    root.append(el("pre", { class: "table", text: D.table }));
  }
}

function meanOf(records, key) {
  const v = records.map((r) => r[key]).filter((x) => x !== null && x !== undefined);
  return v.length ? v.reduce((a, b) => a + b, 0) / v.length : null;
}

function configBlock(D, root) {
  root.append(el("h2", { text: "Config: what differs from the defaults" }));
  if (!D.config) {
    root.append(el("div", { class: "empty", text: "no config.json in this run (written by runs since the report page)" }));
  } else if (!D.config.length) {
    root.append(el("div", { class: "empty", text: "every key at its default" }));
  } else {
    const t = table(["key", "value", "default"], D.config.map(([k, v, d]) => [k, show(v), show(d)]), 3);
    t.classList.add("mono");
    root.append(t);
  }
}

function studyOverview(D, root) {
  const iv = (r, signed) => (r ? `${signed ? pts(r.mean) : pct(r.mean)} ± ${pct(r.ci95)}` : "-");
  root.append(el("h2", { text: "Arms over the study's distinct runs (mean ± 95% CI)" }));
  root.append(table(["arm", "n", "start %", "end %", "change pts", "area %"],
    Object.entries(D.study_arms).map(([n, r]) => [n, (r.heldout_success || {}).n ?? "-",
      iv(r.start_success), iv(r.heldout_success), iv(r.change, true), iv(r.auc)])));
  if (Object.keys(D.paired || {}).length) {
    root.append(el("h2", { text: "Paired differences per run (points)" }));
    root.append(table(["pair", "mean ± 95% CI", "n", "verdict"],
      Object.entries(D.paired).map(([n, r]) => [n, iv(r, true), r.n, r.verdict])));
  }
  configBlock(D, root);
  if (D.table) {
    root.append(el("h2", { text: "seeds.txt" }));
    root.append(el("pre", { class: "table", text: D.table }));
  }
}

function runsView(D) {
  const root = document.getElementById("runs");
  root.append(el("h2", { text: "The study's runs" }));
  const t = el("table");
  t.append(el("tr", {}, el("th", { class: "l", text: "run" }), el("th", { class: "l", text: "page" }), el("th", { text: "wall s" })));
  for (const r of D.runs) {
    const link = r.href ? el("a", { href: r.href, text: r.href }) : el("span", { class: "muted", text: "no report.html" });
    t.append(el("tr", {}, el("td", { class: "l", text: r.label }), el("td", { class: "l" }, link), el("td", { text: show(r.wall_s) })));
  }
  root.append(t);
  // [label, same as, arms]: no arms = the whole run repeats another
  const repeat = ([run, same, arms]) => (arms && arms.length ? `${run}'s ${arms.join(", ")} = ${same}'s` : `${run} = ${same}`);
  if (D.dropped.length) root.append(el("div", { class: "muted", text: "bit-identical results counted once: " + D.dropped.map(repeat).join("; ") }));
}

// ------------------------------------------------------------------ curves

const PANELS = [
  // [title, x ("rollouts" | "step"), [[key, dash, label]...], eval panel?]
  ["held-out success vs trajectories generated", "rollouts", [["eval_success", "solid", "greedy"], ["eval_sampled", "dash", "sampled"]], true],
  ["held-out success vs iterations", "step", [["eval_success", "solid", "greedy"], ["eval_sampled", "dash", "sampled"]], true],
  ["training reward under each reward token", null, [["reward_high", "solid", "<|high_reward|>"], ["reward_low", "dot", "<|low_reward|>"], ["reward_mean", "dashdot", "mean"]]],
  ["degenerate-group fraction", null, [["degenerate_frac", "solid", ""]]],
  ["policy entropy", null, [["entropy", "solid", ""]]],
  ["KL to the reference", null, [["kl", "solid", ""]]],
  ["clip fraction", null, [["clip_frac", "solid", ""]]],
  ["rollout–trainer |log p| gap (first update)", null, [["logp_gap_mean", "solid", "mean"], ["logp_gap_max", "dot", "max"]]],
  ["rollout vs update time (s)", null, [["rollout_s", "solid", "rollout"], ["update_s", "dash", "update"]]],
];
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

function series(records, key, x) {
  // (x, y) of the records with a number under `key`; x = iteration (`step`) or trajectories
  const xs = [], ys = [];
  let total = 0;
  for (const r of records) {
    total = r.rollouts ?? total + (r.generated_rollouts || 0);
    const v = r[key];
    if (typeof v === "number" && isFinite(v)) {
      xs.push(x === "rollouts" ? total : r.step);
      ys.push(v);
    }
  }
  return [xs, ys];
}

function curves(D) {
  const root = document.getElementById("curves");
  const arms = D.kind === "study" ? Object.keys(D.bands) : Object.keys(D.arms);
  const controls = el("div", { class: "controls" });
  const xsel = select("curve-x", "training curves against", [["step", "iterations"], ["rollouts", "trajectories generated"]], () => draw());
  if (D.kind !== "study") controls.append(...xsel);
  controls.append(el("span", { class: "muted", text: "arms (or click a legend entry):" }));
  const shown = new Set(arms);
  arms.forEach((a, i) => {
    const box = el("input", { type: "checkbox", id: `arm-${i}`, checked: "", onchange: (e) => { e.target.checked ? shown.add(a) : shown.delete(a); restyle(); } });
    controls.append(el("label", {}, box, " " + a));
  });
  root.append(controls);
  const grid = el("div", { class: "plots" });
  root.append(grid);
  const divs = [];
  const layout = (title, xt, yt) => ({ title: { text: title, font: { size: 13 }, x: 0.01, xanchor: "left" }, margin: { l: 50, r: 10, t: 36, b: 40 },
    xaxis: { title: { text: xt } }, yaxis: { title: { text: yt } }, legend: { font: { size: 10 } }, hovermode: "closest" });
  const config = { displaylogo: false, responsive: true };

  function draw() {
    grid.textContent = "";
    divs.length = 0;
    if (D.kind === "study") {
      const traces = [];
      arms.forEach((a, i) => {
        const rows = D.bands[a] || [];
        const x = rows.map((r) => r.rollouts), y = rows.map((r) => 100 * r.mean);
        const lo = rows.map((r) => 100 * (r.mean - r.ci95)), hi = rows.map((r) => 100 * (r.mean + r.ci95));
        const c = COLORS[i % COLORS.length];
        traces.push({ x: x.concat([...x].reverse()), y: hi.concat([...lo].reverse()), fill: "toself", line: { width: 0 }, fillcolor: c + "33", hoverinfo: "skip", showlegend: false, legendgroup: a, meta: a, name: a });
        traces.push({ x, y, mode: "lines+markers", name: a, legendgroup: a, meta: a, line: { color: c }, customdata: rows.map((r) => [100 * r.ci95, r.n]), hovertemplate: "%{meta}: %{y:.1f}% ± %{customdata[0]:.1f} (n %{customdata[1]}) at %{x:.0f}<extra></extra>" });
      });
      const d = el("div", { class: "plot" });
      grid.append(d);
      divs.push(d);
      Plotly.newPlot(d, traces, layout("held-out success vs trajectories (mean, 95% band)", "trajectories generated", "success %"), config);
      return restyle();
    }
    const trainX = document.getElementById("curve-x").value;
    for (const [title, px, keys] of PANELS) {
      const x = px || trainX;
      const traces = [];
      arms.forEach((a, i) => {
        const m = D.arms[a].metrics;
        // an arm with rewards per token shows those, not their mean (as rl.png does)
        const perToken = series(m, "reward_high", x)[0].length || series(m, "reward_low", x)[0].length;
        for (const [key, dash, label] of keys) {
          if (key === "reward_mean" && perToken) continue;
          const [xs, ys] = series(m, key, x);
          if (!xs.length) continue;
          traces.push({ x: xs, y: ys, mode: px ? "lines+markers" : "lines", name: label ? `${a} ${label}` : a, legendgroup: a, meta: a,
            line: { color: COLORS[i % COLORS.length], dash }, hovertemplate: `${a}${label ? " " + label : ""}: %{y:.4g} at %{x}<extra></extra>` });
        }
      });
      const d = el("div", { class: "plot", "data-title": title });
      grid.append(d);
      divs.push(d);
      if (!traces.length) {
        d.append(el("div", { class: "empty", text: `${title}: no values in this run` }));
        continue;
      }
      Plotly.newPlot(d, traces, layout(title, x === "step" ? "iteration" : "trajectories generated", ""), config);
    }
    restyle();
  }
  function restyle() {
    for (const d of divs) {
      if (!d.data) continue;
      Plotly.restyle(d, { visible: d.data.map((t) => (shown.has(t.meta) ? true : false)) });
    }
  }
  draw();
}

// ------------------------------------------------------------------ conversations

function conversation(messages) {
  const box = el("div", { class: "conv" });
  if (!messages || !messages.length) {
    box.append(el("div", { class: "empty", text: "no messages recorded for this trajectory" }));
    return box;
  }
  for (const m of messages) {
    const role = String(m.role || "?");
    const head = role + (m.name ? ` · ${m.name}` : "");
    box.append(el("div", { class: `msg ${role.replace(/[^a-z]/g, "")}` },
      el("div", { class: "role", text: head }), el("pre", { text: String(m.content ?? "") })));
  }
  return box;
}

// ------------------------------------------------------------------ rollout browser

function verdict(ok) {
  // a checker's verdict: passed, failed, or not given (null: the environment has none)
  if (ok === null || ok === undefined) return el("span", { class: "muted", text: "-" });
  return el("span", { class: ok ? "ok" : "bad", text: ok ? "✓" : "✗" });
}

function rowMatches(row, group, f) {
  if (f.token !== "any" && row.reward_token !== f.token) return false;
  if (f.reward !== "any" && String(row.reward) !== f.reward) return false;
  if (f.error !== "any" && String(row.error_type ?? "none") !== f.error) return false;
  if (f.text) {
    if (row._hay === undefined)
      row._hay = [group.task_id, group.category, group.kind, row.error_type, row.env_error,
        ...(row.messages || []).map((m) => m.content)].join("\n").toLowerCase();
    if (!row._hay.includes(f.text)) return false;
  }
  return true;
}

function rollouts(D) {
  const root = document.getElementById("rollouts");
  const arms = Object.keys(D.arms);
  const groups = D.groups;
  const missing = arms.filter((a) => !D.arms[a].has_trajectories);
  if (missing.length)
    root.append(el("div", { class: "empty", text: `no trajectories.jsonl in: ${missing.join(", ")} (runs before the report page kept none)` }));
  const values = (fn) => [...new Set(groups.flatMap((g) => g.rows.map(fn)))].sort();
  const controls = el("div", { class: "controls" });
  const refresh = () => { page = 1; render(); };
  controls.append(...select("f-arm", "arm", arms.map((a) => [a, a]), () => { fillIterations(); refresh(); }));
  controls.append(...select("f-iter", "iteration", [["any", "all"]], refresh));
  controls.append(...select("f-token", "reward token", [["any", "any"], ...Object.entries(TOKENS)], refresh));
  controls.append(...select("f-reward", "reward", [["any", "any"], ...values((r) => String(r.reward)).map((v) => [v, v])], refresh));
  controls.append(...select("f-error", "error type", [["any", "any"], ...values((r) => String(r.error_type ?? "none")).map((v) => [v, v])], refresh));
  controls.append(...select("f-group", "group", [["any", "any"], ["trained", "trained on"], ["dropped", "dropped"], ["idle", "neither"]], refresh));
  controls.append(el("label", { for: "f-text", text: "search" }), el("input", { id: "f-text", type: "search", placeholder: "text in task, error or conversation", size: 32, oninput: refresh }));
  root.append(controls);
  const status = el("div", { id: "rollout-status", class: "muted" });
  const held = el("div", { id: "rollout-held", class: "muted" });
  const list = el("div", { id: "rollout-list" });
  const more = el("button", { class: "more", text: "more groups", onclick: () => { page += 1; render(); } });
  root.append(held, status, list, more);
  let page = 1;

  function fillIterations() {
    const arm = document.getElementById("f-arm").value;
    const s = document.getElementById("f-iter");
    s.textContent = "";
    s.append(el("option", { value: "any", text: "all" }));
    for (const it of [...new Set(groups.filter((g) => g.arm === arm).map((g) => g.iteration))].sort((a, b) => a - b))
      s.append(el("option", { value: String(it), text: String(it) }));
    // how many groups the page holds of how many the arm generated (logging.report_groups)
    const mine = groups.filter((g) => g.arm === arm);
    const per = new Map();
    for (const g of mine) per.set(g.iteration, g.groups_in_iteration);
    const of = [...per.values()].reduce((a, b) => a + (b || 0), 0);
    held.textContent = `${arm}: this page holds ${mine.length} groups of ${of} generated over ${per.size} iterations`;
  }

  function filters() {
    const v = (id) => document.getElementById(id).value;
    return { arm: v("f-arm"), iter: v("f-iter"), token: v("f-token"), reward: v("f-reward"), error: v("f-error"),
      group: v("f-group"), text: v("f-text").trim().toLowerCase() };
  }

  function groupOk(g, f) {
    if (g.arm !== f.arm || (f.iter !== "any" && String(g.iteration) !== f.iter)) return false;
    const state = g.trained ? "trained" : g.dropped ? "dropped" : "idle";
    return f.group === "any" || state === f.group;
  }

  function render() {
    const f = filters();
    const matched = [];
    let nrows = 0;
    for (const g of groups) {
      if (!groupOk(g, f)) continue;
      const rows = g.rows.map((r, i) => [r, i]).filter(([r]) => rowMatches(r, g, f));
      if (rows.length) { matched.push([g, rows]); nrows += rows.length; }
    }
    status.textContent = `${nrows} trajectories in ${matched.length} groups match`;
    status.dataset.trajectories = nrows;
    list.textContent = "";
    for (const [g, rows] of matched.slice(0, page * PAGE_GROUPS)) list.append(groupCard(g, rows));
    more.hidden = matched.length <= page * PAGE_GROUPS;
  }

  function groupCard(g, rows) {
    const state = g.trained ? "trained" : g.dropped ? "dropped" : "idle";
    const card = el("div", { class: "group", "data-iteration": g.iteration });
    const head = el("div", { class: "ghead" },
      el("b", { text: `iteration ${g.iteration}` }),
      ` · round ${g.round} · group #${g.group} (of ${g.groups_in_iteration}) · `,
      el("span", { class: "mono", text: g.task_id }),
      ` (${g.category ?? "-"}${g.kind ? " / " + g.kind : ""})`,
      el("span", { class: `tag ${state}`, text: state === "idle" ? "not trained" : state }));
    const strip = el("div", { class: "trajs" });
    const conv = el("div");
    for (const [r, i] of rows) {
      const card2 = el("div", { class: `traj r${r.reward > 0 ? 1 : 0}`, "data-row": i, tabindex: 0 },
        el("div", {}, el("span", { class: `tok ${r.reward_token}`, text: TOKENS[r.reward_token] ?? r.reward_token }), ` #${i}`),
        el("div", { text: `reward ${show(r.reward)}` }),
        el("div", {}, "state ", verdict(r.state_ok), " action ", verdict(r.action_ok)),
        el("div", { text: `advantage ${num(r.advantage)}` }),
        el("div", { class: "mono", text: r.error_type ? String(r.error_type) : "no error" }),
        r.env_error ? el("div", { class: "bad", text: `env: ${r.env_error}` }) : null,
        r.truncated ? el("div", { class: "bad", text: "truncated" }) : null);
      card2.addEventListener("click", () => {
        const was = card2.classList.contains("sel");
        strip.querySelectorAll(".traj.sel").forEach((n) => n.classList.remove("sel"));
        conv.textContent = "";
        if (!was) { card2.classList.add("sel"); conv.append(conversation(r.messages)); }
      });
      strip.append(card2);
    }
    card.append(head, strip, conv);
    return card;
  }

  fillIterations();
  render();
}

// ------------------------------------------------------------------ held-out browser

function heldoutView(D) {
  const root = document.getElementById("heldout");
  const arms = Object.keys(D.heldout);
  if (!arms.length) {
    root.append(el("div", { class: "empty", text: "no heldout.jsonl in this run (runs before the report page kept none)" }));
    return;
  }
  // per arm, per task: the start's and the end's result (first and last evaluation)
  const byArm = {};
  const tasks = new Map();
  for (const a of arms) {
    const evals = [...D.heldout[a]].sort((x, y) => x.iteration - y.iteration);
    const pick = (e) => new Map(e.tasks.map((t) => [t.task_id, t]));
    byArm[a] = { start: pick(evals[0]), end: pick(evals[evals.length - 1]),
      at: [evals[0].iteration, evals[evals.length - 1].iteration], token: evals[0].token };
    for (const t of evals[0].tasks.concat(evals[evals.length - 1].tasks)) if (!tasks.has(t.task_id)) tasks.set(t.task_id, t);
  }
  const controls = el("div", { class: "controls" });
  controls.append(...select("h-arm", "arm", arms.map((a) => [a, a]), render));
  controls.append(...select("h-change", "show", [["all", "every task"], ["fixed", "fixed by RL"], ["broken", "broken by RL"],
    ["pass", "passed at both"], ["fail", "failed at both"]], render));
  controls.append(el("label", { for: "h-text", text: "search" }), el("input", { id: "h-text", type: "search", size: 24, oninput: render }));
  root.append(controls);
  root.append(el("div", { class: "muted", text: "start = the arm's first held-out evaluation (iteration " +
    arms.map((a) => `${a}: ${byArm[a].at[0]} → ${byArm[a].at[1]}`).join("; ") + "); click a mark for its trajectory" }));
  const status = el("div", { id: "heldout-status", class: "muted" });
  const tbl = el("table", { id: "heldout-table" });
  const conv = el("div", { id: "heldout-conv" });
  root.append(status, tbl, conv);

  function change(a, id) {
    const s = byArm[a].start.get(id), e = byArm[a].end.get(id);
    if (!s || !e) return "unknown";
    return !s.success && e.success ? "fixed" : s.success && !e.success ? "broken" : s.success ? "pass" : "fail";
  }

  function render() {
    const arm = document.getElementById("h-arm").value, want = document.getElementById("h-change").value;
    const text = document.getElementById("h-text").value.trim().toLowerCase();
    tbl.textContent = "";
    const head = el("tr", {}, el("th", { class: "l", text: "task" }), el("th", { class: "l", text: "category" }), el("th", { class: "l", text: "kind" }));
    for (const a of arms) head.append(el("th", { text: `${a} start` }), el("th", { text: `${a} end` }));
    tbl.append(head);
    let n = 0;
    for (const [id, t] of tasks) {
      if (want !== "all" && change(arm, id) !== want) continue;
      if (text && !`${id} ${t.category} ${t.kind}`.toLowerCase().includes(text)) continue;
      n += 1;
      const tr = el("tr", { class: "task", "data-task": id },
        el("td", { class: "l mono", text: id }), el("td", { class: "l", text: show(t.category) }), el("td", { class: "l", text: show(t.kind) }));
      for (const a of arms) for (const when of ["start", "end"]) {
        const r = byArm[a][when].get(id);
        const td = el("td", { class: `mark ${r ? (r.success ? "pass" : "fail") : ""}`, text: r ? (r.success ? "✓" : "✗") : "-",
          title: r ? `${a} at the ${when}: ${r.success ? "pass" : "fail"}${r.error_type ? " (" + r.error_type + ")" : ""}` : "" });
        if (r) td.addEventListener("click", () => {
          tbl.querySelectorAll("td.sel").forEach((x) => x.classList.remove("sel"));
          td.classList.add("sel");
          conv.textContent = "";
          conv.append(el("h2", { text: `${id}: ${a} at the ${when} (${r.success ? "pass" : "fail"}${r.error_type ? ", " + r.error_type : ""})` }), conversation(r.messages));
        });
        tr.append(td);
      }
      tbl.append(tr);
    }
    status.textContent = `${n} of ${tasks.size} held-out tasks`;
    status.dataset.tasks = n;
  }
  render();
}

// ------------------------------------------------------------------ start

function tabs(names) {
  const nav = document.getElementById("tabs");
  for (const [id, label] of names) {
    nav.append(el("button", { id: `tab-${id}`, text: label, onclick: () => {
      try { history.replaceState(null, "", `#${id}`); } catch (e) { /* some browsers refuse it on file:// */ }
      for (const [other] of names) {
        document.getElementById(other).hidden = other !== id;
        document.getElementById(`tab-${other}`).classList.toggle("on", other === id);
      }
      if (id === "curves") window.dispatchEvent(new Event("resize")); // plots drawn while hidden
    } }));
  }
  // a link to report.html#rollouts (or any view) opens that view
  const asked = names.find(([id]) => `#${id}` === window.location.hash);
  document.getElementById(`tab-${(asked || names[0])[0]}`).click();
}

async function main() {
  const [plotly, data] = await Promise.all([inflate("plotly-gz"), inflate("data-gz")]);
  document.head.append(el("script", { text: plotly })); // runs now: defines window.Plotly
  const D = JSON.parse(data);
  // long texts stored once (build.py's _interned): put them back in their messages
  const restore = (messages) => { for (const m of messages || []) if (m.c !== undefined) m.content = D.strings[m.c]; };
  for (const g of D.groups || []) for (const r of g.rows) restore(r.messages);
  for (const evals of Object.values(D.heldout || {})) for (const e of evals) for (const t of e.tasks) restore(t.messages);
  const what = { arm: "RL stage", all: "stage `all`", study: "study over seeds" }[D.kind];
  document.getElementById("subtitle").textContent = `${what}: ${D.title} · built ${D.built}`;
  document.title = `report: ${D.title}`;
  overview(D);
  if (D.kind === "study") {
    tabs([["overview", "Overview"], ["curves", "Curves"], ["runs", "Runs"]]);
    curves(D);
    runsView(D);
  } else {
    tabs([["overview", "Overview"], ["curves", "Curves"], ["rollouts", "Rollouts"], ["heldout", "Held-out"]]);
    curves(D);
    rollouts(D);
    heldoutView(D);
  }
  document.body.dataset.ready = "1"; // what the browser test waits for
}

main().catch((e) => {
  document.getElementById("subtitle").textContent = "error: " + e;
  console.error(e);
});
