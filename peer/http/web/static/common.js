// What the three pages share: the API key, calls and event streams, the page frame, formatting.
// Everything is built with DOM calls and textContent: a peer's name is text, never HTML.

const KEY_STORE = "tessera.api-key";

export class AuthNeeded extends Error {}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, authorization: `Bearer ${key}` } : extra;
}

// fetch with the key; a 401 opens the key form (and rejects with AuthNeeded); other errors
// reject with the server's own message.
export async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers || {}) });
  if (response.status === 401) {
    askForKey((await errorText(response)) || "this server needs its API key");
    throw new AuthNeeded("API key needed");
  }
  if (!response.ok) throw new Error((await errorText(response)) || `${response.status} ${response.statusText}`);
  return response;
}

export async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return "";
  }
}

// Server-Sent Events read with fetch (EventSource cannot send the key): calls onData(parsed JSON, or
// the literal "[DONE]") for every `data:` line until the stream ends or `signal` aborts.
export async function readEvents(response, onData, signal) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    while (true) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        onData(data === "[DONE]" ? data : JSON.parse(data));
      }
      if (signal?.aborted) break;
    }
  } finally {
    reader.releaseLock();
  }
}

// Follow a live stream for the page's life: reconnect after a failure (with a growing pause),
// and show the connection's state in the top bar.
export function follow(path, onData) {
  let pause = 500;
  const run = async () => {
    while (true) {
      try {
        const response = await api(path);
        setLive("on");
        pause = 500;
        await readEvents(response, onData);
      } catch (error) {
        if (error instanceof AuthNeeded) return;  // the key form restarts the page
      }
      setLive("off");
      await new Promise((done) => setTimeout(done, pause));
      pause = Math.min(pause * 2, 8000);
    }
  };
  run();
}

function setLive(state) {
  const live = document.getElementById("live");
  if (!live) return;
  live.dataset.live = state;
  live.textContent = state === "on" ? "live" : "reconnecting…";
}

// -- the frame ---------------------------------------------------------------------------

let infoCache = null;

export async function serverInfo() {
  if (!infoCache) infoCache = fetch("/web/api/info").then((r) => r.json());
  return infoCache;
}

// Fill the top bar, and show the key form first when a key is needed and none is stored.
// Resolves with the server's info once the page may load its data.
export async function startPage() {
  const info = await serverInfo();
  const where = document.getElementById("where");
  if (where) {
    where.replaceChildren(
      el("span", {}, `${info.model} · ${info.role === "gateway" ? "gateway" : "peer"} `),
      el("span", { class: "mono", title: info.peer_id }, shortId(info.peer_id)),
      " · ",
      el("span", { id: "live", class: "live", "data-live": "wait" }, "connecting…"),
    );
  }
  if (info.key_required && !apiKey()) {
    askForKey("");
    await new Promise(() => {});  // the form reloads the page once a key is given
  }
  return info;
}

export function askForKey(problem) {
  const box = document.getElementById("key-form");
  if (!box) return;
  box.hidden = false;
  const message = box.querySelector("[data-problem]");
  if (message) message.textContent = problem ? `${problem}.` : "";
  const form = box.querySelector("form");
  form.onsubmit = (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, form.elements.key.value.trim());
    location.reload();
  };
  form.elements.key.focus();
}

// -- building and formatting -------------------------------------------------------------

// el("td", {class: "num"}, "12", otherNode): an element with attributes and children (text or nodes)
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function shortId(id) {
  return id ? `…${id.slice(-8)}` : "";
}

export function peerName(peer) {
  return peer.name || shortId(peer.peer_id);
}

export function spanText(span, shard) {
  const [a, b] = span;
  return shard && shard[1] > 1 ? `[${a}, ${b}) #${shard[0]}/${shard[1]}` : `[${a}, ${b})`;
}

export function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : n >= 10 ? 1 : 2)} ${units[i]}`;
}

export function ago(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 1) return "now";
  if (seconds < 90) return `${Math.round(seconds)} s ago`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

export function clock(unixSeconds) {
  return new Date(unixSeconds * 1000).toLocaleTimeString([], { hour12: false });
}

export function number(x, digits = 1) {
  return x === null || x === undefined ? "—" : Number(x).toFixed(digits);
}
