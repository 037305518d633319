"""The web view as an ASGI app: three pages, their files, and the JSON and event streams they read.

    GET  /  /swarm  /chat  /peer      the pages (no key needed: they hold no data)
    GET  /static/NAME                 their stylesheet, scripts and icon
    GET  /web/api/info                what this server is (gateway or peer), whether a key is needed,
                                      whether this client may act (loopback); no key needed
    GET  /web/api/swarm               the Swarm page's data (report.py), once
    GET  /web/api/swarm/stream        ... as Server-Sent Events, one per change (at most one a WATCH_INTERVAL)
    GET  /web/api/peer?id=ID          one peer: its entry, sessions, recent events, tokens/s series
    GET  /web/api/peer/stream?id=ID   ... as Server-Sent Events
    GET  /web/api/answer?tag=TAG      which route served the Chat page's answer TAG (a gateway's)
    POST /web/api/peer/ACTION         drain, pause or resume this peer (a peer's; loopback only)

Anything else goes to the app behind it — `tessera serve`'s `Gateway`, with its
/v1 API, /health and /admin — so one server answers both (`WebApp(source, inner=gateway)`).
A peer's `--web` has nothing behind it.

The data calls follow the API's rules (access.py): the key when one is set, and admin
actions from this machine only. The pages send the key from the browser's session
storage, where the page's key form puts it; EventSource cannot send headers, so the
pages read event streams with fetch.

Run `run()` beside the server: it is the sampler (`SwarmWatch`) every page reads.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Awaitable, Callable
from urllib.parse import parse_qs

import trio

from tessera.peer.http.exchange import SSE_HEADERS, ClientGone, Exchange, Receive, Send
from tessera.peer.http.requests import ApiError
from tessera.peer.http.web.access import Access, KeyAccess, is_loopback
from tessera.peer.http.web.answers import TAG_HEADER, AnswerBook, summarize, valid_tag
from tessera.peer.http.web.report import swarm_report
from tessera.peer.http.web.sources import GatewaySource, NodeSource, weights_estimate
from tessera.peer.http.web.static import SECURITY_HEADERS, load_static
from tessera.peer.http.web.watch import SwarmWatch
from tessera.peer.net.gossip import bound_seconds

Asgi = Callable[[dict, Receive, Send], Awaitable[None]]
PAGES = {"/": "swarm.html", "/swarm": "swarm.html", "/chat": "chat.html", "/peer": "peer.html"}
PEER_ACTIONS = ("drain", "pause", "resume")
HEARTBEAT = 15.0  # seconds of quiet after which a stream sends a comment (proxies close silent streams)

log = logging.getLogger(__name__)


class WebApp:
    """The ASGI app (see the module docstring)."""

    def __init__(self, source: GatewaySource | NodeSource, *, access: Access, inner: Asgi | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.source = source
        self.access = access
        self.inner = inner
        self.clock = clock
        self.files = load_static()
        self.watch = SwarmWatch(source, clock=clock)
        self.answers = AnswerBook()
        self.routes: dict[tuple[str, str], Callable[[Exchange], Awaitable[None]]] = {
            ("GET", "/web/api/info"): self.info,
            ("GET", "/web/api/swarm"): self.swarm,
            ("GET", "/web/api/swarm/stream"): self.swarm_stream,
            ("GET", "/web/api/peer"): self.peer,
            ("GET", "/web/api/peer/stream"): self.peer_stream,
            ("GET", "/web/api/answer"): self.answer,
            **{("POST", f"/web/api/peer/{action}"): self.peer_action for action in PEER_ACTIONS},
        }

    @staticmethod
    def for_gateway(gateway) -> "WebApp":
        """`tessera serve`'s app: the web view in front of `gateway`, told of every answer it ends."""
        web = WebApp(GatewaySource(gateway), access=gateway, inner=gateway)
        gateway.observers.append(web.answered)
        return web

    @staticmethod
    def for_node(node, *, api_key: str | None) -> "WebApp":
        """`tessera peer --web`'s app: the peer's own view, alone on its port."""
        return WebApp(NodeSource(node), access=KeyAccess(api_key))

    async def run(self) -> None:
        """The sampler, until cancelled."""
        try:
            await self.watch.run()
        finally:
            self.source.close()

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.owns(scope["path"]):
            http = Exchange(scope, receive, send)
            try:
                await self.dispatch(http)
            except ClientGone:
                return
            except ApiError as error:
                if not http.started:
                    await http.json(error.status, error.body(), [*error.headers, *SECURITY_HEADERS])
            except Exception as error:  # a bug: logged; the page gets a 500, not silence
                log.exception("%s %s failed", scope["method"], scope["path"])
                if not http.started:
                    failure = ApiError(500, f"internal error: {type(error).__name__}", type="server_error")
                    await http.json(500, failure.body())
            return
        if self.inner is not None:
            await self.inner(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            http = Exchange(scope, receive, send)
            await http.json(404, ApiError(404, f"no such page: {scope['path']}", code="unknown_url").body())

    def owns(self, path: str) -> bool:
        return path in PAGES or path.startswith("/static/") or path.startswith("/web/")

    async def dispatch(self, http: Exchange) -> None:
        method, path = http.scope["method"], http.scope["path"]
        if path in PAGES or path.startswith("/static/"):
            if method not in ("GET", "HEAD"):
                raise ApiError(405, f"{method} is not allowed on {path}; use GET", headers=[(b"allow", b"GET, HEAD")])
            await self.file(http, PAGES.get(path) or path[len("/static/"):])
            return
        handler = self.routes.get((method, path.rstrip("/")))
        if handler is None:
            allowed = sorted(m for m, p in self.routes if p == path.rstrip("/"))
            if allowed:
                raise ApiError(405, f"{method} is not allowed on {path}; use {', '.join(allowed)}",
                               headers=[(b"allow", ", ".join(allowed).encode())])
            raise ApiError(404, f"no such endpoint: {method} {path}", code="unknown_url")
        await handler(http)

    async def file(self, http: Exchange, name: str) -> None:
        found = self.files.get(name)
        if found is None:
            raise ApiError(404, f"no such file: {name!r}", code="unknown_url")
        if http.header(b"if-none-match") == found.etag.decode():
            await http.start(304, [(b"etag", found.etag), *SECURITY_HEADERS])
            await http.write(b"", more=False)
            return
        await http.start(200, [*found.headers(), (b"content-length", str(len(found.body)).encode())])
        await http.write(b"" if http.scope["method"] == "HEAD" else found.body, more=False)

    # -- data ---------------------------------------------------------------------------

    async def info(self, http: Exchange) -> None:
        await http.json(200, {
            "role": self.source.role, "model": self.source.model, "model_id": self.source.model_id,
            "peer_id": self.source.me, "chat": self.source.chat, "key_required": self.access.api_key is not None,
            "admin": is_loopback(http), "peer_actions": list(PEER_ACTIONS) if self.source.role == "peer" else [],
            "interval_s": self.watch.interval,
        }, SECURITY_HEADERS)

    def swarm_data(self) -> dict:
        source = self.source
        view = self.watch.view if self.watch.view is not None else source.view()
        rtts = source.rtt_ms()
        report = swarm_report(view, model=source.model, model_id=source.model_id, observer=source.me,
                              role=source.role, now=self.clock(), rtt_ms=rtts, link_of=source.link_of,
                              weights_of=lambda p: weights_estimate(source.spec, p), gone=self.watch.gone_entries())
        report["gone_within_s"] = gone_within(report["record_ttl_s"], len(view.peers), self.watch.interval)
        return report

    async def swarm(self, http: Exchange) -> None:
        self.access.check_key(http)
        await http.json(200, self.swarm_data(), SECURITY_HEADERS)

    async def swarm_stream(self, http: Exchange) -> None:
        self.access.check_key(http)
        await self.stream(http, self._swarm_async)

    async def _swarm_async(self) -> dict:
        return self.swarm_data()

    async def peer_data(self, peer_id: str) -> dict:
        source = self.source
        report = self.swarm_data()
        entry = next((p for p in report["peers"] if p["peer_id"] == peer_id), None)
        gone = next((p for p in report["gone"] if p["peer_id"] == peer_id), None)
        local = peer_id == source.me and source.role == "peer"
        return {
            "peer_id": peer_id, "now": report["now"], "num_layers": report["num_layers"],
            "observer": report["observer"], "model": report["model"],
            "entry": entry, "gone": gone, "local": local,
            "names": {p["peer_id"]: p["name"] for p in report["peers"] + report["gone"] if p["name"]},
            "status": source.local_status() if local else None,
            "sessions": source.sessions_of(peer_id),
            # the peer's own trace (its web view), else what this observer saw of it
            "events": await source.recent_events() if local else [],
            "changes": self.watch.changes_of(peer_id),
            "rate": self.watch.rate_of(peer_id),
            "rate_of": ("tokens this peer computed (prompt and answer positions), per second" if local else
                        "tokens this gateway's answers had through it, per second (counted as each answer ends)"
                        if source.role == "gateway" else None),
        }

    def peer_id_of(self, http: Exchange) -> str:
        query = parse_qs(http.scope.get("query_string", b"").decode("latin-1"))
        peer_id = (query.get("id") or [""])[0].strip() or self.source.me
        if not peer_id or len(peer_id) > 128 or not peer_id.isalnum():
            raise ApiError(400, f"id must be a peer id, got {peer_id!r}", param="id")
        return peer_id

    async def peer(self, http: Exchange) -> None:
        self.access.check_key(http)
        await http.json(200, await self.peer_data(self.peer_id_of(http)), SECURITY_HEADERS)

    async def peer_stream(self, http: Exchange) -> None:
        self.access.check_key(http)
        peer_id = self.peer_id_of(http)
        await self.stream(http, lambda: self.peer_data(peer_id))

    async def stream(self, http: Exchange, make: Callable[[], Awaitable[dict]]) -> None:
        """Server-Sent Events: `make()` after every sample of the watch, sent when it changed."""
        await http.start(200, [*SSE_HEADERS, *SECURITY_HEADERS])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(http.watch_disconnect, nursery.cancel_scope)
            seen, last, quiet_since = -1, "", trio.current_time()
            while True:
                with trio.move_on_after(HEARTBEAT):
                    seen = await self.watch.wait_update(seen)
                body = await make()
                text = json.dumps({**body, "now": None})  # the clock alone changes nothing on the page
                if text != last:
                    last = text
                    await http.event(body)
                    quiet_since = trio.current_time()
                elif trio.current_time() - quiet_since >= HEARTBEAT:
                    await http.write(b": still here\n\n")
                    quiet_since = trio.current_time()

    async def answer(self, http: Exchange) -> None:
        self.access.check_key(http)
        query = parse_qs(http.scope.get("query_string", b"").decode("latin-1"))
        tag = (query.get("tag") or [""])[0]
        if not valid_tag(tag):
            raise ApiError(400, "tag must be 8 to 64 letters, digits, '-' or '_'", param="tag")
        found = await self.answers.get(tag)
        if found is None:
            raise ApiError(404, f"no answer tagged {tag!r} ended in the last moments", param="tag")
        await http.json(200, found, SECURITY_HEADERS)

    def answered(self, http: Exchange, gen, outcome: str) -> None:
        """The gateway's observer: an answer ended (completed, cancelled or failed)."""
        summary = summarize(gen.info, prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                            finish_reason=gen.finish_reason, outcome=outcome)
        if isinstance(self.source, GatewaySource):
            for peer in self.source.credit(summary):
                self.watch.note(peer, f"an answer of {summary['completion_tokens']} tokens "
                                      f"({summary['prompt_tokens']} in the prompt) went through it: {outcome}")
            view = self.watch.view
            if view is not None:  # counters of peers neither in view nor recently gone go
                self.source.forget({p.peer_id for p in view.peers} | set(self.watch.gone))
        tag = http.header(TAG_HEADER)
        if valid_tag(tag):
            self.answers.record(tag, summary)

    async def peer_action(self, http: Exchange) -> None:
        self.access.check_admin(http)
        if not isinstance(self.source, NodeSource):
            raise ApiError(404, "this server is not a peer: drain, pause and resume are a peer's own (tessera peer --web)",
                           code="unknown_url")
        action = http.scope["path"].rstrip("/").rsplit("/", 1)[-1]
        node = self.source.node
        if node.server is None:
            raise ApiError(409, "the peer is not serving yet", code="not_ready")
        await getattr(node, action)()
        self.watch.tick()
        await http.json(200, {"done": action, "state": str(node.state)}, SECURITY_HEADERS)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def gone_within(record_ttl: float | None, peers: int, interval: float) -> float | None:
    """The page's bound: a peer that stops answering is uncounted and shown gone at most this long
    after it stopped. Not its advertisement's lifetime (a day: the page said "within 86401 s"): a
    dead peer's record goes by a departure its neighbours report, and the swarm agrees on it within
    B(N) (peer/net/gossip.py `bound_seconds`); then one sample of the watch. A record that expires
    sooner (a test's short lifetime) bounds it too. None: no peer, no bound to say."""
    if record_ttl is None:
        return None
    return round(min(record_ttl, bound_seconds(peers + 1)) + interval, 1)
