// The Peer page: one peer's figures, its sessions, recent events and a tokens/s sparkline, from
// /web/api/peer/stream?id=ID. On a peer's own web view (tessera peer --web) the peer itself is the
// default and its own truth is shown (its trace, its sessions); elsewhere, what this server saw.
import { ago, api, bytes, clock, el, follow, number, peerName, shortId, spanText, startPage } from "./common.js";

const info = await startPage();
const params = new URLSearchParams(location.search);
const chosen = params.get("id") || (info.role === "peer" ? info.peer_id : "");
const pick = document.getElementById("peer-pick");

pick.addEventListener("change", () => { location.search = `?id=${encodeURIComponent(pick.value)}`; });
follow("/web/api/swarm/stream", (report) => {
  fillPicker(report);
  if (!chosen && !pick.dataset.started && report.peers.length) {
    pick.dataset.started = "1";
    location.replace(`/peer?id=${encodeURIComponent([...report.peers].sort((a, b) => a.span[0] - b.span[0])[0].peer_id)}`);
  }
});
if (chosen) follow(`/web/api/peer/stream?id=${encodeURIComponent(chosen)}`, render);
else document.getElementById("peer-state").textContent = "No peer chosen yet: waiting for the swarm…";

function fillPicker(report) {
  const entries = [...report.peers, ...report.gone].sort((a, b) => a.span[0] - b.span[0]);
  const ids = entries.map((p) => p.peer_id).join(" ");
  if (pick.dataset.ids === ids) return;
  pick.dataset.ids = ids;
  const options = entries.map((p) => el("option", { value: p.peer_id, selected: p.peer_id === chosen },
    `${peerName(p)} ${spanText(p.span, p.shard)}${p.state === "gone" ? " (gone)" : ""}${p.peer_id === info.peer_id ? " (this peer)" : ""}`));
  if (chosen && !entries.some((p) => p.peer_id === chosen)) options.unshift(el("option", { value: chosen, selected: true }, shortId(chosen)));
  pick.replaceChildren(...options);
}

function render(data) {
  const entry = data.entry || data.gone;
  const name = entry ? peerName(entry) : shortId(data.peer_id);
  document.title = `${name} · Peer · Tessera`;
  document.getElementById("peer-title").textContent = `Peer ${name}${data.local ? " (this peer)" : ""}`;
  const state = document.getElementById("peer-state");
  if (data.entry) {
    state.dataset.ok = String(!data.entry.not_routable);
    state.textContent = `${data.entry.state}${data.entry.not_routable && data.entry.not_routable !== data.entry.state ? ` — not routed: ${data.entry.not_routable}` : ""} · layers ${spanText(data.entry.span, data.entry.shard)} of ${data.num_layers}`;
  } else if (data.gone) {
    state.dataset.ok = "false";
    state.textContent = `gone ${ago(data.now - data.gone.gone_at)} (was ${data.gone.last_state}, layers ${spanText(data.gone.span, data.gone.shard)})`;
  } else {
    state.dataset.ok = "false";
    state.textContent = "not in this server's view of the swarm";
  }
  drawFacts(data);
  drawActions(data);
  drawRate(data);
  drawSessions(data);
  drawEvents(data);
}

function fact(label, ...value) {
  return el("div", {}, el("dt", {}, label), el("dd", {}, ...value));
}

function drawFacts(data) {
  const p = data.entry;
  const s = data.status;
  const facts = [fact("Peer id", el("span", { class: "mono", title: data.peer_id }, shortId(data.peer_id)))];
  if (s) {
    facts.push(fact("Memory used / offered", `${bytes(s.memory_used)} / ${bytes(s.memory_offered)}`),
      fact("Device", s.device), fact("Sessions", `${s.sessions} of ${s.max_sessions}`),
      fact("Up for", ago(s.uptime).replace(" ago", "")),
      fact("Served", `${s.stats.steps || 0} steps, ${s.stats.tokens || 0} tokens`));
  }
  if (p) {
    facts.push(
      fact("Speed", p.token_ms === null ? "unmeasured" : `${number(p.token_ms, 1)} ms/token (${number(p.throughput, 0)} tok/s per layer)`),
      fact("Load", `${Math.round(p.load * 100)} % of ${p.max_sessions} sessions`),
      fact("Reachable as", p.reachability),
      fact("Link from here", p.link || "not connected"),
      fact("RTT from here", p.rtt_ms === null ? "—" : `${number(p.rtt_ms, 1)} ms`),
      fact("Last advertised", ago(data.now - p.issued_at)));
    if (!s) facts.push(fact("Memory used / offered", `${bytes(p.weights)} / ${bytes(p.offered)}`), fact("Device", `${p.device} · ${p.dtype}`));
    const rtts = Object.entries(p.neighbours);
    if (rtts.length) facts.push(fact("Its RTTs", rtts.map(([id, ms]) => `${data.names[id] || shortId(id)} ${number(ms, 1)} ms`).join(", ")));
  }
  document.getElementById("facts").replaceChildren(...facts);
}

function drawActions(data) {
  const box = document.getElementById("actions");
  box.hidden = !(data.local && info.admin);
  if (box.hidden || box.dataset.ready) return;
  box.dataset.ready = "1";
  for (const button of box.querySelectorAll("button[data-action]")) {
    button.addEventListener("click", async () => {
      const result = document.getElementById("action-result");
      try {
        const done = await (await api(`/web/api/peer/${button.dataset.action}`, {
          method: "POST", body: "{}", headers: { "content-type": "application/json" },  // what the server's guard asks
        })).json();
        result.textContent = `${done.done}: now ${done.state}`;
      } catch (error) {
        result.textContent = String(error.message || error);
      }
    });
  }
}

function drawRate(data) {
  const svg = document.getElementById("spark");
  const text = document.getElementById("rate-text");
  const rate = data.rate;
  if (!rate || !data.rate_of) {
    svg.replaceChildren();
    text.textContent = data.rate_of === null || !data.rate_of
      ? "Tokens per second are known to the peer itself: open its own web view (tessera peer --web PORT)."
      : "No tokens yet.";
    return;
  }
  const points = rate.points;
  const W = 600, H = 90, pad = 4;
  const top = Math.max(rate.peak, 1);
  const t1 = points.length ? points[points.length - 1][0] : 0;
  const span = 120;  // seconds across the chart (the server keeps two minutes)
  const xy = points.map(([t, r]) => [W - ((t1 - t) / span) * W, H - pad - (r / top) * (H - 2 * pad)]);
  const line = xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
  const ns = "http://www.w3.org/2000/svg";
  const make = (tag, attrs) => {
    const node = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  };
  const parts = [make("line", { class: "base", x1: 0, y1: H - pad, x2: W, y2: H - pad })];
  if (xy.length > 1) {
    parts.push(make("polygon", { class: "area", points: `${xy[0][0]},${H - pad} ${line} ${xy[xy.length - 1][0]},${H - pad}` }));
    parts.push(make("polyline", { class: "line", points: line }));
  }
  svg.replaceChildren(...parts);
  svg.setAttribute("aria-label", `tokens per second over the last two minutes: now ${number(rate.now)}, peak ${number(rate.peak)}`);
  text.textContent = `now ${number(rate.now)} tokens/s · peak ${number(rate.peak)} · ${rate.total} in all — ${data.rate_of}.`;
  text.dataset.total = String(rate.total);
}

function drawSessions(data) {
  const table = document.getElementById("sessions");
  const note = document.getElementById("sessions-note");
  const local = data.local;
  const head = local
    ? ["Session", "Requester", "Layers", "Steps", "Tokens", "Idle"]
    : ["Answer", "Positions", "Route", "Failovers"];
  table.tHead.replaceChildren(el("tr", {}, ...head.map((h) => el("th", { scope: "col" }, h))));
  const rows = data.sessions.map((s) => local
    ? el("tr", {}, el("td", { class: "mono" }, s.id), el("td", { class: "mono", title: s.requester }, shortId(s.requester)),
      el("td", {}, spanText(s.span)), el("td", { class: "num" }, s.steps), el("td", { class: "num" }, s.tokens),
      el("td", { class: "num" }, `${number(s.idle_s)} s`))
    : el("tr", {}, el("td", { class: "mono" }, s.id), el("td", { class: "num" }, s.positions),
      el("td", {}, s.route.map((h) => `${shortId(h.peer)} [${h.start}, ${h.end})`).join(" → ")),
      el("td", { class: "num" }, s.failovers)));
  table.tBodies[0].replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: head.length, class: "empty" }, "none running"))]));
  note.textContent = local ? "Sessions this peer serves now." : info.role === "gateway"
    ? "This gateway's answers running through this peer now." : "Another peer's sessions are its own: open its web view.";
}

function drawEvents(data) {
  const items = [
    ...data.events.map((e) => ({ at: e.at, kind: e.kind, text: eventText(e, data.names) })),
    ...data.changes.map((c) => ({ at: c.at, kind: c.what === "note" ? "answer" : c.what, text: c.text })),
  ].sort((a, b) => b.at - a.at).slice(0, 100);
  document.getElementById("events").replaceChildren(...(items.length ? items.map((e) => el("li", { "data-kind": e.kind },
    el("time", { datetime: new Date(e.at * 1000).toISOString() }, clock(e.at)), el("span", { class: "kind" }, e.kind),
    el("span", {}, e.text))) : [el("li", { class: "empty" }, "nothing yet")]));
}

function eventText(e, names) {
  const f = e.fields;
  const parts = [];
  if (f.span) parts.push(`[${f.span[0]}, ${f.span[1]})`);
  if (f.session) parts.push(`session ${String(f.session).slice(0, 8)}`);
  if (f.remote) parts.push(names[f.remote] || shortId(f.remote));
  for (const [k, v] of Object.entries(f)) {
    if (["span", "session", "remote", "kind"].includes(k)) continue;
    const text = typeof v === "object" ? JSON.stringify(v) : String(v);
    parts.push(`${k} ${text.replace(/(12D3Koo|Qm)\w{30,}/g, (id) => names[id] || shortId(id))}`);
  }
  return parts.join(" · ");
}
