"""What quantized spans buy a volunteer: layers per memory budget, and decode speed.

1. Capacity: decoder layers that fit in a fixed budget (the peer's rule: 75% of the offer
   for weights, `peer/node_config.capacity_in_layers`, counting quantized bytes) for
   float32, int8 and int4 (group 32), as a ratio to float32 — SmolLM2 and the synthetic
   1B shape (hidden 2048, 24 layers, 16/8 heads, MLP 5632). Pure arithmetic.
2. Decode: SmolLM2 greedy decode tok/s of the whole model, float32 vs int8 and int4 spans
   as a CPU peer runs them by default (float32 activations, dequantized in chunks: exact
   against the dequantized float32 model), the same with `--dtype bfloat16` (torch's int
   kernels, fast on a CPU: `int8/bf16`, `int4/bf16`) and dense bfloat16 for context; rounds alternate so that machine noise hits all alike. For the 1B shape,
   the per-layer decode speed a peer measures and advertises (stages/engine/speed.py), each kind
   vs float32.
3. Aggregate decode tok/s of 1, 4 and 8 concurrent sessions on one peer (bench/batching.py).
4. Weights in the form they ship (bench/shipped.py): layers in the budget for FP8, MXFP4 and GGUF
   blocks against bf16, SmolLM2 and 1B-layer decode tok/s of each against float32, and a span's
   resident bytes over its on-disk bytes.

Prints the ratios last.

    .venv/bin/python bench/capacity.py [--threads 1] [--tokens 32] [--rounds 3] [--budget-gb 2] [--no-1b] [--no-shipped]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from batching import concurrent_sessions_figures  # bench/batching.py, beside this script
from shipped import decode_rate, shipped_figures  # bench/shipped.py, beside this script

from tessera.peer.node.config import KV_RESERVE_FRACTION
from tessera.stages.weights import registry
from tessera.stages.kernels.quant import NO_QUANT, Quant, layer_bytes
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.catalog import spec_from_file
from tessera.stages.engine.speed import measure_layer_throughput
from tessera.stages.assembly.stage import load_stage
from tessera.stages.weights.synth import synth_spec
from tessera.stages.text.tokenizer import Tokenizer

KINDS = [("float32", torch.float32, NO_QUANT), ("bfloat16", torch.bfloat16, NO_QUANT),
         ("int8", torch.float32, Quant("int8")), ("int4", torch.float32, Quant("int4")),
         ("int8/bf16", torch.bfloat16, Quant("int8")), ("int4/bf16", torch.bfloat16, Quant("int4"))]
SYNTH_1B = dict(hidden=2048, layers=24, heads=16, kv_heads=8, intermediate=5632)


def layers_in_budget(spec: ModelSpec, budget: int, itemsize: int, quant: Quant) -> int:
    """The peer's capacity rule without its cap at the model's depth (so ratios show)."""
    return int(budget * (1 - KV_RESERVE_FRACTION) // layer_bytes(spec, itemsize, quant))


def concurrent_sessions(args: argparse.Namespace) -> list[str]:
    """Aggregate decode tok/s of 1, 4 and 8 concurrent sessions on one peer (ratios to 1),
    each session checked exact against its solo run (bench/batching.py). Returns the lines
    to print last."""
    figures = concurrent_sessions_figures(registry.resolve(args.model), tokens=args.tokens, rounds=args.rounds)
    return [f"concurrent sessions ({where}) vs one: "
            + ", ".join(f"{n}: {ratio:.2f}x" for n, ratio in sorted(figures[f"{where} ratio"].items()) if n != 1)
            for where in ("stage", "server", "server-peer")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-gb", type=float, default=2.0)
    parser.add_argument("--no-1b", action="store_true", help="skip the synthetic 1B shape's per-layer speed")
    parser.add_argument("--no-shipped", action="store_true", help="skip the shipped forms (fp8, MXFP4, GGUF blocks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budget = int(args.budget_gb * (1 << 30))
    folder = registry.resolve(args.model)
    smol = spec_from_file(folder / "config.json")
    shapes = {"smollm2": smol, "synth-1b": synth_spec(**SYNTH_1B)}
    last: list[str] = []
    for name, spec in shapes.items():
        fits = {k: layers_in_budget(spec, budget, 4 if dt == torch.float32 else 2, q) for k, dt, q in KINDS}
        print(f"{name}: layers in {args.budget_gb:g} GB: " + ", ".join(f"{k} {v}" for k, v in fits.items()))
        last.append(f"{name} layers in budget vs float32: int8 {fits['int8'] / fits['float32']:.2f}x, "
                    f"int4 {fits['int4'] / fits['float32']:.2f}x")

    ids = Tokenizer.from_folder(folder).encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    head = load_stage(folder, start=0, end=0, embed=True, head=True)  # float32, as a requester holds it
    stages = {k: load_stage(folder, dtype=dt, quant=q) for k, dt, q in KINDS}
    for k, s in stages.items():
        decode_rate(s, head, ids, 4)  # warm-up
    rates: dict[str, list[float]] = {k: [] for k in stages}
    for r in range(args.rounds):
        for k, s in stages.items():
            rates[k].append(decode_rate(s, head, ids, args.tokens))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()) + " tok/s")
    med = {k: statistics.median(v) for k, v in rates.items()}
    last.append("smollm2 decode vs float32: " + ", ".join(f"{k} {med[k] / med['float32']:.2f}x" for k in med if k != "float32"))

    if not args.no_1b:
        spec = shapes["synth-1b"]
        per_layer = {k: measure_layer_throughput(spec, dtype=dt, quant=q, seconds=1.0) for k, dt, q in KINDS}
        print("synth-1b one layer: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in per_layer.items()))
        last.append("synth-1b layer decode vs float32: "
                    + ", ".join(f"{k} {per_layer[k] / per_layer['float32']:.2f}x" for k in per_layer if k != "float32"))

    last += concurrent_sessions(args)
    if not args.no_shipped:
        last += shipped_figures(model=args.model, tokens=args.tokens, rounds=args.rounds, budget_gb=args.budget_gb,
                                one_b=not args.no_1b)
    print(f"threads: {args.threads}, tokens per round: {args.tokens}, rounds: {args.rounds} "
          f"(int8/int4: float32 activations, the CPU default; x/bf16: --dtype bfloat16; int4 group {Quant('int4').group_size})")
    for line in last:
        print(line)


if __name__ == "__main__":
    main()
