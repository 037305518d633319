"""`tessera serve`: an OpenAI- and Anthropic-compatible HTTP gateway to a swarm, and its web view.

One trio loop runs both the requester (`Swarm`, joined once for the gateway's
life) and hypercorn's trio worker serving `Gateway` (peer/http/api.py) behind the
web view's pages (`WebApp`, peer/http/web/: Swarm, Chat and Peer at /).
SIGINT or SIGTERM shut it down gracefully: no new connections, running
answers get hypercorn's grace period, then every swarm session is closed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.peer.cli.config import add_config_options
from tessera.peer.cli.options import (
    add_accept_mixed_option, add_join_options, add_policy_options, add_quant_options, add_record_trace_option,
    add_spot_check_option, apply_threads, policy_from, quant_from, read_swarm_key, span_weights_from, spot_check_from,
)
from tessera.peer.base.errors import ConfigError
from tessera.peer.net.addresses import busy_port_error
from tessera.peer.net.join import check_join_addrs
from tessera.peer.http.defaults import (
    BODY_TIMEOUT, DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_TOKENS, DEFAULT_QUEUE_WAIT, DEFAULT_ROUTE_WAIT,
)

if TYPE_CHECKING:
    from tessera.store.trace import Tracer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="requester: an OpenAI- and Anthropic-compatible HTTP API in front of a swarm",
        epilog="examples:\n"
        "  tessera serve --join /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... --port 8000\n"
        "  TESSERA_API_KEY=secret tessera serve --join ... --host 0.0.0.0\n"
        "  curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\\n"
        "       -d '{\"model\": \"smollm2-135m\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_join_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default $TESSERA_API_KEY; none = open)")
    p.add_argument("--model", default="smollm2-135m",
                   help="registered name or folder of the swarm's model; the name clients ask for")
    p.add_argument("--route-wait", type=float, default=DEFAULT_ROUTE_WAIT, metavar="S",
                   help=f"how long a request waits for the swarm to cover every layer before a 503 "
                        f"(default {DEFAULT_ROUTE_WAIT:g})")
    p.add_argument("--max-concurrent", type=int, default=DEFAULT_MAX_CONCURRENT, metavar="N",
                   help="requests running on the swarm at once, at most (they follow the sessions the swarm can "
                        f"hold for this gateway; more wait) (default {DEFAULT_MAX_CONCURRENT})")
    p.add_argument("--queue-wait", type=float, default=DEFAULT_QUEUE_WAIT, metavar="S",
                   help="how long a request keeps trying while every layer is served but the peers are busy, "
                        f"before a 503 swarm_busy (default {DEFAULT_QUEUE_WAIT:g})")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT, metavar="S",
                   help=f"seconds a client has to send its request body, or a 408 (default {BODY_TIMEOUT:g})")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"max_tokens when a request gives none (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the embedding and head")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages from ORIGIN call the API (repeatable; '*' = any; default none)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="this server is also reached as ORIGIN (a reverse proxy's or a LAN name, e.g. "
                        "https://llm.example.org): its host is answered and its pages may act (repeatable; "
                        "default: only addresses and localhost, and this server's own pages)")
    add_quant_options(p, help="route only through peers serving the model quantized so (`tessera peer --quant`; "
                      "their model id says it; default none: unquantized peers)")
    add_accept_mixed_option(p)
    add_spot_check_option(p)
    add_record_trace_option(p)
    add_policy_options(p)
    add_config_options(p)
    p.set_defaults(handler=run)


def served_name(model: str) -> str:
    """The name clients use: a registered name as given, or a model folder's own name."""
    path = Path(model).expanduser()
    return path.name if (path / "config.json").exists() else model


def run(args: argparse.Namespace) -> int:
    if not args.join:
        raise ConfigError("give at least one --join MULTIADDR (a peer of the swarm)")
    check_join_addrs(args.join)  # one line naming the fault, before anything loads (peer/net/join.py)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must lie in [0, 65535], got {args.port!r}")
    busy = busy_port_error("--port", args.host, args.port)
    if busy:  # before joining the swarm: the port is the first thing a gateway needs
        raise ConfigError(busy)
    for name in ("max_concurrent", "default_max_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)!r}")
    for name in ("route_wait", "body_timeout"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)!r}")
    if not args.queue_wait >= 0:
        raise ConfigError(f"--queue-wait must be >= 0, got {args.queue_wait!r}")
    from tessera.peer.http.guard import HostRules

    try:  # a bad --allow-origin / --cors-origin fails here, before joining
        args.host_rules = HostRules(args.allow_origin, args.cors_origin)
    except ValueError as bad:
        raise ConfigError(f"--allow-origin/--cors-origin: {bad}") from None
    args.policy = policy_from(args)  # a bad id or an unreadable @FILE fails here, before joining
    args.checks = spot_check_from(args)
    apply_threads(args.threads)
    import trio

    trio.run(serve, args)
    return 0


async def serve(args: argparse.Namespace) -> None:
    from tessera.store.trace import TraceWriter
    from tessera.peer.weights.bootstrap import REQUESTER_GROUPS, ensure_model

    api_key = args.api_key or os.environ.get("TESSERA_API_KEY") or None
    swarm_key = read_swarm_key(args.swarm_key)
    # without the model here: its embedding, head and tokenizer from the --join peers (peer/weights/)
    folder = await ensure_model(args.model, args.join, swarm_key=swarm_key, groups=REQUESTER_GROUPS,
                                out=lambda line: print(line, file=sys.stderr, flush=True))
    with contextlib.ExitStack() as stack:
        # every request's trace, when asked (--record-trace): the gateway's id is bound as it joins
        tracer = stack.enter_context(TraceWriter(args.record_trace)) if args.record_trace else None
        await _serve(args, folder, swarm_key, api_key, tracer)
    print("stopped", flush=True)


async def _serve(args: argparse.Namespace, folder: Path, swarm_key: bytes | None, api_key: str | None,
                 tracer: "Tracer | None") -> None:
    import trio
    from hypercorn.trio import serve as hypercorn_serve

    from tessera.peer.http.api import Gateway
    from tessera.peer.http.guard import OriginGuard
    from tessera.peer.http.web.app import WebApp
    from tessera.peer.http.web.server import hypercorn_config
    from tessera.peer.request.client import Swarm

    span_weights, dispute_memory = span_weights_from(args, folder)
    async with Swarm.join(args.join, model=folder, swarm_key=swarm_key, policy=args.policy, tracer=tracer,
                          quant=quant_from(args), accept_mixed=args.accept_mixed, spot_check=args.checks,
                          span_weights=span_weights, dispute_memory=dispute_memory) as swarm:
        gateway = Gateway(swarm, name=served_name(args.model), api_key=api_key, route_wait=args.route_wait,
                          max_concurrent=args.max_concurrent, default_max_tokens=args.default_max_tokens,
                          cors_origins=args.cors_origin, queue_wait=args.queue_wait, body_timeout=args.body_timeout)
        web = WebApp.for_gateway(gateway)  # the pages at /, the API behind them (peer/http/web/)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(web.run)
            async with trio.open_nursery() as server:
                guarded = OriginGuard(web, args.host_rules)  # only this machine's own pages (peer/http/guard.py)
                try:
                    binds = await server.start(partial(hypercorn_serve, guarded, hypercorn_config(args.host, args.port),
                                                       mode="asgi", shutdown_trigger=stop_signal))
                except OSError as error:  # taken since the check in `run` (another program was quicker)
                    raise ConfigError(busy_port_error("--port", args.host, args.port)
                                      or f"--port {args.port}: cannot listen on {args.host}: {error.strerror}") from None
                print(f"gateway peer id: {swarm.peer_id}", flush=True)
                for url in binds:
                    print(f"serving {gateway.name} (OpenAI and Anthropic APIs) on {url}/v1"
                          f"{' (API key required)' if api_key else ''}{peers_note(args)}", flush=True)
                    print(f"web view: {url}/ (swarm, chat, peer)", flush=True)
            nursery.cancel_scope.cancel()  # the server has stopped: so does the web view's sampler


def peers_note(args: argparse.Namespace) -> str:
    """What the gateway's line says of the peers it chains, when they are not the unquantized default."""
    if args.accept_mixed:
        return "; chaining peers of any quantization"
    quant = quant_from(args)
    return f"; chaining {quant.tag} peers" if quant.active else ""


async def stop_signal() -> None:
    """Returns on SIGINT or SIGTERM (hypercorn then shuts down gracefully)."""
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
