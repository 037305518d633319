"""`tessera peer`, `tessera swarm status`, `tessera demo`: running and watching a swarm.

Imported to print `--help`: what a command runs (the node, libp2p, torch) is imported
when it runs (peer/cli/options.py says why).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.peer.cli.config import add_config_options
from tessera.peer.cli.memory import return_freed_memory
from tessera.peer.cli.store import peer_data_dir
from tessera.peer.cli.options import (
    add_compile_option, add_compute_options, add_dedicated_option, add_emulation_option, add_join_options, quant_from, read_swarm_key,
)
from tessera.peer.base.errors import ConfigError
from tessera.peer.net.addresses import DEFAULT_LISTEN, DEFAULT_PORT, busy_port_error
from tessera.peer.net.join import JOIN_TIMEOUT, check_join_addrs
from tessera.stages.engine.compiled.modes import DEFAULT_COMPILE
from tessera.peer.serve.batcher import MAX_BATCH_ROWS, MAX_BATCH_WAIT, BatchBudget
from tessera.peer.serve.leaving import MAX_LEAVE_GRACE as DEFAULT_LEAVE_GRACE

if TYPE_CHECKING:
    from tessera.peer.node.config import PeerConfig
    from tessera.peer.node.peer_node import PeerNode

DEFAULT_MAX_SESSIONS = 16  # PeerConfig.max_sessions


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "peer", help="volunteer: join a swarm and serve a span of layers",
        epilog="examples:\n  tessera peer --model smollm2-135m                      # start a new swarm\n"
        "  tessera peer --join /ip4/192.0.2.7/tcp/4001/p2p/12D3KooW... --memory 2 --name attic-pc",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", metavar="NAME|FOLDER",
                   help="the model to serve: a registered name (`tessera model list`) or a model folder "
                        "(default smollm2-135m); without it here, the --join peers send the files")
    add_join_options(p)
    p.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT, metavar="S",
                   help=f"give up (exit non-zero) if no --join address is reached within S seconds (default {JOIN_TIMEOUT:g})")
    p.add_argument("--allow-alone", action="store_true",
                   help="if no --join address is reached in time, serve alone as a new swarm instead of exiting")
    p.add_argument("--listen", action="append", default=[], metavar="MULTIADDR",
                   help=f"where to listen (repeatable; default {DEFAULT_LISTEN}: every interface, or a free port "
                        f"if {DEFAULT_PORT} is taken); /ip4/127.0.0.1/tcp/0 keeps the peer to this machine")
    p.add_argument("--dedicated-port", type=int, default=0, metavar="PORT",
                   help="TCP port (on the --listen host) for sessions' and links' own connections "
                        "(default 0: any free port; forward it beside the libp2p port behind a NAT)")
    add_dedicated_option(p)
    p.add_argument("--memory", type=float, default=None, metavar="GB", help="memory offered (default: half of free RAM)")
    p.add_argument("--layers", type=parse_layers, default=None, metavar="A:B", help="force layers A to B-1")
    p.add_argument("--shard", type=parse_shard, default=None, metavar="I/N",
                   help="serve the --layers span as rank I of a tensor-shard group of N (with --group)")
    p.add_argument("--group", default="", metavar="NAME", help="the tensor-shard group's name (with --shard)")
    p.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                   help="identity key, sqlite store and trace (default ~/.local/share/tessera/NAME, NAME from --name "
                        "or 'peer'); one running peer per data dir: give each peer on a machine its own")
    p.add_argument("--name", default="", help="a display name (shown in `swarm status`; also picks the default --data-dir)")
    p.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS, metavar="N",
                   help=f"sessions served at once; a requester's session past N is refused as busy "
                        f"(default {DEFAULT_MAX_SESSIONS})")
    p.add_argument("--batch-rows", type=int, default=MAX_BATCH_ROWS, metavar="N",
                   help=f"rows one stacked forward of several sessions' steps may hold (default {MAX_BATCH_ROWS}; "
                        "1: every step alone)")
    p.add_argument("--batch-wait-ms", type=float, default=MAX_BATCH_WAIT * 1000, metavar="MS",
                   help=f"how long a batch waits for the sessions of the last one (default {MAX_BATCH_WAIT * 1000:g})")
    p.add_argument("--leave-grace", type=float, default=DEFAULT_LEAVE_GRACE, metavar="S",
                   help="on Ctrl-C, running answers get the time they need to finish, at most S seconds "
                        f"(default {DEFAULT_LEAVE_GRACE:g}); a second Ctrl-C hands them to other peers at once")
    p.add_argument("--rebalance-interval", type=float, default=None, metavar="S",
                   help="seconds between placement checks (default 10)")
    p.add_argument("--no-serve-weights", action="store_true",
                   help="do not upload model weights to peers fetching them (by default a peer serves what it holds)")
    p.add_argument("--weights-upload-mbps", type=float, default=0.0, metavar="MB/S",
                   help="upload weights to each fetching peer at most this fast (MB/s; default 0: unlimited)")
    p.add_argument("--tui", action="store_true", help="open the operator's terminal UI")
    p.add_argument("--web", type=int, default=None, metavar="PORT",
                   help="serve the web view (the swarm's coverage, this peer's sessions and events) on PORT "
                        "(0: any free port; default: off)")
    p.add_argument("--web-host", default="127.0.0.1", metavar="HOST",
                   help="address the web view listens on (default 127.0.0.1: this machine only)")
    p.add_argument("--web-api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' for the web view's data (default $TESSERA_API_KEY; "
                        "none = open); drain, pause and resume are answered from this machine only")
    p.add_argument("--web-allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="the web view is also reached as ORIGIN (a reverse proxy's or a LAN name): its host is "
                        "answered and its pages may act (repeatable; default: addresses and localhost only)")
    p.add_argument("--control-stdin", action="store_true",
                   help="read operator commands from standard input: memory GB, drain, pause, resume (see peer/cli/control.py)")
    add_emulation_option(p)
    p.add_argument("--misbehave", default=None, metavar="MODE",
                   help="FAULT INJECTION for tests and demos: perturb:P (a fraction P of steps) or wrong-weights")
    add_compute_options(p)
    add_compile_option(p, default=DEFAULT_COMPILE, what="the span")
    add_config_options(p)
    p.set_defaults(handler=run_peer)

    swarm = sub.add_parser("swarm", help="look at a swarm")
    ssub = swarm.add_subparsers(dest="swarm_command", required=True, metavar="ACTION")
    p = ssub.add_parser("status", help="every peer, and the coverage of every layer",
                        epilog="example: tessera swarm status --join /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW...")
    p.add_argument("--model", default="smollm2-135m", metavar="NAME|FOLDER",
                   help="the swarm's model: a registered name or a folder (default smollm2-135m)")
    add_join_options(p, required=True)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--only", action="store_true",
                   help="show exactly what the --join peers know (do not ask the peers they name)")
    p.set_defaults(handler=run_status)

    p = sub.add_parser("demo", help="start a local swarm and answer a prompt through it",
                       epilog='example: tessera demo --peers 3 "What is the capital of France?"')
    p.add_argument("prompt", nargs="?", default="What is the capital of France?",
                   help="what to ask (default: What is the capital of France?)")
    p.add_argument("--peers", type=int, default=3, metavar="N", help="peer processes to start (default 3)")
    p.add_argument("--model", default="smollm2-135m", metavar="NAME|FOLDER",
                   help="a registered name or a folder (default smollm2-135m)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="most tokens to generate (default 64)")
    p.set_defaults(handler=run_demo)


def parse_layers(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B), layers A to B-1."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--layers wants A:B (layers A to B-1), got {text!r}") from None
    if not 0 <= a < b:
        raise ConfigError(f"--layers {text!r} is empty or negative")
    return a, b


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N): rank I of a tensor-shard group of N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard wants I/N (rank I of a group of N), got {text!r}") from None
    if not 0 <= i < n or n < 2:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need 0 <= I < N and N >= 2")
    return i, n


def config_from(args: argparse.Namespace) -> "PeerConfig":
    from tessera.peer.node.config import PeerConfig  # imports torch: only when a peer starts

    check_join_addrs(args.join)  # one line naming the fault, before anything starts (peer/net/join.py)
    name = args.name or "peer"
    if (args.shard is None) != (not args.group) or (args.shard is not None and args.layers is None):
        raise ConfigError("a tensor-shard rank needs all of --layers A:B, --shard I/N and --group NAME")
    if args.shard is not None and args.quant != "none":
        raise ConfigError(f"--quant {args.quant} is for whole spans; a tensor-shard rank serves unquantized slices")
    data_dir = args.data_dir or peer_data_dir(name)  # ~/.local/share/tessera/NAME, as `tessera ledger --name` reads
    try:
        budget = BatchBudget(args.batch_rows, args.batch_wait_ms / 1000)
    except ValueError as bad:
        raise ConfigError(f"--batch-rows {args.batch_rows!r} / --batch-wait-ms {args.batch_wait_ms!r}: {bad}") from None
    if not args.leave_grace >= 0:
        raise ConfigError(f"--leave-grace wants 0 or more seconds, got {args.leave_grace!r}")
    if not args.join_timeout > 0:
        raise ConfigError(f"--join-timeout wants a positive number of seconds, got {args.join_timeout!r}")
    if not 0 <= args.dedicated_port <= 65535:
        raise ConfigError(f"--dedicated-port wants a TCP port (0: any free one), got {args.dedicated_port!r}")
    if not args.weights_upload_mbps >= 0:
        raise ConfigError(f"--weights-upload-mbps wants 0 (unlimited) or a positive rate, got {args.weights_upload_mbps!r}")
    return PeerConfig(
        model=args.model, join=args.join, listen=args.listen,
        dedicated=not args.no_dedicated, dedicated_port=args.dedicated_port,
        memory_gb=args.memory, layers=args.layers, data_dir=data_dir, name=args.name,
        threads=args.threads, device=args.device, dtype=args.dtype, quant=quant_from(args), compile=args.compile,
        swarm_key=read_swarm_key(args.swarm_key), max_sessions=args.max_sessions,
        batch_rows=budget.max_rows, batch_wait=budget.max_wait,
        join_timeout=args.join_timeout, allow_alone=args.allow_alone, leave_grace=args.leave_grace,
        **({"rebalance_interval": args.rebalance_interval} if args.rebalance_interval else {}),
        emulate_link=args.emulate_link, misbehave=args.misbehave,
        serve_weights=not args.no_serve_weights, weights_upload_rate=args.weights_upload_mbps * 1e6,
        **({"shard": args.shard, "group": args.group} if args.shard else {}),
    )


async def serve_until_signalled(node: "PeerNode", *, control_stdin: bool = False) -> None:
    """Run the peer; the first Ctrl-C/SIGTERM leaves gracefully (running answers finish), a second
    hands them back at once and leaves, a third stops without waiting for anything."""
    import trio

    async with trio.open_nursery() as nursery:
        if control_stdin:
            from tessera.peer.cli.control import serve_stdin

            nursery.start_soon(serve_stdin, node, node.out)
        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    if not node.stopping.is_set():
                        print("stopping: leaving the swarm (Ctrl-C again to stop now)", file=sys.stderr)
                        node.stop()  # running answers get a grace sized to them (peer/serve/leaving.py)
                    elif not node.forced:
                        print("stopping now: running answers go back to their requesters", file=sys.stderr)
                        node.stop_now()
                    else:  # a third: whatever the peer is still doing (closing its host), not waited for
                        nursery.cancel_scope.cancel()
                        return

        nursery.start_soon(watch_signals)
        await node.run()
        nursery.cancel_scope.cancel()


def run_peer(args: argparse.Namespace) -> int:
    import trio

    from tessera.peer.node.compose import build_peer
    from tessera.peer.weights.bootstrap import resolve_or_fetch

    return_freed_memory()  # before the first big allocation (peer/cli/memory.py)
    config = config_from(args)
    if args.web is not None and not 0 <= args.web <= 65535:
        raise ConfigError(f"--web wants a TCP port (0: any free one), got {args.web!r}")
    busy = busy_port_error("--web", args.web_host, args.web) if args.web is not None else None
    if busy:  # before the peer joins and loads: not a stack of errors once it serves
        raise ConfigError(busy)
    # without the model here, learn it from the --join peers (its span's weights come later, peer/weights/)
    resolve_or_fetch(config.model, config.join, swarm_key=config.swarm_key, out=lambda line: print(line, flush=True))
    node = build_peer(config)
    if args.web is not None:
        from tessera.peer.http.guard import HostRules
        from tessera.peer.http.web.server import serve_node_web  # imported here: hypercorn only when asked for

        try:
            rules = HostRules(args.web_allow_origin)
        except ValueError as bad:
            raise ConfigError(f"--web-allow-origin: {bad}") from None
        api_key = args.web_api_key or os.environ.get("TESSERA_API_KEY") or None
        node.parts.services.append(partial(serve_node_web, host=args.web_host, port=args.web, api_key=api_key,
                                           rules=rules))
    if args.tui:
        from tessera.tui.app import run_with_tui

        return run_with_tui(node)
    trio.run(partial(serve_until_signalled, node, control_stdin=args.control_stdin))
    return 0


def run_status(args: argparse.Namespace) -> int:
    import trio

    from tessera.peer.cli.status import format_status, gather_status

    check_join_addrs(args.join)

    report = trio.run(lambda: gather_status(args.join, model=args.model, swarm_key=read_swarm_key(args.swarm_key),
                                            only=args.only))
    print(json.dumps(report, indent=2) if args.json else format_status(report))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from tessera.peer.cli.demo import run_demo as demo

    return demo(prompt=args.prompt, peers=args.peers, model=args.model, max_tokens=args.max_tokens)
