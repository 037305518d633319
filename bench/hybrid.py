"""A hybrid span (3 Gated DeltaNet layers : 1 gated full-attention layer) against a full-attention span.

Both spans are four layers of Qwen3-Next-80B-A3B's shape (hidden 2048; linear layers of 16 key /
32 value heads of 128; full attention of 16 query / 2 KV heads of 256, gated; its MoE trimmed to
`--experts` experts of 512 plus the shared one, so that it fits here), random weights (compute
does not depend on them). The hybrid span is the model's first four layers; the full span
replaces each linear layer by a gated full-attention layer of equal parameters (20 query heads:
33.6 M parameters against the linear layer's 33.7 M), so both read the same bytes of weights a
token. A session is taken to each context (1k, 8k, 32k) by filling its stores, not by computing a
32k-token prefill (decode costs what the context's length costs, whatever the values held), then
decodes `--tokens` tokens, timed; the spans alternate, so machine noise hits both alike.

State MB per session: what the session holds at that context — every KV cache's positions, and
each linear layer's fixed state as admission charges it (the recurrent matrices and convolution
windows, their checkpoints at the last two runs of steps and the inputs kept to recompute from:
families/spec/recurrent.py `RecurrentStateSpec.fixed_bytes`). The last lines, one per context:

    hybrid: context 32768: state MB per session linear 3.1 full 402.7; decode ms/token linear 21.0 full 48.2

and the goals: the hybrid's state at 32k <= 0.3x the full span's, its decode time at 32k <= 1.3x its
own at 1k.

    .venv/bin/python bench/hybrid.py [--contexts 1024 8192 32768] [--tokens 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from tessera.stages.engine.stage import Stage
from tessera.stages.families.shapes import shape_spec
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.recurrent import GatedDeltaNetSpec
from tessera.stages.layers.block import Block
from tessera.stages.layers.state import RecurrentState

SHAPE = "qwen3-next-80b-a3b"
WEIGHT_STD = 0.02


def spans(experts: int) -> tuple[ModelSpec, ModelSpec]:
    """(the hybrid span's spec, the full-attention span's of equal parameters)."""
    hybrid = shape_spec(SHAPE, layers=4, experts=experts)
    full_layer = next(layer for layer in hybrid.layers if isinstance(layer.attention, AttentionSpec))
    linear = next(layer for layer in hybrid.layers if isinstance(layer.attention, GatedDeltaNetSpec))
    h, gated = hybrid.hidden_size, full_layer.attention
    # the query heads whose gated attention has a linear layer's parameters (the closest count)
    heads = min(range(gated.num_kv_heads, 4 * gated.num_heads, gated.num_kv_heads),
                key=lambda a: abs(replace(gated, num_heads=a).param_count(h) - linear.attention.param_count(h)))
    wide = replace(full_layer, attention=replace(full_layer.attention, num_heads=heads))
    full = replace(hybrid, layers=tuple(wide if isinstance(layer.attention, GatedDeltaNetSpec) else layer
                                        for layer in hybrid.layers))
    return hybrid, full


def random_stage(spec: ModelSpec) -> Stage:
    torch.manual_seed(0)
    blocks = []
    for layer in spec.layers:
        block = Block(spec, layer)
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(torch.ones_like(p) if "norm" in name else WEIGHT_STD * torch.randn_like(p))
        blocks.append(block.requires_grad_(False))
    return Stage(spec, 0, blocks)


def fill(stage: Stage, session: str, context: int) -> None:
    """Open `session` holding `context` positions (its stores filled with values, not computed)."""
    stage.open(session, capacity=context + 64)
    cache = stage.sessions[session].cache
    cache.reserve(0, context)  # allocates every KV store to the context
    for store in cache.layers:
        if isinstance(store, RecurrentState):
            store.state.normal_(0, 0.1)
            store.position = context  # as if `context` tokens had been folded in
        else:
            store.keys.normal_()
            store.values.normal_()


def decode_ms(stage: Stage, session: str, context: int, tokens: int) -> float:
    """Median ms of a one-token step at positions context, context + 1, ..."""
    x = torch.randn(1, stage.spec.hidden_size)
    times = []
    for i in range(tokens):
        began = time.perf_counter()
        x = stage.forward(session, x, context + i)
        times.append(time.perf_counter() - began)
        x = x / x.norm() * 40  # keep the residual stream in range across random layers
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--tokens", type=int, default=8, help="decode steps timed per context and span")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two spans per context")
    parser.add_argument("--experts", type=int, default=4, help="experts kept per sparse layer")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hybrid_spec, full_spec = spans(args.experts)
    params = [sum(s.layer_param_count(i) for i in range(s.num_layers)) / 1e6 for s in (hybrid_spec, full_spec)]
    print(f"spans of 4 layers: hybrid {params[0]:.1f} M parameters, full attention {params[1]:.1f} M")
    with torch.inference_mode():
        stages = {"linear": random_stage(hybrid_spec), "full": random_stage(full_spec)}
        lines, at = [], {}
        for context in args.contexts:
            ms: dict[str, list[float]] = {name: [] for name in stages}
            mb: dict[str, float] = {}
            for _ in range(args.rounds):
                for name, stage in stages.items():
                    fill(stage, "s", context)
                    mb[name] = stage.session_bytes(context) / 2**20  # what admission charges it
                    ms[name].append(decode_ms(stage, "s", context, args.tokens))
                    stage.close("s")
            at[context] = ({n: statistics.median(v) for n, v in ms.items()}, mb)
            t, m = at[context]
            print(f"context {context}: {t}, {m}", flush=True)
            lines.append(f"hybrid: context {context}: state MB per session linear {m['linear']:.1f} full "
                         f"{m['full']:.1f}; decode ms/token linear {t['linear']:.1f} full {t['full']:.1f}")
    print("\n".join(lines))
    low, high = min(args.contexts), max(args.contexts)
    (t_low, _), (t_high, m_high) = at[low], at[high]
    print(f"hybrid: at {high}: state {m_high['linear'] / m_high['full']:.2f}x the full span's (goal <= 0.3); "
          f"decode {t_high['linear'] / t_low['linear']:.2f}x its own at {low} (goal <= 1.3; full span "
          f"{t_high['full'] / t_low['full']:.2f}x)")


if __name__ == "__main__":
    main()
