"""Command-line options shared by several `tessera` commands, and what they turn into.

Every `peer/cli/` module that registers a parser is imported to print `tessera --help`,
which must not wait for torch or py-libp2p (seconds, on a cold start): the parsers import
only the standard library and small modules, and what turns options into objects (a
`Quant`, `SamplingParams`, a `LinkEmulation`) imports its module when it runs.
`tests/cli/test_cli_help.py` holds the line. The choices below are the compute layer's
own (stages/kernels/quant.py), repeated so that listing them costs no torch import; the same test
checks that they agree.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.stages.errors import StageError
from tessera.stages.engine.compiled.modes import COMPILE_MODES  # torch-free, like this module

from tessera.peer.base.errors import ConfigError

if TYPE_CHECKING:
    from tessera.peer.net.emulated import LinkEmulation
    from tessera.peer.request.policy import RequesterPolicy
    from tessera.stages.kernels.quant import Quant
    from tessera.stages.decoding.sampling import SamplingParams

# stages/kernels/quant.py's QUANT_KINDS, INT4_GROUP_SIZES and DEFAULT_INT4_GROUP (see the module docstring)
QUANT_KINDS = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP = 32
DEFAULT_SPOT_CHECK_RATE = 0.05  # peer/request/verify.py's DEFAULT_SPOT_CHECKS.rate (see the module docstring)


class UsageError(StageError):
    """The command line asks for something contradictory."""


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample only from the smallest set of tokens whose probabilities add up to P (default 1: all)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample only from the K most likely tokens (default 0: no limit)")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--raw", action="store_true", help="plain continuation, no chat template")


def device_arg(text: str) -> str:
    """auto, cpu, mps, cuda or cuda:N (one card of several)."""
    kind, colon, index = text.partition(":")
    if kind not in ("auto", "cpu", "cuda", "mps") or (colon and (kind != "cuda" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"--device wants auto, cpu, cuda, cuda:N or mps, got {text!r}")
    return text


def add_compile_option(p: argparse.ArgumentParser, *, default: str, what: str) -> None:
    """--compile: whether decode steps run compiled (stages/engine/compiled/modes.py)."""
    p.add_argument("--compile", default=default, choices=COMPILE_MODES,
                   help=f"compile {what}'s decode steps: auto = torch.compile on a CPU float span, CUDA graphs "
                        f"on CUDA; once per load, at start-up, cached on disk (default {default})")


def add_compute_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", type=device_arg, metavar="{auto,cpu,cuda,cuda:N,mps}",
                   help="where to compute (default auto: CUDA, then MPS, then CPU); on CUDA the memory "
                   "offered defaults to the card's free memory less a reserve, and the dtype to bfloat16")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="the dtype the layers compute in (default auto: float32 on a CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    add_quant_options(p, help="store the layers' matrices as int8 (per output channel) or int4 (group-wise); "
                      "on a CPU a quantized span computes in float32 (exact against its dequantized "
                      "float32 model); --dtype bfloat16 uses torch's faster int kernels, not token-exact")


def add_quant_options(p: argparse.ArgumentParser, *, help: str) -> None:
    """--quant and --quant-group: the span's storage (a peer, `generate --local`) or the peers a
    requester chains (`generate --join`, `serve`), which advertise it in their model id."""
    p.add_argument("--quant", default="none", choices=QUANT_KINDS, help=help)
    p.add_argument("--quant-group", type=int, default=DEFAULT_INT4_GROUP, choices=INT4_GROUP_SIZES,
                   help=f"inputs per int4 scale (default {DEFAULT_INT4_GROUP})")


def add_accept_mixed_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept-mixed", action="store_true",
                   help="through a swarm: chain peers of any quantization (default: only peers of --quant)")


def quant_from(args: argparse.Namespace) -> "Quant":
    from tessera.stages.kernels.quant import Quant  # imports torch: only when a command runs (see the module docstring)

    return Quant(args.quant, args.quant_group)


def add_policy_options(p: argparse.ArgumentParser) -> None:
    """Who may compute the answers (peer/request/policy.py); each option repeats."""
    group = p.add_argument_group("choosing who computes (full peer ids; @FILE = one id per line)")
    group.add_argument("--allow", action="append", default=[], metavar="PEER_ID|@FILE",
                       help="use only these peers (every layer must be covered by them)")
    group.add_argument("--deny", action="append", default=[], metavar="PEER_ID|@FILE", help="never use these peers")
    group.add_argument("--prefer", action="append", default=[], metavar="PEER_ID|@FILE",
                       help="use these peers wherever they cover the layers, others only where they do not")


def policy_from(args: argparse.Namespace) -> "RequesterPolicy":
    """The RequesterPolicy the options ask for. Raises BadPeerId or ConfigError (an unreadable @FILE)."""
    from tessera.peer.request.policy import RequesterPolicy, read_peer_ids

    return RequesterPolicy(
        allow=read_peer_ids(args.allow, option="--allow") if args.allow else None,
        deny=read_peer_ids(args.deny, option="--deny"), prefer=read_peer_ids(args.prefer, option="--prefer"),
    )


def add_spot_check_option(p: argparse.ArgumentParser) -> None:
    """--spot-check RATE: the fraction of steps at which one hop is recomputed by another peer."""
    p.add_argument("--spot-check", type=float, default=None, metavar="RATE",
                   help="fraction of steps at which another peer holding the same layers recomputes one hop, to "
                        f"catch a peer returning wrong activations (default {DEFAULT_SPOT_CHECK_RATE:g}, off with "
                        "a compact --wire; 0 = off)")
    p.add_argument("--dispute-memory", type=int, default=None, metavar="MIB",
                   help="memory this requester may spend deciding a dispute between the only two peers holding some "
                        "layers, by fetching those layers' weights (checked against the manifest) and recomputing "
                        "them itself (default 2048; 0 = never: such a dispute ends the answer unless another peer "
                        "serves the layers)")


def span_weights_from(args: argparse.Namespace, folder):
    """What --dispute-memory asks for: (the requester's SpanWeights over its model `folder`, bytes)."""
    from tessera.peer.request.dispute import DISPUTE_MEMORY
    from tessera.peer.weights.on_demand import OnDemandSpans

    mib = getattr(args, "dispute_memory", None)
    if mib is not None and mib < 0:
        raise ConfigError(f"--dispute-memory must be 0 or more MiB, got {mib!r}")
    budget = DISPUTE_MEMORY if mib is None else mib << 20
    spans = OnDemandSpans(folder, out=lambda line: print(line, file=sys.stderr, flush=True)) if budget > 0 else None
    return spans, budget


def spot_check_from(args: argparse.Namespace):
    """The CheckPolicy --spot-check asks for (None: off). Raises ConfigError outside [0, 1], or
    for a rate above 0 with a compact --wire form. Not given, the default rate — but no checks
    with a compact wire form: a check compares activations at float32 tolerances, which
    bfloat16 or fp8 on the wire round far beyond (an honest peer would be judged a liar)."""
    from tessera.peer.request.ports import CheckPolicy
    from tessera.peer.request.verify import DEFAULT_SPOT_CHECKS

    rate, wire = args.spot_check, getattr(args, "wire", "")
    if rate is None:
        rate = 0.0 if wire else DEFAULT_SPOT_CHECKS.rate
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"--spot-check must lie in [0, 1] (a fraction of steps), got {rate!r}")
    if rate > 0 and wire:
        raise ConfigError(f"--spot-check needs exact activations on the wire, not --wire {wire}")
    return CheckPolicy(rate=rate, final_check=DEFAULT_SPOT_CHECKS.final_check) if rate > 0 else None


def apply_threads(threads: int | None) -> None:
    if threads:
        import torch  # only when a command runs (see the module docstring)

        torch.set_num_threads(threads)


def sampling_from(args: argparse.Namespace) -> "SamplingParams":
    from tessera.stages.decoding.sampling import SamplingParams  # imports torch: only when a command runs

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as bad:
        raise UsageError(str(bad)) from None


def read_swarm_key(value: str | None) -> bytes | None:
    """A swarm key: 64 hex characters, or a file holding them (or $TESSERA_SWARM_KEY)."""
    value = value or os.environ.get("TESSERA_SWARM_KEY")
    if not value:
        return None
    path = Path(value).expanduser()
    text = path.read_text().strip() if path.exists() else value.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError("--swarm-key wants 64 hex characters or a file holding them") from None
    if len(key) != 32:
        raise ConfigError(f"a swarm key is 32 bytes (64 hex characters), got {len(key)} bytes")
    return key


def add_join_options(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument("--join", action="append", default=[], required=required, metavar="MULTIADDR",
                   help="a peer of the swarm (repeatable)")
    p.add_argument("--swarm-key", default=None, help="private swarm key: 64 hex chars or a file (default $TESSERA_SWARM_KEY)")


def add_dedicated_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-dedicated", action="store_true",
                   help="run sessions and links as libp2p streams only, never on connections of their own "
                        "(peer/net/dedicated/; for comparison and for networks that allow only the libp2p port)")


def link_emulation(text: str) -> "LinkEmulation":
    """--emulate-link's SPEC as a LinkEmulation (peer/net/emulated.py). Raises ConfigError."""
    from tessera.peer.net.emulated import LinkEmulation  # imports trio: only when the option is given

    return LinkEmulation.parse(text)


def add_record_trace_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record-trace", type=Path, default=None, metavar="FILE",
                   help="record this requester's trace (sessions, steps, routes, failovers) in the sqlite FILE, "
                        "for `tessera trace export/plot` and `tessera replay` beside the peers' databases")


def add_emulation_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate-link", type=link_emulation, default=None, metavar="SPEC",
                   help='TESTS AND BENCHMARKS ONLY: delay/pace every frame sent, e.g. "delay=40ms,jitter=10ms,rate=100mbit"')
