// zoo serve's page: a chat over /v1/chat/completions (streamed, SSE), the model card
// (GET /v1/zoo/card) and live numbers from /metrics. Plain JavaScript, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "zoo.chat.v1";          // conversations, in localStorage
const SETTINGS = "zoo.settings.v1";
const DEFAULTS = { system: "", temperature: 0.8, top_p: 0.95, top_k: "", max_tokens: "", seed: "", ignore_eos: false,
                   markdown: true, api_key: "" };
const POLL_MS = 1000;

// ------------------------------------------------------------------ small helpers

/** h("div", {class: "x"}, child, "text", ...) -> an element; text is never parsed as HTML. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) if (c != null) el.append(c instanceof Node ? c : String(c));
  return el;
}
const fmt = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${fmt(Math.round(n))} B` : `${n.toFixed(2)} ${units[i]}`;
}
function si(n) {
  for (const [s, suffix] of [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]]) if (Math.abs(n) >= s) return (n / s).toFixed(2) + " " + suffix;
  return String(n);
}
const uid = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

// ------------------------------------------------------------------ settings

const fields = ["system", "temperature", "top_p", "top_k", "max_tokens", "seed", "ignore_eos", "markdown", "api_key"];
function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}"); } catch (e) { saved = {}; }
  const s = { ...DEFAULTS, ...saved };
  for (const f of fields) {
    const el = $(f);
    if (el.type === "checkbox") el.checked = !!s[f]; else el.value = s[f];
  }
}
function saveSettings() {
  const s = {};
  for (const f of fields) { const el = $(f); s[f] = el.type === "checkbox" ? el.checked : el.value; }
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}
function headers() {
  const key = $("api_key").value.trim();
  return key ? { "Authorization": `Bearer ${key}` } : {};
}
/** The request's sampling fields: blank number fields are left to the server's defaults. */
function sampling() {
  const out = {};
  const num = (id, parse) => { const v = $(id).value.trim(); if (v !== "") out[id] = parse(v); };
  num("temperature", parseFloat); num("top_p", parseFloat); num("max_tokens", (v) => parseInt(v, 10));
  num("seed", (v) => parseInt(v, 10));
  const k = $("top_k").value.trim();
  if (k !== "" && parseInt(k, 10) > 0) out.top_k = parseInt(k, 10);
  if ($("ignore_eos").checked) out.ignore_eos = true;
  return out;
}

// ------------------------------------------------------------------ conversations

let state = { convs: [], current: null };
function loadConvs() {
  try { state = JSON.parse(localStorage.getItem(STORE)) || state; } catch (e) { /* a broken store starts over */ }
  if (!Array.isArray(state.convs)) state = { convs: [], current: null };
  for (const c of state.convs) for (const m of c.messages) if (m.state === "streaming") m.state = "stopped";
  if (!state.convs.find((c) => c.id === state.current)) newConv();
}
function saveConvs() {
  try { localStorage.setItem(STORE, JSON.stringify(state)); } catch (e) { console.warn("conversations not saved:", e); }
}
function conv() { return state.convs.find((c) => c.id === state.current); }
function newConv() {
  const existing = state.convs.find((c) => c.messages.length === 0);
  if (existing) { state.current = existing.id; return; }
  const c = { id: uid(), title: "New chat", created: Date.now(), messages: [] };
  state.convs.unshift(c);
  state.current = c.id;
}

function renderConvs() {
  const nav = $("conversations");
  nav.replaceChildren(...state.convs.map((c) => h("div", {
    class: "conv" + (c.id === state.current ? " active" : ""), role: "button", tabindex: "0", title: c.title,
    onclick: () => { if (busy) return; state.current = c.id; saveConvs(); renderAll(); },
  }, h("span", { class: "conv-title" }, c.title), h("button", {
    class: "conv-del", type: "button", title: "Delete this conversation",
    onclick: (e) => {
      e.stopPropagation();
      if (busy && c.id === state.current) return;
      state.convs = state.convs.filter((x) => x.id !== c.id);
      if (state.current === c.id) { state.current = null; newConv(); }
      saveConvs(); renderAll();
    },
  }, "✕"))));
}

// ------------------------------------------------------------------ markdown (replies)

/** A small Markdown subset -> DOM nodes (never HTML parsing: the text stays text): fenced code,
 *  headings, lists, quotes, paragraphs; inline code, **bold**, *italic*, [links](https://...).
 *  An unclosed fence (a reply still streaming) runs to the end. */
function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let para = [], list = null;
  const flush = () => {
    if (para.length) out.append(h("p", {}, inline(para.join("\n"))));
    para = [];
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
    if (fence) {
      flush();
      const code = [];
      while (++i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i]);
      const body = code.join("\n");
      out.append(h("div", { class: "codeblock" },
        h("div", { class: "code-head" }, h("span", {}, fence[1] || "code"),
          h("button", { type: "button", onclick: () => copy(body) }, "copy")),
        h("pre", {}, h("code", { class: fence[1] ? `lang-${fence[1]}` : null }, body))));
      continue;
    }
    const head = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    const quote = line.match(/^>\s?(.*)$/);
    if (head) { flush(); out.append(h(`h${Math.min(6, head[1].length + 2)}`, {}, inline(head[2]))); }
    else if (item) {
      const ordered = /\d/.test(item[1]);
      if (para.length) { out.append(h("p", {}, inline(para.join("\n")))); para = []; }
      if (!list || list.ordered !== ordered) { list = { ordered, el: h(ordered ? "ol" : "ul", {}) }; out.append(list.el); }
      list.el.append(h("li", {}, inline(item[2])));
    } else if (quote) { flush(); out.append(h("blockquote", {}, inline(quote[1]))); }
    else if (!line.trim()) flush();
    else { list = null; para.push(line); }
  }
  flush();
  return out;
}

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(\[[^\]\n]+\]\(https?:\/\/[^\s)]+\))/g;
function inline(text) {
  const parts = [];
  let at = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > at) parts.push(text.slice(at, m.index));
    const t = m[0];
    if (m[1]) parts.push(h("code", {}, t.slice(1, -1)));
    else if (m[2]) parts.push(h("strong", {}, t.slice(2, -2)));
    else if (m[3]) parts.push(h("em", {}, t.slice(1, -1)));
    else {
      const [, label, href] = t.match(/^\[([^\]]+)\]\((.*)\)$/);
      parts.push(h("a", { href, target: "_blank", rel: "noopener noreferrer" }, label));
    }
    at = m.index + t.length;
  }
  if (at < text.length) parts.push(text.slice(at));
  return parts;
}

/** A message's text into its .content element: Markdown for replies when the setting is on. */
function fill(el, m) {
  const md = m.role === "assistant" && $("markdown").checked;
  el.classList.toggle("md", md);
  if (md) el.replaceChildren(renderMarkdown(m.content)); else el.textContent = m.content;
}

// ------------------------------------------------------------------ messages

function metaLine(m, last) {
  const parts = [];
  if (m.role === "assistant") {
    if (m.state === "stopped") parts.push(h("span", { class: "tag stopped" }, "stopped"));
    if (m.stats) {
      const s = m.stats;
      parts.push(h("span", {}, `${fmt(s.tokens)} tokens`));
      if (s.tps) parts.push(h("span", {}, `${s.tps.toFixed(1)} tok/s`));
      if (s.ttft != null) parts.push(h("span", {}, `first token ${s.ttft.toFixed(2)} s`));
      if (s.finish) parts.push(h("span", { class: "tag" }, s.finish));
    }
  }
  if (m.content) parts.push(h("button", { type: "button", onclick: () => copy(m.content) }, "copy"));
  if (m.role === "user") parts.push(h("button", { type: "button", class: "edit", onclick: () => edit(m) }, "edit"));
  if (m.role === "assistant" && last && m.state !== "streaming") {
    parts.push(h("button", { type: "button", class: "regenerate", onclick: regenerate }, "regenerate"));
  }
  return h("div", { class: "meta" }, parts);
}
function messageEl(m, i) {
  const bubble = h("div", { class: "bubble" });
  if (m.reasoning) {
    bubble.append(h("details", { class: "reasoning", open: m.state === "streaming" },
      h("summary", {}, "reasoning"), h("div", { class: "reasoning-text" }, m.reasoning)));
  }
  const content = h("div", { class: "content" });
  fill(content, m);
  bubble.append(content);
  if (m.error) bubble.append(h("div", { class: "error-text" }, `Error: ${m.error}`));
  return h("div", { class: `msg ${m.role}` + (m.error ? " error" : ""), "data-index": i, "data-state": m.state || "done" },
    bubble, metaLine(m, i === conv().messages.length - 1));
}
function renderMessages() {
  const c = conv();
  const box = $("messages");
  box.replaceChildren(...(c.messages.length ? c.messages.map(messageEl) : [EMPTY]));
  box.scrollTop = box.scrollHeight;
}
function renderAll() {
  renderConvs();
  renderMessages();
  $("chat-title").textContent = conv().title;
}
function copy(text) {
  if (navigator.clipboard && window.isSecureContext) { navigator.clipboard.writeText(text); return; }
  const t = h("textarea", {}, text);
  document.body.append(t); t.select(); document.execCommand("copy"); t.remove();
}

// ------------------------------------------------------------------ streaming a reply

let busy = false, controller = null, modelId = null;
const EMPTY = $("empty");  // shown while a conversation has no messages

function setBusy(on) {
  busy = on;
  $("send").hidden = on; $("stop").hidden = !on;
  $("clear").disabled = on; $("new-chat").disabled = on;
}

/** The request's messages: the system prompt, then the conversation (failed replies left out). */
function history(c) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of c.messages) if (!m.error && m.state !== "streaming") out.push({ role: m.role, content: m.content });
  return out;
}

async function send(text) {
  const c = conv();
  c.messages.push({ role: "user", content: text });
  if (c.title === "New chat") c.title = text.length > 40 ? text.slice(0, 40) + "…" : text;
  return reply(c);
}

/** Back into the input box: the message and everything after it leave the conversation. */
function edit(m) {
  const c = conv();
  if (busy) return;
  c.messages = c.messages.slice(0, c.messages.indexOf(m));
  saveConvs(); renderAll();
  $("input").value = m.content; grow(); $("input").focus();
}

/** Drop the conversation's last reply and ask again (new sampling settings, another seed). */
function regenerate() {
  const c = conv();
  if (busy || !c.messages.length || c.messages[c.messages.length - 1].role !== "assistant") return;
  c.messages.pop();
  return reply(c);
}

/** Stream the assistant's reply to the conversation so far into a new message. */
async function reply(c) {
  if (!modelId) await loadModel();
  const body = { model: modelId, messages: history(c), stream: true, stream_options: { include_usage: true }, ...sampling() };
  const m = { role: "assistant", content: "", reasoning: "", state: "streaming" };
  c.messages.push(m);
  saveConvs(); renderAll();
  const el = $("messages").lastElementChild;
  const contentEl = el.querySelector(".content");
  const t0 = performance.now();
  let first = null, count = 0, usage = null, finish = null;
  setBusy(true);
  controller = new AbortController();
  let reasoningEl = null;
  const show = () => {
    fill(contentEl, m);
    if (m.reasoning) {
      if (!reasoningEl) {
        const d = h("details", { class: "reasoning", open: true }, h("summary", {}, "reasoning"), h("div", { class: "reasoning-text" }));
        contentEl.before(d);
        reasoningEl = d.querySelector(".reasoning-text");
      }
      reasoningEl.textContent = m.reasoning;
    }
    const box = $("messages");
    if (box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
  };
  const handle = (data) => {
    if (data === "[DONE]") return;
    const obj = JSON.parse(data);
    if (obj.error) throw new Error(obj.error.message || JSON.stringify(obj.error));
    if (obj.usage) usage = obj.usage;
    for (const ch of obj.choices || []) {
      const d = ch.delta || {};
      if (d.content || d.reasoning_content) {
        if (first === null) first = performance.now();
        count++;
        m.content += d.content || "";
        m.reasoning += d.reasoning_content || "";
        show();
      }
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json", ...headers() }, body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try { const e = await r.json(); if (e.error && e.error.message) msg = e.error.message; } catch (e) { /* not JSON */ }
      if (r.status === 401) msg += " (set the API key in Settings)";
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let k;
      while ((k = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, k);
        buf = buf.slice(k + 2);
        for (const line of event.split("\n")) if (line.startsWith("data:")) handle(line.slice(5).trim());
      }
    }
    m.state = "done";
  } catch (e) {
    if (e.name === "AbortError") m.state = "stopped";
    else { m.state = "done"; m.error = e.message || String(e); controller.abort(); }  // an error event: close the stream
  } finally {
    controller = null;
    const end = performance.now();
    const tokens = usage ? usage.completion_tokens : count;
    if (!m.error) {
      m.stats = { tokens, finish: m.state === "stopped" ? null : finish,
                  ttft: first === null ? null : (first - t0) / 1000,
                  tps: first !== null && end > first && tokens > 1 ? (tokens - 1) / ((end - first) / 1000) : null };
    }
    saveConvs();
    el.replaceWith(messageEl(m, conv().messages.indexOf(m)));
    setBusy(false);
    $("input").focus();
  }
}

function stop() { if (controller) controller.abort(); }

// ------------------------------------------------------------------ model card

const PALETTE = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#db2777", "#65a30d"];

async function loadModel() {
  try {
    const r = await fetch("/v1/zoo/card", { headers: headers() });
    const card = await r.json();
    if (!r.ok) {
      throw new Error(((card.error && card.error.message) || `HTTP ${r.status}`)
                      + (r.status === 401 ? " (set the API key in Settings)" : ""));
    }
    modelId = card.id;
    renderCard(card);
    $("model-line").textContent = `${card.id} · ${card.n_layers} layers · ${si(card.params)} parameters · ${card.dtype}`
      + (card.quant ? ` · ${card.quant.mode}` : "");
    document.title = `${card.id} · zoo serve`;
    return card;
  } catch (e) {
    $("card-body").replaceChildren(h("div", { class: "msg error" }, `model card: ${e.message}`));
    return null;
  }
}

function renderCard(card) {
  const colors = {};
  card.kinds.forEach((k, i) => { colors[k.name] = PALETTE[i % PALETTE.length]; });
  const strip = h("div", { class: "strip", "aria-label": "layer kinds" },
    card.layers.map((l, i) => h("span", { style: `background:${colors[l.kind]}`, title: `layer ${i}: ${l.kind} (${l.mixer}+${l.ffn})` })));
  const legend = h("div", { class: "legend" },
    card.kinds.map((k) => h("span", {}, h("i", { style: `background:${colors[k.name]}` }), `${k.name} (${k.mixer}+${k.ffn}) ×${k.layers}`)));
  const kinds = h("table", { class: "kinds" }, h("caption", {}, "per layer of each kind"),
    h("thead", {}, h("tr", {}, h("th", {}, "kind"), h("th", { class: "num" }, "layers"), h("th", { class: "num", title: "parameters per layer" }, "params"),
      h("th", { class: "num" }, "cache B/tok"), h("th", { class: "num" }, "state B/seq"))),
    h("tbody", {}, card.kinds.map((k) => h("tr", {},
      h("td", { title: k.name }, `${k.mixer}+${k.ffn}`), h("td", { class: "num" }, k.layers), h("td", { class: "num" }, fmt(k.params_per_layer)),
      h("td", { class: "num" }, fmt(Math.round(k.cache_bytes_per_token))), h("td", { class: "num" }, fmt(k.state_bytes_per_sequence))))));
  const facts = [
    ["parameters", `${fmt(card.params)} (${si(card.params)})`],
    ["weights", `${bytes(card.param_bytes)} in ${card.dtype}`],
    ["cache per token", `${fmt(card.cache_bytes_per_token)} B (${card.cache_dtype})`],
    ["state per sequence", `${fmt(card.state_bytes_per_sequence)} B`],
    ["caches", `${bytes(card.cache_bytes)} for ${card.max_batch} rows × ${fmt(card.max_seq)} tokens`],
    ["quantization", card.quant ? card.quant.summary : "none"],
  ];
  if (card.load && Object.keys(card.load.outcomes).length) {
    facts.push(["stored blocks", h("div", { class: "chips" },
      Object.entries(card.load.outcomes).map(([what, n]) => h("span", { class: "chip" }, `${what}: ${n}`)))]);
  }
  facts.push(["runner", card.runner_text]);
  facts.push(["graphs", h("div", { class: "chips" }, Object.entries(card.graphs).map(([k, n]) => h("span", { class: "chip" }, `${k} ${n}`)))]);
  facts.push(["decode buckets", card.decode_buckets.join(", ")]);
  if (Object.keys(card.compile_seconds || {}).length) {
    facts.push(["compile", Object.entries(card.compile_seconds).map(([k, s]) => `${k} ${s.toFixed(1)} s`).join(", ")]);
  }
  const report = h("details", { class: "report" }, h("summary", {}, "zoo build report"),
    h("table", {}, card.report.map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, v)))));
  $("card-body").classList.remove("muted");
  $("card-body").replaceChildren(
    h("div", { class: "card-name" }, card.id),
    h("div", { class: "card-source muted" }, `${card.config} · ${card.source}`),
    h("div", { class: "small muted" }, `${card.n_layers} layers: ${card.layout}`),
    strip, legend, kinds,
    h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    report);
}

// ------------------------------------------------------------------ live metrics

/** Prometheus text -> {name: [{labels, value}]} */
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const kv of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[kv[1]] = kv[2];
    (out[m[1]] = out[m[1]] || []).push({ labels, value: parseFloat(m[4]) });
  }
  return out;
}
const total = (p, name, keep = () => true) => (p[name] || []).filter((s) => keep(s.labels)).reduce((a, s) => a + s.value, 0);
const PAGE_PATHS = new Set(["/", "/metrics", "/health", "/v1/zoo/card"]);

let last = null;
const history60 = [];
async function pollMetrics() {
  let p;
  try {
    const r = await fetch("/metrics");
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    p = parseMetrics(await r.text());
    $("conn-dot").className = "dot " + (busy ? "busy" : "ok");
    $("conn-text").textContent = busy ? "generating…" : "connected";
  } catch (e) {
    $("conn-dot").className = "dot bad";
    $("conn-text").textContent = "server unreachable";
    return;
  }
  const now = performance.now();
  const gen = total(p, "zoo_generation_tokens_total");
  const tps = last && now > last.t ? Math.max(0, (gen - last.gen) / ((now - last.t) / 1000)) : 0;
  last = { t: now, gen };
  history60.push(tps);
  if (history60.length > 60) history60.shift();
  const requests = total(p, "zoo_requests_total", (l) => !PAGE_PATHS.has(l.endpoint) && !String(l.endpoint).startsWith("/static/"));
  const ttftN = total(p, "zoo_time_to_first_token_seconds_count");
  const ttft = ttftN ? total(p, "zoo_time_to_first_token_seconds_sum") / ttftN : null;
  const cancelled = total(p, "zoo_sequences_finished_total", (l) => l.reason === "cancelled");
  const hits = total(p, "zoo_prefix_cache_hits_total"), lookups = total(p, "zoo_prefix_cache_lookups_total");
  const stat = (k, v, id) => h("div", { class: "stat", "data-metric": id }, h("div", { class: "v" }, v), h("div", { class: "k" }, k));
  $("metrics-body").replaceChildren(
    stat("tokens/s", tps.toFixed(1), "tps"),
    stat("running rows", `${fmt(total(p, "zoo_running_sequences"))}`, "running"),
    stat("queue depth", fmt(total(p, "zoo_queue_depth")), "queue"),
    stat("API requests", fmt(requests), "requests"),
    stat("tokens generated", fmt(gen), "generated"),
    stat("mean first token", ttft == null ? "–" : `${ttft.toFixed(2)} s`, "ttft"),
    stat("prompt tokens", fmt(total(p, "zoo_prompt_tokens_total")), "prompt"),
    stat("prefix hits", `${fmt(hits)}/${fmt(lookups)}`, "prefix"),
    stat("cancelled", fmt(cancelled), "cancelled"));
  spark(history60);
}
function spark(values) {
  const svg = $("spark");
  const max = Math.max(1, ...values);
  const pts = values.map((v, i) => `${(i / 59) * 240},${38 - (v / max) * 34}`);
  const ns = "http://www.w3.org/2000/svg";
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", pts.join(" "));
  const area = document.createElementNS(ns, "polygon");
  if (pts.length) area.setAttribute("points", `0,40 ${pts.join(" ")} ${((values.length - 1) / 59) * 240},40`);
  svg.replaceChildren(area, line);
  $("spark-peak").textContent = `peak ${Math.max(0, ...values).toFixed(1)}`;
}

// ------------------------------------------------------------------ wiring

function grow() { const t = $("input"); t.style.height = "auto"; t.style.height = Math.min(t.scrollHeight, 220) + "px"; }

function main() {
  loadSettings();
  loadConvs();
  renderAll();
  for (const f of fields) $(f).addEventListener("change", () => {
    saveSettings();
    if (f === "api_key") loadModel();
    if (f === "markdown" && !busy) renderMessages();
  });
  $("reset-settings").addEventListener("click", () => { localStorage.removeItem(SETTINGS); loadSettings(); });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || busy) return;
    $("input").value = ""; grow();
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("input").addEventListener("input", grow);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => { const c = conv(); c.messages = []; c.title = "New chat"; saveConvs(); renderAll(); });
  $("new-chat").addEventListener("click", () => { newConv(); saveConvs(); renderAll(); $("input").focus(); });
  $("toggle-panel").addEventListener("click", () => {
    const hidden = $("app").classList.toggle("no-panel");
    $("toggle-panel").textContent = hidden ? "Show panel" : "Hide panel";
  });
  loadModel();
  pollMetrics();
  setInterval(pollMetrics, POLL_MS);
  $("input").focus();
}
main();
