// The Chat page: a conversation streamed from this server's OpenAI endpoint (/v1/chat/completions),
// with the route that computed each answer (/web/api/answer) and its speed. Who may compute is the
// request's `tessera` field: allow ("only"), deny and prefer, per peer.
import { api, el, follow, peerName, readEvents, shortId, spanText, startPage } from "./common.js";

const info = await startPage();
const form = document.getElementById("composer");
const prompt = document.getElementById("prompt");
const send = document.getElementById("send");
const stop = document.getElementById("stop");
const list = document.getElementById("messages");
const history = [];  // the conversation as the API takes it: {role, content}
const choices = new Map();  // peer id -> "any" | "prefer" | "deny" | "only"
let peers = new Map();  // peer id -> the Swarm report's entry
let running = null;  // the AbortController of the answer streaming now

if (!info.chat) {
  document.getElementById("no-messages").textContent =
    "Chat is answered by a gateway (tessera serve --join …): this is a peer's own web view, without a chat endpoint.";
  for (const control of form.elements) control.disabled = true;
} else {
  follow("/web/api/swarm/stream", (report) => drawPolicy(report.peers));
}

prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    form.requestSubmit();
  }
});
stop.addEventListener("click", () => running?.abort());
document.getElementById("clear").addEventListener("click", () => {
  running?.abort();
  history.length = 0;
  list.replaceChildren();
  document.getElementById("no-messages").hidden = false;
});
form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = prompt.value.trim();
  if (text && !running) ask(text);
});

function drawPolicy(entries) {
  const ids = entries.map((p) => p.peer_id).sort().join(" ");
  const box = document.getElementById("policy");
  if (box.dataset.ids === ids) return;  // the same peers: keep the controls (and the focus) as they are
  box.dataset.ids = ids;
  peers = new Map(entries.map((p) => [p.peer_id, p]));
  const rows = [...entries].sort((a, b) => a.span[0] - b.span[0] || peerName(a).localeCompare(peerName(b))).map((p) => {
    const select = el("select", { "data-peer": p.peer_id, "aria-label": `${peerName(p)} may compute` },
      ...[["any", "may compute"], ["prefer", "prefer"], ["deny", "deny"], ["only", "only these"]].map(([value, text]) =>
        el("option", { value, selected: (choices.get(p.peer_id) || "any") === value }, text)));
    select.addEventListener("change", () => choices.set(p.peer_id, select.value));
    return el("label", { class: "who" }, el("span", {}, peerName(p), " ", el("small", { class: "muted" }, spanText(p.span, p.shard))), select);
  });
  box.replaceChildren(...(rows.length ? rows : [el("p", { class: "empty" }, "No peers yet.")]));
}

function policy() {
  const pick = (want) => [...choices].filter(([id, choice]) => choice === want && peers.has(id)).map(([id]) => id);
  const out = {};
  if (pick("only").length) out.allow = pick("only");
  if (pick("deny").length) out.deny = pick("deny");
  if (pick("prefer").length) out.prefer = pick("prefer");
  return Object.keys(out).length ? out : null;
}

function newTag() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function message(role, text) {
  document.getElementById("no-messages").hidden = true;
  const body = el("div", { class: "text" }, text);
  const item = el("li", { class: role }, el("div", { class: "role" }, role === "user" ? "You" : "Swarm"), body);
  list.append(item);
  return { item, body };
}

async function ask(text) {
  prompt.value = "";
  history.push({ role: "user", content: text });
  message("user", text);
  const { item, body } = message("assistant", "");
  list.setAttribute("aria-busy", "true");  // a screen reader reads the answer once it is whole
  const meta = el("div", { class: "meta" });
  item.append(meta);
  running = new AbortController();
  send.disabled = true;
  stop.disabled = false;
  const tag = newTag();
  const request = {
    model: info.model, messages: history, stream: true, stream_options: { include_usage: true },
    max_tokens: Number(document.getElementById("max-tokens").value) || 128,
    temperature: Number(document.getElementById("temperature").value) || 0,
  };
  const who = policy();
  if (who) request.tessera = who;
  let answer = "";
  let usage = null;
  let finish = null;
  const began = performance.now();
  let first = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", signal: running.signal, body: JSON.stringify(request),
      headers: { "content-type": "application/json", "x-tessera-answer": tag },
    });
    meta.textContent = "streaming…";
    await readEvents(response, (data) => {
      if (data === "[DONE]") return;
      if (data.error) throw new Error(data.error.message || "the swarm failed this answer");
      const choice = data.choices?.[0];
      if (choice?.delta?.content) {
        first ??= performance.now();
        answer += choice.delta.content;
        body.textContent = answer;
      }
      if (choice?.finish_reason) finish = choice.finish_reason;
      if (data.usage) usage = data.usage;
    }, running.signal);
    history.push({ role: "assistant", content: answer });
    const ended = performance.now();
    const tokens = usage?.completion_tokens ?? 0;
    const decode = first !== null && tokens > 1 ? (tokens - 1) / ((ended - first) / 1000) : null;
    meta.replaceChildren(
      el("span", { "data-speed": "" }, `${tokens} tokens in ${((ended - began) / 1000).toFixed(2)} s`,
        decode !== null ? ` · ${decode.toFixed(1)} tokens/s` : "",
        first !== null ? ` · first token after ${Math.round(first - began)} ms` : "",
        finish ? ` · ended: ${finish === "length" ? "max tokens reached" : "stop"}` : ""));
    await showRoute(meta, tag);
  } catch (error) {
    if (running.signal.aborted) {
      meta.textContent = "stopped";
      if (answer) history.push({ role: "assistant", content: answer });
    } else {
      item.classList.add("error");
      meta.textContent = String(error.message || error);
      history.pop();  // the question stays on the screen, not in what the next message sends
    }
  } finally {
    list.removeAttribute("aria-busy");
    item.dataset.done = "true";
    running = null;
    send.disabled = false;
    stop.disabled = true;
    prompt.focus();
  }
}

function hopText(hop) {
  const p = peers.get(hop.peer);
  const name = hop.peer.startsWith("group:") ? hop.peer.slice(6) : p ? peerName(p) : shortId(hop.peer);
  return `${name} [${hop.start}, ${hop.end})`;
}

async function showRoute(meta, tag) {
  try {
    const found = await (await api(`/web/api/answer?tag=${tag}`)).json();
    const route = el("span", { "data-route": "" }, "route: ", found.route.map(hopText).join(" → ") || "—");
    meta.append(route);
    if (found.failovers) {
      meta.append(el("span", {}, `${found.failovers} failover${found.failovers === 1 ? "" : "s"}; earlier: `,
        found.routes.slice(0, -1).map((r) => r.map(hopText).join(" → ")).join("; ")));
    }
  } catch (error) {
    meta.append(el("span", {}, `route not known: ${error.message || error}`));
  }
}
