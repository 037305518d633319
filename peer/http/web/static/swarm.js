// The Swarm page: routable coverage per layer, who serves which layers, and every peer's figures,
// redrawn from the server's event stream (/web/api/swarm/stream) at every change.
import { ago, bytes, el, follow, number, peerName, shortId, spanText, startPage } from "./common.js";

await startPage();
follow("/web/api/swarm/stream", render);

function render(report) {
  const L = report.num_layers;
  const headline = document.getElementById("headline");
  headline.textContent = report.headline;
  headline.dataset.ok = String(report.routable);
  drawCoverage(report.coverage, L, report.gaps);
  document.getElementById("bound").textContent = report.gone_within_s === null ? "" :
    `A peer that stops answering is no longer counted, and is shown gone, within ${report.gone_within_s} s of stopping (its neighbours report it gone, and the swarm agrees).`;
  drawLanes(report, L);
  drawPeers(report);
  drawGroups(report);
}

function columns(node, L) {
  node.style.gridTemplateColumns = `repeat(${L}, minmax(0, 1fr))`;  // CSSOM: allowed by the page's CSP
}

function drawCoverage(coverage, L, gaps) {
  const strip = document.getElementById("coverage");
  columns(strip, L);
  strip.replaceChildren(...coverage.map((count, layer) => el("div", {
    class: "cell", "data-count": Math.min(count, 3), "data-layer": layer,
    title: `layer ${layer}: ${count} replica${count === 1 ? "" : "s"} routable`,
  }, count)));
  strip.setAttribute("aria-label", `Routable replicas per layer: ${runs(coverage)}.` +
    (gaps.length ? ` Missing: ${gaps.map(([a, b]) => `[${a}, ${b})`).join(", ")}.` : ""));
  const ticks = document.getElementById("ticks");
  columns(ticks, L);
  const every = L > 60 ? 10 : 5;
  ticks.replaceChildren(...coverage.map((_, layer) => el("span", {}, layer % every === 0 ? layer : "")));
}

// "layers 0-9: 1, 10-14: 2": runs of equal counts, for a screen reader
function runs(counts) {
  const out = [];
  let start = 0;
  for (let i = 1; i <= counts.length; i += 1) {
    if (i === counts.length || counts[i] !== counts[start]) {
      out.push(`layers ${start}${i - 1 > start ? `–${i - 1}` : ""}: ${counts[start]}`);
      start = i;
    }
  }
  return out.join(", ");
}

function byPlace(a, b) {
  return a.span[0] - b.span[0] || a.span[1] - b.span[1] || a.shard[0] - b.shard[0] || peerName(a).localeCompare(peerName(b));
}

function drawLanes(report, L) {
  const lanes = document.getElementById("lanes");
  const rows = [...report.peers].sort(byPlace).map((p) => lane(p, L, p.state, p.not_routable));
  rows.push(...report.gone.map((p) => lane(p, L, "gone", "gone")));
  if (!rows.length) rows.push(el("p", { class: "empty" }, "No peer serves this model yet."));
  lanes.replaceChildren(...rows);
}

function lane(p, L, state, why) {
  const track = el("div", { class: "track" });
  columns(track, L);
  const [a, b] = p.span;
  if (b > a) {
    const label = state === "gone" ? "gone" : why && why !== state ? `${state} (${why})` : state;
    const bar = el("div", {
      class: "span", "data-state": state, "data-routable": String(!why),
      title: `${peerName(p)}: layers ${spanText(p.span, p.shard)} — ${label}`,
    }, p.shard[1] > 1 ? `#${p.shard[0]}/${p.shard[1]} ${p.group} · ${label}` : label);
    bar.style.gridColumn = `${a + 1} / ${b + 1}`;
    track.append(bar);
  }
  return el("div", { class: "lane", "data-peer": p.peer_id },
    el("div", { class: "who" }, peerName(p), " ", el("small", {}, spanText(p.span, p.shard))), track);
}

function drawPeers(report) {
  const body = document.querySelector("#peers tbody");
  const rows = [...report.peers].sort(byPlace).map((p) => peerRow(p, report.now));
  rows.push(...report.gone.map((p) => goneRow(p, report.now)));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 10, class: "empty" }, "No peers.")));
  body.replaceChildren(...rows);
  const me = report.observer;
  document.getElementById("peers-note").textContent =
    `Seen by the ${me.role} ${shortId(me.peer_id)}: "Reached" and RTT are its own connection to each peer ` +
    `(direct, punched through a NAT, or relayed) beside how the peer says others reach it. ` +
    `Memory used is the span's weights (estimated from the model's shapes); speed is measured by each peer.`;
}

function who(p) {
  return el("td", {},
    el("a", { href: `/peer?id=${encodeURIComponent(p.peer_id)}` }, peerName(p)),
    el("span", { class: "why mono", title: p.peer_id }, shortId(p.peer_id)));
}

function peerRow(p, now) {
  const sessions = Math.round(p.load * p.max_sessions);
  const why = p.not_routable && p.not_routable !== p.state ? p.not_routable : null;
  return el("tr", { "data-peer": p.peer_id, "data-state": p.state },
    who(p),
    el("td", {}, spanText(p.span, p.shard), p.group ? el("span", { class: "why" }, `group ${p.group}`) : null),
    el("td", {}, el("span", { class: "badge state", "data-state": p.state }, p.state),
      why ? el("span", { class: "why" }, `not routed: ${why}`) : null),
    el("td", {}, `${p.device} · ${p.dtype}`, p.quant !== "none" ? el("span", { class: "why" }, p.quant) : null,
      p.device_free ? el("span", { class: "why" }, `${bytes(p.device_free)} free on the device`) : null),
    el("td", { class: "num" }, `${bytes(p.weights)} / ${bytes(p.offered)}`),
    el("td", { class: "num" }, p.token_ms === null ? "unmeasured" : `${number(p.token_ms, 1)} ms/token`,
      el("span", { class: "why" }, `${number(p.throughput, 0)} tok/s per layer`)),
    el("td", { class: "num" }, `${sessions}/${p.max_sessions}`, el("span", { class: "why" }, `${Math.round(p.load * 100)} %`)),
    el("td", {}, p.link || "not connected", el("span", { class: "why" }, p.reachability)),
    el("td", { class: "num" }, p.rtt_ms === null ? "—" : `${number(p.rtt_ms, 1)} ms`),
    el("td", { class: "num" }, ago(now - p.issued_at)));
}

function goneRow(p, now) {
  return el("tr", { "data-peer": p.peer_id, "data-state": "gone" },
    who(p),
    el("td", {}, spanText(p.span, p.shard)),
    el("td", {}, el("span", { class: "badge state", "data-state": "gone" }, "gone"),
      el("span", { class: "why" }, `was ${p.last_state}; gone ${ago(now - p.gone_at)}`)),
    el("td", {}, "—"), el("td", { class: "num" }, "—"), el("td", { class: "num" }, "—"),
    el("td", { class: "num" }, "—"), el("td", {}, "—"), el("td", { class: "num" }, "—"),
    el("td", { class: "num" }, ago(now - p.last_seen)));
}

function drawGroups(report) {
  const panel = document.getElementById("groups-panel");
  panel.hidden = !report.groups.length;
  const names = Object.fromEntries(report.peers.map((p) => [p.peer_id, peerName(p)]));
  document.getElementById("groups").replaceChildren(...report.groups.map((g) => el("li", {},
    el("strong", {}, g.group), ` layers [${g.span[0]}, ${g.span[1]}), ${g.count} ranks — `,
    g.complete ? "complete" : "INCOMPLETE: it cannot serve", ": ",
    g.ranks.map((r, i) => (r ? `${names[r] || shortId(r)}` : `rank ${i} missing`)).join(", "))));
}
