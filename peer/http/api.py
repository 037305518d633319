"""The OpenAI-compatible HTTP gateway: a plain ASGI app over one `Swarm`.

    GET  /health                 swarm coverage and this gateway's state (no API key needed)
    GET  /v1/models              the model the swarm serves, with its coverage
    GET  /v1/models/{name}
    POST /v1/chat/completions    messages -> the model's chat template -> an answer
    POST /v1/completions         a raw prompt (text or token ids) -> its continuation
    POST /v1/messages            Anthropic's Messages API (peer/http/anthropic.py)
    POST /v1/responses           OpenAI's Responses API (peer/http/responses.py)
    POST /admin/revoke           {"peer": ID}: stop using a peer, now (loopback clients only)

Three dialects, one generation core: each parses its body into a
`GenerationRequest` and renders a `Generation` (text deltas, finish reason,
usage) in its own shapes; `Gateway.generate` does the rest — model check,
tokens, budget, queueing, disconnects, and turning swarm failures into HTTP
errors (in the dialect's error shape: `error_body`).

Plain ASGI rather than a framework (Starlette would run on trio through anyio,
but it is one more dependency): eight routes, four of them streams, and the one
thing a framework would add — request parsing — is dialect-specific anyway
(peer/http/requests.py). It runs under hypercorn's trio worker, so the swarm
client and the HTTP server share one trio loop (peer/cli/serve.py).

Every request is its own swarm session. At most `max_concurrent` run at once;
more wait for a slot — a peer refuses a requester's sessions past its
per-requester limit (8 by default, `ServerLimits`) and a refusal makes this
gateway skip that peer for a while, which would fail everyone's requests.

A client that disconnects (mid-stream, or while waiting for a whole answer)
cancels its request: a watcher task sees ASGI's `http.disconnect` and cancels
the scope the answer runs in, and the answer's `finally` closes the swarm
session, so the peers drop its KV cache at once.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Sequence

import trio

from tessera.stages.decoding.constrained import CannotClose, JsonConstraint
from tessera.stages.errors import StageError

from tessera.peer.http import anthropic as http_anthropic
from tessera.peer.http import responses as http_responses
from tessera.peer.http import tools as http_tools
from tessera.peer.base.errors import NoRoute, PeerError, RouteLost, UnknownPeer
from tessera.peer.base.threads import in_worker
from tessera.peer.http.exchange import SSE_HEADERS, ClientGone, Exchange, Receive, Send
from tessera.peer.http.generation import (
    Envelope, Generation, chat_chunk, chat_object, completion_chunk, completion_object, usage_chunk,
)
from tessera.peer.http.requests import ApiError, GenerationRequest, bad, decode_body, parse_chat, parse_completion
from tessera.peer.request.policy import BadPeerId

# Renders one answer in a dialect: the whole object, or its stream (after `gen.start()`).
Respond = Callable[[Exchange, Generation, GenerationRequest], Awaitable[None]]

if TYPE_CHECKING:
    from tessera.peer.request.client import Swarm

DEFAULT_MAX_TOKENS = 512  # when a request gives no max_tokens (clamped to the context)
# How long a request waits for the swarm to cover every layer before it gets a 503.
DEFAULT_ROUTE_WAIT = 10.0
DEFAULT_MAX_CONCURRENT = 8  # = the peers' default sessions per requester (ServerLimits)
CORS_MAX_AGE = b"600"  # seconds a browser may cache a preflight answer
# What a browser may send on a cross-origin request (when the page asks for none in particular).
CORS_HEADERS = b"authorization, content-type, x-api-key, anthropic-version, openai-organization"

log = logging.getLogger(__name__)


@dataclass
class GatewayStats:
    started: float = field(default_factory=time.time)
    requests: int = 0  # generation requests accepted (parsed and admitted)
    completed: int = 0  # answered to the end
    cancelled: int = 0  # the client went away before the answer ended
    failed: int = 0  # ended with an error (no route, a peer failed ...)
    active: int = 0  # running on the swarm now
    queued: int = 0  # waiting for a slot


class Gateway:
    """The ASGI app (see module docstring)."""

    def __init__(self, swarm: "Swarm", *, name: str, api_key: str | None = None,
                 route_wait: float = DEFAULT_ROUTE_WAIT, max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, cors_origins: Sequence[str] = ()) -> None:
        self.swarm = swarm
        self.name = name
        self.api_key = api_key
        self.route_wait = route_wait
        self.default_max_tokens = default_max_tokens
        self.max_concurrent = max_concurrent
        self.cors_origins = frozenset(cors_origins)  # browser origins allowed ("*": any); empty: CORS off
        self.slots = trio.Semaphore(max_concurrent)
        self.stats = GatewayStats()
        self.fingerprint = f"tessera-{swarm.model_id[:16]}"
        # told of every answer as it ends, with how it ended (the web view's chat shows its route: peer/http/web/)
        self.observers: list[Callable[[Exchange, Generation, str], None]] = []
        self.routes: dict[tuple[str, str], Callable[[Exchange], Awaitable[None]]] = {
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/messages"): self.messages,
            ("POST", "/v1/responses"): self.responses,
            ("POST", "/admin/revoke"): self.admin_revoke,
        }

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: not served
        http = Exchange(scope, receive, send)
        try:
            if await self.cors(http):
                return
            await self.dispatch(http)
        except ClientGone:
            return
        except ApiError as error:
            await self.report(http, error)
        except Exception as error:  # a bug: logged with its traceback; the client gets a 500, not silence
            log.exception("%s %s failed", http.scope["method"], http.scope["path"])
            await self.report(http, ApiError(500, f"internal error: {type(error).__name__}", type="server_error"))

    async def report(self, http: Exchange, error: ApiError) -> None:
        if http.disconnected or http.finished:
            return
        anthropic = http.scope["path"].rstrip("/") == "/v1/messages"
        body = http_anthropic.error_body(error) if anthropic else error.body()
        if http.started:  # mid-stream: the clients raise on an `error` event
            if anthropic:
                await http.event(body, name="error")
            elif http.scope["path"].rstrip("/") == "/v1/responses":
                await http.event({"type": "error", "code": error.code, "message": error.message,
                                  "param": error.param}, name="error")
            else:
                await http.event(body)
            await http.write(b"", more=False)
        else:
            await http.json(error.status, body, error.headers)

    async def cors(self, http: Exchange) -> bool:
        """Add CORS headers for an allowed origin; answer a preflight (True: answered)."""
        origin = http.header(b"origin")
        if not self.cors_origins or origin is None:
            return False
        if "*" not in self.cors_origins and origin not in self.cors_origins:
            if http.scope["method"] == "OPTIONS":
                raise ApiError(403, f"the origin {origin!r} may not call this API (see --cors-origin)")
            return False  # no CORS headers: the browser refuses the answer to the page
        allowed = b"*" if "*" in self.cors_origins else origin.encode("latin-1")
        http.extra_headers = [(b"access-control-allow-origin", allowed), (b"vary", b"origin")]
        if http.scope["method"] != "OPTIONS":
            return False
        asked = http.header(b"access-control-request-headers")
        http.extra_headers += [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                               (b"access-control-allow-headers", asked.encode("latin-1") if asked else CORS_HEADERS),
                               (b"access-control-max-age", CORS_MAX_AGE)]
        await http.start(204, [])
        await http.write(b"", more=False)
        return True

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def dispatch(self, http: Exchange) -> None:
        method, path = http.scope["method"], http.scope["path"].rstrip("/") or "/"
        handler = self.routes.get((method, path))
        if handler is None and method == "GET" and path.startswith("/v1/models/"):
            handler = self.model
        if handler is None:
            allowed = sorted(m for m, p in self.routes if p == path)
            if allowed:
                raise ApiError(405, f"{method} is not allowed on {path}; use {', '.join(allowed)}",
                               headers=[(b"allow", ", ".join(allowed).encode())])
            raise ApiError(404, f"no such endpoint: {method} {path}", code="unknown_url")
        if path.startswith("/v1/"):
            self.check_key(http)
        await handler(http)

    def check_key(self, http: Exchange) -> None:
        if self.api_key is None:
            return
        given = http.header(b"x-api-key")  # how Anthropic's clients send it
        if given is not None and hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            return
        header = http.header(b"authorization") or ""
        if given is not None and not header:
            raise ApiError(401, "incorrect API key", code="invalid_api_key")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    def check_admin(self, http: Exchange) -> None:
        """Admin calls change what every request may use: only a client on this machine
        (loopback) may make them, with the API key when the gateway has one."""
        client = http.scope.get("client")
        try:
            local = client is not None and ipaddress.ip_address(client[0]).is_loopback
        except ValueError:
            local = False  # a unix socket or an unknown peer: not loopback
        if not local:
            raise ApiError(403, "admin calls are answered only from this machine (a loopback client)",
                           type="permission_error", code="forbidden")
        self.check_key(http)

    async def admin_revoke(self, http: Exchange) -> None:
        """`{"peer": ID}` -> the peer is denied from now on and taken out of every running answer."""
        self.check_admin(http)
        data = decode_body(await http.body())
        peer = data.get("peer")
        if not isinstance(peer, str):
            raise bad("peer", f"peer must be a peer id (a string), got {peer!r}")
        try:
            sessions = await self.swarm.revoke(peer)
        except BadPeerId as error:
            raise bad("peer", str(error)) from None
        except UnknownPeer as error:
            raise ApiError(404, str(error), param="peer", code="unknown_peer") from None
        await http.json(200, {"revoked": peer.strip(), "sessions": sessions, "deny": sorted(self.swarm.policy.deny)})

    # -- the swarm, as these endpoints show it --------------------------------------------

    def coverage(self) -> dict:
        view = self.swarm.keeper.snapshot()
        counts = view.coverage()
        return {"layers": view.num_layers, "complete": min(counts, default=0) > 0,
                "missing": [list(gap) for gap in view.gaps()], "peers": len(view.peers),
                "min_replicas": min(counts, default=0)}

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": int(self.stats.started), "owned_by": "tessera",
                "model_id": self.swarm.model_id, "context_length": self.swarm.spec.max_position,
                "coverage": self.coverage()}

    async def models(self, http: Exchange) -> None:
        await http.json(200, {"object": "list", "data": [self.model_card()]})

    async def model(self, http: Exchange) -> None:
        name = http.scope["path"].rstrip("/")[len("/v1/models/"):]
        if name not in (self.name, self.swarm.model_id):  # as OpenAI answers models.retrieve
            raise ApiError(404, f"The model {name!r} does not exist; this gateway serves {self.name!r}",
                           param="model", code="model_not_found")
        await http.json(200, self.model_card())

    async def health(self, http: Exchange) -> None:
        coverage = self.coverage()
        routable = self.swarm.plan().ok
        stats = self.stats
        body = {
            "status": "ok" if routable else "unavailable",
            "model": self.name, "model_id": self.swarm.model_id, "swarm": {**coverage, "routable": routable},
            "gateway": {"peer_id": self.swarm.peer_id, "uptime_s": round(time.time() - stats.started, 1),
                        "max_concurrent": self.max_concurrent, "active": stats.active, "queued": stats.queued,
                        "requests": stats.requests, "completed": stats.completed, "cancelled": stats.cancelled,
                        "failed": stats.failed},
        }
        await http.json(200 if routable else 503, body)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.name, self.swarm.model_id):
            raise ApiError(400, f"the model {name!r} does not exist here; this gateway "
                           f"serves {self.name!r}", param="model", code="model_not_found")

    # -- generation -----------------------------------------------------------------------

    async def chat(self, http: Exchange) -> None:
        data = decode_body(await http.body())
        request = replace(parse_chat(data), tools=http_tools.openai_tools(data))
        await self.openai(http, request, chat=True)

    async def completions(self, http: Exchange) -> None:
        await self.openai(http, parse_completion(decode_body(await http.body())), chat=False)

    async def openai(self, http: Exchange, request: GenerationRequest, *, chat: bool) -> None:
        env = Envelope.new("chatcmpl" if chat else "cmpl", request.model or self.name, self.fingerprint)

        async def respond(http: Exchange, gen: Generation, request: GenerationRequest) -> None:
            if request.tools is not None:
                await http_tools.openai_answer(http, gen, env, request, http_tools.tool_format(self.swarm.tokenizer))
            elif request.stream:
                await self.stream(http, gen, env, request, chat=chat)
            else:
                text = await gen.text()
                await http.json(200, (chat_object if chat else completion_object)(env, text, gen))

        await self.generate(http, request, respond)

    async def messages(self, http: Exchange) -> None:
        request = http_anthropic.parse_messages(decode_body(await http.body()))
        await self.generate(http, request, http_anthropic.responder(request.model or self.name, self.swarm.tokenizer))

    async def responses(self, http: Exchange) -> None:
        data = decode_body(await http.body())
        request = http_responses.parse_responses(data)
        await self.generate(http, request, http_responses.responder(request.model or self.name, data))

    async def prompt_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self.swarm.tokenizer
        if request.messages is not None:
            tools = request.tools.schemas() if request.tools is not None else None
            try:
                return await in_worker(lambda: tokenizer.encode_chat(list(request.messages), tools=tools))
            except StageError as error:
                raise bad("messages", str(error)) from None
        if isinstance(request.prompt, str):
            return await in_worker(lambda: tokenizer.encode(request.prompt))
        vocab = self.swarm.spec.vocab_size
        for t in request.prompt:
            if not 0 <= t < vocab:
                raise bad("prompt", f"token id {t} is outside the vocabulary [0, {vocab})")
        return list(request.prompt)

    def budget(self, request: GenerationRequest, n_prompt: int) -> int:
        """Tokens this request may generate. Raises ApiError for a prompt that does not fit."""
        context = self.swarm.spec.max_position
        param = "messages" if request.messages is not None else "prompt"
        if n_prompt == 0:
            raise bad(param, "the prompt is empty")
        if n_prompt >= context:
            raise bad(param, f"this model's maximum context length is {context} tokens, but the prompt has "
                      f"{n_prompt} tokens", code="context_length_exceeded")
        if request.max_tokens is None:
            return min(self.default_max_tokens, context - n_prompt)
        if n_prompt + request.max_tokens > context:
            raise bad("max_tokens", f"this model's maximum context length is {context} tokens; the prompt "
                      f"({n_prompt}) plus max_tokens ({request.max_tokens}) exceed it",
                      code="context_length_exceeded")
        return request.max_tokens

    async def generate(self, http: Exchange, request: GenerationRequest, respond: Respond) -> None:
        """The one generation core (see module docstring); `respond` renders the answer."""
        self.check_model(request.model)
        tokenizer, eos = self.swarm.tokenizer, self.swarm.spec.eos_token_ids
        constraint = None
        if request.tools is not None:  # a template without tools is a 400 before anything runs
            constraint = http_tools.constraint(request.tools, http_tools.tool_format(tokenizer), tokenizer, eos)
            if request.json_shape is not None and constraint is not None:
                raise bad("response_format", "a JSON response_format does not combine with tools here "
                          "(send tool_choice: none, or no tools)")
        if request.json_shape is not None and constraint is None:
            constraint = JsonConstraint(request.json_shape, tokenizer, eos)
        ids = await self.prompt_ids(request)
        budget = self.budget(request, len(ids))
        if constraint is not None:
            try:
                constraint.limit(budget)  # a format that cannot close in max_tokens: a 400 before any peer works
            except CannotClose as error:
                raise bad("max_tokens", str(error), code="max_tokens_too_small") from None
        gen = Generation(self.swarm, ids, max_tokens=budget, sampling=request.sampling,
                         stop=request.stop, route_wait=self.route_wait, constraint=constraint,
                         policy=request.policy)
        self.stats.requests += 1
        outcome, failure = "cancelled", None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(http.watch_disconnect, nursery.cancel_scope)
                try:
                    async with self.slot():
                        await respond(http, gen, request)
                except RouteLost as error:  # the swarm failed mid-way: not "no route" at the start
                    outcome, failure = "failed", ApiError(502, f"the swarm failed this request: {error}",
                                                          type="upstream_error", code="swarm_error",
                                                          extra={"missing": [list(g) for g in error.missing]})
                except NoRoute as error:
                    outcome, failure = "failed", ApiError(503, str(error), type="service_unavailable",
                                                          code="no_route",
                                                          extra={"missing": [list(g) for g in error.missing]})
                except PeerError as error:
                    outcome, failure = "failed", ApiError(502, f"the swarm failed this request: {error}",
                                                          type="upstream_error", code="swarm_error")
                except Exception:
                    outcome = "failed"  # a bug; __call__ logs it and answers 500
                    raise
                nursery.cancel_scope.cancel()
        finally:
            await gen.close()
            if http.finished and failure is None:
                outcome = "completed"
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
            for observe in self.observers:
                observe(http, gen, outcome)
        if failure is not None:
            raise failure

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        self.stats.queued += 1
        try:
            await self.slots.acquire()
        finally:
            self.stats.queued -= 1
        self.stats.active += 1
        try:
            yield
        finally:
            self.stats.active -= 1
            self.slots.release()

    async def stream(self, http: Exchange, gen: Generation, env: Envelope, request: GenerationRequest,
                     *, chat: bool) -> None:
        await gen.start()  # no route, or a refused session, is still an HTTP error: no header sent yet
        await http.start(200, SSE_HEADERS)
        if chat:
            await http.event(chat_chunk(env, {"role": "assistant", "content": ""}))
        while (delta := await gen.step()) is not None:
            if delta:
                await http.event(chat_chunk(env, {"content": delta}) if chat else completion_chunk(env, delta))
        last = chat_chunk(env, {}, gen.finish_reason) if chat else completion_chunk(env, "", gen.finish_reason)
        await http.event(last)
        if request.include_usage:
            await http.event(usage_chunk(env, "chat.completion.chunk" if chat else "text_completion", gen))
        await http.event("[DONE]")
        await http.write(b"", more=False)
