"""`tessera generate`: answer a prompt, locally (`--local`) or through a swarm (`--join`)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tessera.stages import registry
from tessera.stages.errors import StageError
from tessera.stages.quant import DEFAULT_INT4_GROUP, INT4_GROUP_SIZES, QUANT_KINDS, Quant
from tessera.stages.sampling import SamplingParams


class UsageError(StageError):
    """The command line asks for something contradictory."""


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--raw", action="store_true", help="plain continuation, no chat template")


def device_arg(text: str) -> str:
    """auto, cpu, mps, cuda or cuda:N (one card of several)."""
    kind, colon, index = text.partition(":")
    if kind not in ("auto", "cpu", "cuda", "mps") or (colon and (kind != "cuda" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"--device wants auto, cpu, cuda, cuda:N or mps, got {text!r}")
    return text


def add_compute_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", type=device_arg, metavar="{auto,cpu,cuda,cuda:N,mps}",
                   help="where to compute (default auto: CUDA, then MPS, then CPU); on CUDA the memory "
                   "offered defaults to the card's free memory less a reserve, and the dtype to bfloat16")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--quant", default="none", choices=QUANT_KINDS,
                   help="store the layers' matrices as int8 (per output channel) or int4 (group-wise); "
                   "quantized spans compute in bfloat16 unless --dtype says otherwise")
    p.add_argument("--quant-group", type=int, default=DEFAULT_INT4_GROUP, choices=INT4_GROUP_SIZES,
                   help=f"inputs per int4 scale (default {DEFAULT_INT4_GROUP})")


def quant_from(args: argparse.Namespace) -> Quant:
    return Quant(args.quant, args.quant_group)


def add_policy_options(p: argparse.ArgumentParser) -> None:
    """Who may compute the answers (peer/request/policy.py); each option repeats."""
    group = p.add_argument_group("choosing who computes (full peer ids; @FILE = one id per line)")
    group.add_argument("--allow", action="append", default=[], metavar="PEER_ID|@FILE",
                       help="use only these peers (every layer must be covered by them)")
    group.add_argument("--deny", action="append", default=[], metavar="PEER_ID|@FILE", help="never use these peers")
    group.add_argument("--prefer", action="append", default=[], metavar="PEER_ID|@FILE",
                       help="use these peers wherever they cover the layers, others only where they do not")


def policy_from(args: argparse.Namespace):
    """The RequesterPolicy the options ask for. Raises BadPeerId or ConfigError (an unreadable @FILE)."""
    from tessera.peer.request.policy import RequesterPolicy, read_peer_ids

    return RequesterPolicy(
        allow=read_peer_ids(args.allow, option="--allow") if args.allow else None,
        deny=read_peer_ids(args.deny, option="--deny"), prefer=read_peer_ids(args.prefer, option="--prefer"),
    )


def apply_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as bad:
        raise UsageError(str(bad)) from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="answer a prompt locally or through a swarm",
        epilog='examples:\n  tessera generate "What is the capital of France?" --local\n'
        '  tessera generate "Hi" --join /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... --json',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt")
    p.add_argument("--local", action="store_true", help="run the whole model on this machine")
    p.add_argument("--join", action="append", default=[], metavar="MULTIADDR", help="a peer of the swarm to use")
    p.add_argument("--swarm-key", default=None, help="private swarm key: 64 hex chars or a file")
    p.add_argument("--speculate", default="none", metavar="DRAFT",
                   help="speculative decoding through a swarm: none (default), ngram, or self:N "
                   "(the model's first N layers + head, run here)")
    p.add_argument("--draft-k", type=int, default=4, help="initial draft length (adapts to acceptance)")
    p.add_argument("--no-pipeline", action="store_true", help="do not send a block before the previous one returns")
    p.add_argument("--emulate-link", default=None, metavar="SPEC",
                   help='TESTS AND BENCHMARKS ONLY: delay/pace every frame sent, e.g. "delay=40ms"')
    p.add_argument("--model", default="smollm2-135m", help="registered name or folder (default smollm2-135m)")
    p.add_argument("--accept-mixed", action="store_true",
                   help="through a swarm: chain peers of any quantization (default: only peers of --quant)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--route-wait", type=float, default=30.0, metavar="S",
                   help="how long to wait for the (allowed) peers to cover every layer (default 30)")
    add_sampling_options(p)
    add_policy_options(p)
    add_compute_options(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens!r}")
    sampling = sampling_from(args)
    if args.local == bool(args.join):
        raise UsageError("give exactly one of --local or --join MULTIADDR")
    if args.join:
        from tessera.peer.cli.swarm_generate import run_swarm_generate

        if not args.route_wait > 0:
            raise UsageError(f"--route-wait must be > 0, got {args.route_wait!r}")
        args.policy = policy_from(args)  # a bad id or an unreadable @FILE fails here, before joining

        return run_swarm_generate(args, sampling)
    if args.allow or args.deny or args.prefer:
        raise UsageError("--allow, --deny and --prefer choose peers of a swarm; they mean nothing with --local")
    from tessera.stages.generate import LocalEngine

    apply_threads(args.threads)
    engine = LocalEngine(registry.resolve(args.model), device=args.device, dtype=args.dtype, quant=quant_from(args))
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = engine.generate(
        args.prompt, raw=args.raw, max_new_tokens=args.max_tokens, sampling=sampling, on_text=on_text
    )
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        sys.stdout.write("\n")
    return 0
