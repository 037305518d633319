"""`tessera generate`: answer a prompt, locally (`--local`) or through a swarm (`--join`).

The answer streams on stdout as it is generated: as text, or with `--json` as JSON lines
(peer/cli/json_lines.py: one object per token as it arrives, then the whole answer).
"""

from __future__ import annotations

import argparse
import sys

from tessera.stages.weights import registry
from tessera.stages.errors import StageError

from tessera.peer.base.backoff import ROUTE_WAIT
from tessera.peer.cli.options import (
    UsageError, add_accept_mixed_option, add_compile_option, add_compute_options, add_dedicated_option, add_policy_options,
    add_record_trace_option, add_sampling_options, add_spot_check_option, apply_threads,
    policy_from, quant_from, sampling_from, spot_check_from,
)
from tessera.peer.cli.json_lines import JsonLines

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="answer a prompt locally or through a swarm",
        epilog='examples:\n  tessera generate "What is the capital of France?" --local\n'
        '  tessera generate "Hi" --join /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... --json',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", help="the question or text (a chat message; --raw: plain text to continue)")
    p.add_argument("--local", action="store_true", help="run the whole model on this machine")
    p.add_argument("--join", action="append", default=[], metavar="MULTIADDR", help="a peer of the swarm to use")
    p.add_argument("--swarm-key", default=None, help="private swarm key: 64 hex chars or a file")
    p.add_argument("--speculate", default="none", metavar="DRAFT",
                   help="speculative decoding through a swarm: none (default), ngram, mtp (the model's own "
                   "multi-token-prediction layers, run here) or self:N (the model's first N layers + head, run here)")
    p.add_argument("--draft-k", type=int, default=4, help="initial draft length (adapts to acceptance)")
    p.add_argument("--no-pipeline", action="store_true", help="do not send a block before the previous one returns")
    p.add_argument("--emulate-link", default=None, metavar="SPEC",
                   help='TESTS AND BENCHMARKS ONLY: delay/pace every frame sent, e.g. "delay=40ms"')
    add_dedicated_option(p)
    p.add_argument("--model", default="smollm2-135m", help="registered name or folder (default smollm2-135m)")
    add_accept_mixed_option(p)
    p.add_argument("--wire", default="", choices=("bfloat16", "fp8"),
                   help="through a swarm: activations between peers in a compact form, NOT exact "
                        "(bfloat16 half, fp8 with a scale per row a quarter of float32's bytes); default exact")
    p.add_argument("--json", action="store_true",
                   help="stream JSON lines: one {\"piece\", \"token\"} per token, then the whole answer "
                        "(text, tokens, timing, route) with \"done\": true")
    p.add_argument("--route-wait", type=float, default=ROUTE_WAIT, metavar="S",
                   help=f"how long to wait for the (allowed) peers to cover every layer (default {ROUTE_WAIT:g})")
    add_spot_check_option(p)
    add_record_trace_option(p)
    add_sampling_options(p)
    add_policy_options(p)
    add_compute_options(p)
    add_compile_option(p, default="off", what="the local model (--local) or the requester's head (--join)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens!r}")
    sampling = sampling_from(args)
    if args.local == bool(args.join):
        raise UsageError("give exactly one of --local or --join MULTIADDR")
    if args.join:
        from tessera.peer.cli.swarm_generate import run_swarm_generate
        from tessera.peer.net.join import check_join_addrs

        check_join_addrs(args.join)  # one line naming the fault, before anything loads (peer/net/join.py)
        if not args.route_wait > 0:
            raise UsageError(f"--route-wait must be > 0, got {args.route_wait!r}")
        args.policy = policy_from(args)  # a bad id or an unreadable @FILE fails here, before joining
        args.checks = spot_check_from(args)

        return run_swarm_generate(args, sampling)
    if args.allow or args.deny or args.prefer:
        raise UsageError("--allow, --deny and --prefer choose peers of a swarm; they mean nothing with --local")
    if args.record_trace:
        raise UsageError("--record-trace records a requester of a swarm (--join); --local runs no sessions to trace")
    from tessera.stages.decoding.generate import LocalEngine

    apply_threads(args.threads)
    engine = LocalEngine(registry.resolve(args.model), device=args.device, dtype=args.dtype, quant=quant_from(args),
                         compile=args.compile, say=lambda line: print(line, file=sys.stderr))
    if args.json:
        import time

        from tessera.stages.decoding.generate import GenerationResult, prompt_ids

        lines = JsonLines(engine.tokenizer)
        ids = prompt_ids(engine.tokenizer, args.prompt, raw=args.raw)
        started = time.perf_counter()
        tokens = engine.generate_ids(ids, max_new_tokens=args.max_tokens, sampling=sampling, on_token=lines.token)
        seconds = time.perf_counter() - started
        lines.done(GenerationResult(engine.tokenizer.decode(tokens), tokens, len(ids), seconds))
        return 0
    on_text = lambda s: (sys.stdout.write(s), sys.stdout.flush())  # noqa: E731
    engine.generate(args.prompt, raw=args.raw, max_new_tokens=args.max_tokens, sampling=sampling, on_text=on_text)
    sys.stdout.write("\n")
    return 0
