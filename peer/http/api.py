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

Every request is its own swarm session. As many run at once as the swarm can hold
sessions of one requester (peer/http/capacity.py: with one `--max-sessions 4` peer,
4), at most `max_concurrent`; the rest wait for a slot, in order, and the number
follows the swarm's view as peers come and go. A request whose session cannot be
opened while every layer is served (the peers are busy with other requesters, or
this requester avoids them for a while) waits and tries again, up to `queue_wait`
seconds; 503 comes only when a layer has no serving peer (naming it), or when the
swarm stayed full for the whole wait (`swarm_busy`, with a Retry-After).

Bad input is a 4xx: a body announced or sent past 4 MiB is a 413 before it is read,
one that does not arrive within `body_timeout` a 408; JSON nested past 64 levels,
a missing or null `model`, or one this gateway does not serve, a 400.

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

from tessera.peer.plan.coverage import swarm_coverage
from tessera.peer.http import anthropic as http_anthropic
from tessera.peer.http import responses as http_responses
from tessera.peer.http import tools as http_tools
from tessera.peer.base.errors import NoRoute, PeerError, RouteLost, UnknownPeer
from tessera.peer.base.threads import in_worker
from tessera.peer.http.capacity import covered, session_capacity
from tessera.peer.http.defaults import (
    BODY_TIMEOUT, DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_TOKENS, DEFAULT_QUEUE_WAIT, DEFAULT_ROUTE_WAIT,
)
from tessera.peer.http.exchange import SSE_HEADERS, ClientGone, Exchange, Receive, Send
from tessera.peer.http.generation import (
    Envelope, Generation, chat_chunk, chat_object, completion_chunk, completion_object, usage_chunk,
)
from tessera.peer.http.requests import ApiError, GenerationRequest, bad, decode_body, parse_chat, parse_completion
from tessera.peer.request.policy import BadPeerId
from tessera.peer.serve.limits import ServerLimits

# Renders one answer in a dialect: the whole object, or its stream (after `gen.start()`).
Respond = Callable[[Exchange, Generation, GenerationRequest], Awaitable[None]]

if TYPE_CHECKING:
    from tessera.peer.request.client import Swarm

# Sessions of one requester a peer takes at most (not advertised: the peers' default).
PER_REQUESTER = ServerLimits.max_sessions_per_requester
# Between tries of such a request: until a slot of ours is released or the view changes, at most this.
RETRY_WAIT = 1.0
RETRY_AFTER = 10  # seconds a busy 503 tells the client to wait (Retry-After)
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
    retried: int = 0  # opens tried again after the swarm was busy


class Gateway:
    """The ASGI app (see module docstring)."""

    def __init__(self, swarm: "Swarm", *, name: str, api_key: str | None = None,
                 route_wait: float = DEFAULT_ROUTE_WAIT, max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, cors_origins: Sequence[str] = (),
                 queue_wait: float = DEFAULT_QUEUE_WAIT, body_timeout: float = BODY_TIMEOUT) -> None:
        self.swarm = swarm
        self.name = name
        self.api_key = api_key
        self.route_wait = route_wait
        self.default_max_tokens = default_max_tokens
        self.max_concurrent = max_concurrent
        self.queue_wait = queue_wait
        self.body_timeout = body_timeout
        self.cors_origins = frozenset(cors_origins)  # browser origins allowed ("*": any); empty: CORS off
        self.slots = trio.CapacityLimiter(max_concurrent)  # its total follows the swarm (follow_capacity)
        self.released = trio.Event()  # set (and replaced) whenever a request gives its slot back
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
        http = Exchange(scope, receive, send, body_timeout=self.body_timeout)
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
        try:
            await self._report(http, error)
        except (trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError) as gone:
            # The socket could not take the error response: the client closed it, or the server's
            # own reader is answering on it at the same moment (hypercorn, when a refused request's
            # unread body arrives as the 413 goes out). Nothing more can reach this client.
            log.debug("%s %s: the %d response could not be sent (%s)", http.scope["method"], http.scope["path"],
                      error.status, type(gone).__name__)

    async def _report(self, http: Exchange, error: ApiError) -> None:
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
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_capacity)
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    nursery.cancel_scope.cancel()
                    return

    def follow_capacity(self) -> int:
        """Set how many answers run at once from the swarm's view (peer/http/capacity.py); returns it."""
        held = session_capacity(self.swarm.keeper.snapshot(), per_requester=PER_REQUESTER)
        total = max(1, min(self.max_concurrent, held))  # 0 held: one request finds the real reason
        if self.slots.total_tokens != total:
            self.slots.total_tokens = total
        return total

    async def _follow_capacity(self) -> None:
        while True:
            self.follow_capacity()
            await self.swarm.keeper.wait_changed()

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
        """What a new request can get through now: routing's definition (peer/plan/coverage.py)."""
        view = self.swarm.keeper.snapshot()
        coverage = swarm_coverage(view)
        return {"layers": view.num_layers, "complete": coverage.complete,
                "missing": [list(gap) for gap in coverage.gaps], "peers": coverage.peers,
                "min_replicas": min(coverage.replicas, default=0)}

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
                        "max_concurrent": self.max_concurrent, "concurrency": self.follow_capacity(),
                        "active": stats.active, "queued": stats.queued, "retried": stats.retried,
                        "requests": stats.requests, "completed": stats.completed, "cancelled": stats.cancelled,
                        "failed": stats.failed},
        }
        await http.json(200 if routable else 503, body)

    def check_model(self, name: str | None) -> None:
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"model is required: the name of the model to use, got {name!r}"[:500],
                           param="model")
        if name not in (self.name, self.swarm.model_id):
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

        def new_generation() -> Generation:
            # a retry comes only before the first token (see the loop below), so the constraint is unused
            return Generation(self.swarm, ids, max_tokens=budget, sampling=request.sampling, stop=request.stop,
                              route_wait=self.route_wait, constraint=constraint, policy=request.policy,
                              busy_wait=self.queue_wait)  # its queue: the session's own, as long as the gateway's

        gen = new_generation()
        self.stats.requests += 1
        outcome, failure = "cancelled", None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(http.watch_disconnect, nursery.cancel_scope)
                try:
                    async with self.slot():
                        deadline = trio.current_time() + self.queue_wait
                        while True:
                            try:
                                await respond(http, gen, request)
                                break
                            except NoRoute as error:
                                if isinstance(error, RouteLost) or http.started or not self.worth_waiting(deadline):
                                    raise
                            await gen.close()  # busy: wait for room, then try again (queue, don't fail)
                            await self.wait_for_room(deadline)
                            self.stats.retried += 1
                            gen = new_generation()
                except RouteLost as error:  # the swarm failed mid-way: not "no route" at the start
                    outcome, failure = "failed", ApiError(502, f"the swarm failed this request: {error}",
                                                          type="upstream_error", code="swarm_error",
                                                          extra={"missing": [list(g) for g in error.missing]})
                except NoRoute as error:
                    outcome, failure = "failed", self.unavailable(error)
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

    def worth_waiting(self, deadline: float) -> bool:
        """Whether a request that found no route should wait and try again: serving peers claim
        every layer (they are busy, or avoided for a while), and its queue time is not up."""
        return covered(self.swarm.keeper.snapshot()) and trio.current_time() < deadline

    async def wait_for_room(self, deadline: float) -> None:
        """Until a request of ours gives its slot back or the view changes (at most RETRY_WAIT, and
        not past `deadline`)."""
        released = self.released
        with trio.move_on_at(min(deadline, trio.current_time() + RETRY_WAIT)):
            async with trio.open_nursery() as nursery:
                async def first(wait) -> None:
                    await wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(first, released.wait)
                nursery.start_soon(first, self.swarm.keeper.wait_changed)

    def unavailable(self, error: NoRoute) -> ApiError:
        """The 503 for a request that found no route: a layer nobody serves (named), or a swarm
        that stayed busy for the whole queue wait."""
        missing = {"missing": [list(g) for g in error.missing]}
        if covered(self.swarm.keeper.snapshot()):
            return ApiError(503, f"the swarm is busy: every layer is served, but no route had room for this "
                                 f"request within {self.queue_wait:g} s ({error})", type="service_unavailable",
                            code="swarm_busy", extra=missing, headers=[(b"retry-after", b"%d" % RETRY_AFTER)])
        return ApiError(503, str(error), type="service_unavailable", code="no_route", extra=missing)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """One of the answers that run at once (the rest wait here, in order)."""
        self.follow_capacity()
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
            self.released.set()
            self.released = trio.Event()

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
