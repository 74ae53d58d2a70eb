// A Tandem job's page: its record, curves, held-out conversations and training groups, read from the job API
// with the caller's token. Everything from the API is put in as text (textContent), never as
// markup: conversations are written by models.
"use strict";

const jobId = decodeURIComponent(location.pathname.split("/")[2] || "");
const REFRESH_MS = 5000;
const LIVE = new Set(["PENDING", "RUNNING", "PAUSED"]);
let timer = null;
let groupsDrawn = false;
const asked = {};  // table -> number of its newest request: an older reply is not drawn

function newest(table) {
  // A check that the request made now is still the table's newest when its reply comes.
  const mine = (asked[table] = (asked[table] || 0) + 1);
  return () => asked[table] === mine;
}

function $(id) { return document.getElementById(id); }

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function takeToken() {
  const match = location.hash.match(/token=([^&]+)/);
  if (match) {
    sessionStorage.setItem("tandem-token", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem("tandem-token") || "";
}

class ApiError extends Error {
  constructor(status, detail) { super(`${status}: ${detail}`); this.status = status; }
}

async function reply(path) {
  // The API's reply to `path` with the caller's token, or an ApiError with its detail.
  const token = sessionStorage.getItem("tandem-token") || "";
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const answer = await fetch(path, { headers });
  if (!answer.ok) {
    let detail = answer.statusText;
    try { detail = (await answer.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new ApiError(answer.status, typeof detail === "string" ? detail : JSON.stringify(detail));
  }
  return answer;
}

async function api(path) {
  return (await reply(path)).json();
}

function showError(error) {
  const box = $("error");
  box.hidden = false;
  box.textContent = error.status === 401
    ? "401 Unauthorized: the API refused this token. Enter another."
    : `The job could not be read: ${error.message}`;
  if (error.status === 401) {
    $("login").hidden = false;
    $("job").hidden = true;
    $("status").textContent = "";
    clearTimeout(timer);
  }
}

// ---- charts --------------------------------------------------------------------------

const COLORS = ["#2b6cb0", "#111111", "#dd6b20", "#2f855a", "#9f7aea"];

function lineChart(title, series) {
  const box = el("div", null, "chart");
  box.dataset.title = title;
  box.appendChild(el("h3", title));
  const drawn = series.filter(s => s.points.length);
  if (!drawn.length) { box.appendChild(el("p", "nothing recorded yet")); return box; }
  const xs = drawn.flatMap(s => s.points.map(p => p[0]));
  const ys = drawn.flatMap(s => s.points.map(p => p[1]));
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const W = 420, H = 180, L = 46, R = 8, T = 8, B = 22;
  const sx = x => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const text = (x, y, value, anchor) => {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("font-size", "10");
    t.setAttribute("text-anchor", anchor); t.textContent = value;
    svg.appendChild(t);
  };
  const axis = document.createElementNS(ns, "path");
  axis.setAttribute("d", `M${L},${T} V${H - B} H${W - R}`);
  axis.setAttribute("stroke", "#a0aec0"); axis.setAttribute("fill", "none");
  svg.appendChild(axis);
  text(L - 4, T + 8, fmt(y1), "end"); text(L - 4, H - B, fmt(y0), "end");
  text(L, H - 6, `step ${x0}`, "start"); text(W - R, H - 6, `step ${x1}`, "end");
  const legend = el("div", null, "legend");
  drawn.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", s.points.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", color); line.setAttribute("stroke-width", "1.6");
    line.setAttribute("class", "series");
    line.dataset.name = s.name;
    svg.appendChild(line);
    if (s.dots || s.points.length < 3) {  // a line of one point shows nothing
      s.points.forEach(p => {
        const dot = document.createElementNS(ns, "circle");
        dot.setAttribute("cx", sx(p[0])); dot.setAttribute("cy", sy(p[1])); dot.setAttribute("r", "3");
        dot.setAttribute("fill", color);
        svg.appendChild(dot);
      });
    }
    const key = el("span", `— ${s.name}`);
    key.style.color = color;
    legend.appendChild(key);
  });
  box.appendChild(svg);
  box.appendChild(legend);
  return box;
}

function fmt(value) {
  if (Math.abs(value) >= 1000) return value.toFixed(0);
  return Number(value.toPrecision(3)).toString();
}

function points(records, key, x = "step") {
  return records.filter(r => typeof r[key] === "number").map(r => [r[x], r[key]]);
}

function throughput(steps) {
  const out = [];
  for (let i = 1; i < steps.length; i++) {
    const seconds = steps[i].time - steps[i - 1].time;
    if (seconds > 0) out.push([steps[i].step, steps[i].trained_tokens / seconds]);
  }
  return out;
}

function drawCharts(history) {
  const steps = history.filter(h => ["rl", "offline", "generate"].includes(h.phase));
  const rounds = history.filter(h => h.phase === "eval");
  const warm = history.filter(h => h.phase === "sft");
  const charts = $("charts");
  charts.replaceChildren(
    lineChart("Reward and held-out success", [
      { name: "training reward (mean)", points: points(steps, "reward_mean") },
      { name: "held-out success", points: points(rounds, "success"), dots: true },
      { name: "training success", points: points(steps, "success") },
    ]),
    lineChart("Staleness (versions)", [
      { name: "mean", points: points(steps, "staleness_mean") },
      { name: "max", points: points(steps, "staleness_max") },
    ]),
    lineChart("Judge and simulator tokens per step", [
      { name: "judge + simulator", points: points(steps, "llm_tokens_step") },
      { name: "judge", points: points(steps, "judge_tokens_step") },
    ]),
    lineChart("Judge budget left", [{ name: "share left", points: points(steps, "judge_budget_left") }]),
    lineChart("Cost of LLM calls (USD)", [
      { name: "so far", points: points(steps, "cost_usd") },
      { name: "projected at the end", points: points(steps, "cost_usd_projected") },
    ]),
    lineChart("Cost per step (USD)", [{ name: "per step", points: points(steps, "cost_usd_step") }]),
    lineChart("Throughput (trained tokens per second)", [{ name: "tokens/s", points: throughput(steps) }]),
    lineChart("Warm start (SFT loss)", [{ name: "loss", points: points(warm, "loss", "sft_step") }]),
  );
}

// ---- record --------------------------------------------------------------------------

function costLine(record) {
  // The proxy's live sums, by role, and the last step's projection to the job's end.
  const spend = record.spend || {};
  if (!spend.calls) return "no calls yet";
  const roles = Object.entries(spend.by_role || {}).map(([role, part]) => `${role} $${fmt(part.usd)}`);
  const projected = record.metrics.cost_usd_projected;
  return `$${fmt(spend.usd)} so far (${roles.join(", ")}; ${fmt(spend.tokens)} tokens, ${fmt(spend.cached)} cached)` +
    (projected !== undefined ? `, about $${fmt(projected)} by the end at this rate` : "");
}

function drawRecord(record, history) {
  $("title").textContent = `Tandem job ${record.id}`;
  const total = record.spec && record.spec.train ? record.spec.train.num_steps : "?";
  let status = `${record.status} · step ${record.step} of ${total} · version ${record.version}`;
  if (record.paused_reason) status += ` · paused: ${record.paused_reason}`;
  if (record.warning) status += ` · ${record.warning}`;
  if (record.error) status += ` · ${record.error}`;
  $("status").textContent = status;
  const summary = $("summary");
  summary.replaceChildren();
  const held = record.held_out || {};
  const facts = [
    ["task", record.spec && record.spec.task ? record.spec.task.name : "?"],
    ["latest held-out success", "success" in held ? `${fmt(held.success)} at step ${held.step}` : "none yet"],
    ["latest training reward", "reward_mean" in record.metrics ? fmt(record.metrics.reward_mean) : "-"],
    ["cost of LLM calls", costLine(record)],
  ];
  const list = el("ul");
  facts.forEach(([name, value]) => list.appendChild(el("li", `${name}: ${value}`)));
  summary.appendChild(list);
  const alerts = $("alerts");
  alerts.replaceChildren();
  const events = history.flatMap(h => (h.health || []).map(m => `step ${h.step}: ${m}`));
  const fired = events.length ? events : record.alerts || [];
  if (fired.length) {
    alerts.appendChild(el("h2", "Health events"));
    const items = el("ul", null, "alerts");
    fired.forEach(m => items.appendChild(el("li", m)));
    alerts.appendChild(items);
  }
}

// ---- conversations -------------------------------------------------------------------

function turns(conversation, into) {
  conversation.forEach(message => {
    const turn = el("div", null, `turn ${message.role}`);
    turn.appendChild(el("span", message.role, "role"));
    turn.appendChild(el("span", message.content, "content"));
    into.appendChild(turn);
  });
}

function describe(c) {
  const m = c.metrics;
  return `example ${c.example}, trial ${c.trial}: success ${fmt(m.success ?? 0)}` +
    ("judge" in m ? `, judge ${fmt(m.judge)}` : "") + `, ${fmt(m.tokens ?? 0)} tokens` +
    (m.well_formed === 0 ? ", malformed" : "");
}

function showConversation(c, row) {
  document.querySelectorAll("#conversations tbody tr.open").forEach(r => r.classList.remove("open"));
  if (row) row.classList.add("open");
  const box = $("conversation");
  box.replaceChildren(el("h3", describe(c)));
  turns(c.conversation, box);
}

async function drawConversations() {
  const round = $("round").value;
  if (round === "") return;
  const query = `step=${round}&order=${$("order").value}&only=${$("only").value}&limit=1000`;
  const current = newest("conversations");
  const found = await api(`/v1/jobs/${jobId}/conversations?${query}`);
  if (!current()) return;  // the filters changed while it was asked for
  const body = $("conversations").querySelector("tbody");
  body.replaceChildren();
  found.forEach(c => {
    const m = c.metrics;
    const row = el("tr");
    [c.example, c.trial, fmt(m.success ?? 0), "asked" in m ? fmt(m.asked) : "-", "judge" in m ? fmt(m.judge) : "-",
      fmt(m.tokens ?? 0), fmt(m.turns ?? 0), m.well_formed === 0 ? "no" : "yes", c.versions.join("-")]
      .forEach(v => row.appendChild(el("td", v)));
    row.addEventListener("click", () => showConversation(c, row));
    body.appendChild(row);
  });
}

async function drawExtremes() {
  // The round's best and worst conversation, whatever the table's filter: one read of the round.
  const round = $("round").value;
  const extremes = $("extremes");
  extremes.replaceChildren();
  if (round === "") return;
  const all = await api(`/v1/jobs/${jobId}/conversations?step=${round}&order=highest&limit=1000`);
  if (!all.length) return;
  [["best", all[0]], ["worst", all[all.length - 1]]].forEach(([name, c]) => {
    const side = el("div", null, "side");
    side.dataset.side = name;
    side.appendChild(el("h3", `${name}: ${describe(c)}`));
    turns(c.conversation, side);
    extremes.appendChild(side);
  });
}

async function drawRound() {
  await drawExtremes();
  await drawConversations();
}

function drawRounds(history) {
  const rounds = history.filter(h => h.phase === "eval").map(h => h.step);
  const select = $("round");
  const had = select.value;
  if (rounds.join() === [...select.options].map(o => o.value).join()) return false;
  select.replaceChildren(...rounds.map(step => {
    const option = el("option", `step ${step}`);
    option.value = String(step);
    return option;
  }));
  const kept = had !== "" && rounds.includes(Number(had));
  select.value = kept ? had : String(rounds[rounds.length - 1] ?? "");
  return true;
}

// ---- training groups -----------------------------------------------------------------

function partsLine(parts, weights) {
  // R* = w_ext * R_ext - penalty + w_llm * R_llm + tool terms, with the parts that were asked.
  const terms = [];
  if (parts.r_ext !== null) terms.push(`${fmt(weights.extrinsic_weight)} × R_ext ${fmt(parts.r_ext)}`);
  terms.push(`− token penalty ${fmt(parts.token_penalty)}`);
  if (parts.r_llm !== null) terms.push(`+ ${fmt(weights.judge_weight)} × R_llm ${fmt(parts.r_llm)}`);
  if (parts.tool_terms) terms.push(`+ tool terms ${fmt(parts.tool_terms)}`);
  return `R* ${fmt(parts.reward)} = ${terms.join(" ")}`;
}

function verdict(parts, into) {
  if (parts && parts.verdict) into.appendChild(el("p", `judge: ${parts.verdict}`, "verdict"));
}

function responseBox(g, r, name) {
  const box = el("div", null, "response");
  box.dataset.response = String(r.index);
  let head = `${name || `response ${r.index}`}: reward ${fmt(r.reward)}, advantage ${fmt(r.advantage)}`;
  if (r.malformed) head += `, malformed (${r.malformed}): the floor, no futures`;
  if ("asked" in r.metrics) head += `, asked ${fmt(r.metrics.asked)}`;
  box.appendChild(el("h4", head));
  if (r.parts) { box.appendChild(el("p", partsLine(r.parts, g.weights), "parts")); verdict(r.parts, box); }
  turns(r.messages, box);
  if (r.futures.length) box.appendChild(el("p", `MR = mean of ${r.futures.length} futures' R*`, "parts"));
  r.futures.forEach((f, i) => {
    const future = el("details", null, "future");
    future.dataset.future = String(i);
    let summary = `future ${i}: ${partsLine(f.parts, g.weights)}`;
    if (f.malformed) summary += ` (unfinished: ${f.malformed})`;
    future.appendChild(el("summary", summary));
    verdict(f.parts, future);
    turns(f.messages, future);
    box.appendChild(future);
  });
  return box;
}

function showGroup(g, row) {
  document.querySelectorAll("#groups tbody tr.open").forEach(r => r.classList.remove("open"));
  if (row) row.classList.add("open");
  const box = $("group");
  box.replaceChildren(el("h3", `task ${g.task_id} (example ${g.example}), ${g.mode} mode, ` +
    `versions ${g.versions.join("-") || "-"}, dispatched at ${g.dispatched_version}, server ${g.server_id}`));
  const source = Object.entries(g.reward_source).map(([k, v]) => `${k} ${v}`).join(", ");
  box.appendChild(el("p", `reward from: ${source || "no LLM (rules and the token penalty)"}`, "source"));
  const context = el("details", null, "context");
  context.open = true;
  context.appendChild(el("summary", "context"));
  turns(g.context, context);
  box.appendChild(context);
  const ranked = [...g.responses].sort((a, b) => b.reward - a.reward);
  const sides = el("div", null, "extremes");
  [["best", ranked[0]], ["worst", ranked[ranked.length - 1]]].forEach(([name, r]) => {
    const side = responseBox(g, r, `${name}: response ${r.index}`);
    side.classList.add("side");
    side.dataset.side = name;
    sides.appendChild(side);
  });
  box.appendChild(sides);
  box.appendChild(el("h4", "every response"));
  g.responses.forEach(r => box.appendChild(responseBox(g, r)));
}

function drawGroupVersions(header) {
  // The versions the recorded groups came from (the route's X-Tandem-Group-Versions).
  const versions = (header || "").split(",").filter(v => v !== "").map(Number);
  const select = $("group-version");
  const shown = [...select.options].slice(1).map(o => Number(o.value));
  if (versions.join() === shown.join()) return;  // unchanged: leave the list as the reader has it
  const had = select.value;
  select.replaceChildren(el("option", "all"), ...versions.map(v => {
    const option = el("option", `version ${v}`);
    option.value = String(v);
    return option;
  }));
  select.options[0].value = "";
  select.value = versions.includes(Number(had)) ? had : "";
}

async function drawGroups() {
  const params = new URLSearchParams({ order: $("group-order").value, only: $("group-only").value, limit: "50" });
  if ($("group-version").value !== "") params.set("version", $("group-version").value);
  const current = newest("groups");
  const answer = await reply(`/v1/jobs/${jobId}/groups?${params}`);
  const found = await answer.json();
  if (!current()) return;  // the filters changed while it was asked for
  drawGroupVersions(answer.headers.get("x-tandem-group-versions"));
  const body = $("groups").querySelector("tbody");
  body.replaceChildren();
  found.forEach(g => {
    const rewards = g.responses.map(r => r.reward);
    const asked = g.responses.filter(r => (r.metrics.asked || 0) > 0).length;
    const malformed = g.responses.filter(r => r.malformed).length;
    const row = el("tr");
    [g.task_id, g.example, g.versions.join("-") || "-", g.responses.length, fmt(Math.min(...rewards)),
      fmt(rewards.reduce((a, b) => a + b, 0) / rewards.length), fmt(Math.max(...rewards)), asked, malformed]
      .forEach(v => row.appendChild(el("td", v)));
    row.addEventListener("click", () => showGroup(g, row));
    body.appendChild(row);
  });
  $("groups").dataset.drawn = params.toString();  // what the table shows, for a reader to wait on
}

// ---- the page ------------------------------------------------------------------------

async function refresh() {
  try {
    const record = await api(`/v1/jobs/${jobId}`);
    const history = await api(`/v1/jobs/${jobId}/history`);
    $("error").hidden = true;
    $("login").hidden = true;
    $("job").hidden = false;
    drawRecord(record, history);
    drawCharts(history);
    if (drawRounds(history)) await drawRound();  // a new round came in (or the first)
    if (!groupsDrawn) { groupsDrawn = true; await drawGroups(); }  // then on asking: a group may be open
    document.body.dataset.loaded = "true";
    if (LIVE.has(record.status)) timer = setTimeout(refresh, REFRESH_MS);
  } catch (error) {
    showError(error);
  }
}

function start() {
  if (!jobId) { showError(new ApiError(404, "no job id in the address")); return; }
  takeToken();
  $("login").addEventListener("submit", event => {
    event.preventDefault();
    sessionStorage.setItem("tandem-token", $("token").value);
    refresh();
  });
  $("round").addEventListener("change", () => drawRound().catch(showError));
  ["order", "only"].forEach(id => $(id).addEventListener("change", () => drawConversations().catch(showError)));
  ["group-version", "group-order", "group-only"].forEach(
    id => $(id).addEventListener("change", () => drawGroups().catch(showError)));
  $("group-refresh").addEventListener("click", () => drawGroups().catch(showError));
  refresh();
}

start();
