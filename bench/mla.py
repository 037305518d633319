"""Multi-head latent attention at DeepSeek-V3's shape: decode absorbed against expanded, and its cache.

One MLA layer's attention (`tessera.stages.layers.mla.LatentAttention`) at DeepSeek-V3's sizes
(hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, rope / nope / value head dims
64 / 128 / 128, YaRN as published), float32, random weights, one thread, over a latent cache
already holding S positions. It times a decode step (1 token) and a block of 4 (speculation's
verification) through each way of attending:

    expanded: every cached position's keys and values expanded through Wkv_b, then attention
              (the reference's order of operations)
    absorbed: Wkv_b folded into the queries and the output; attention over the cached latent rows

checks that both give the same output (max |difference|, float32), prints the bytes a position
costs in the latent cache against the keys and values it stands for, and prints, last, the
ratio expanded time / absorbed time per (tokens, S) — the decode speed the absorbed form buys.
`LatentAttention` picks absorbed for such steps by itself (`absorbs`).

    .venv/bin/python bench/mla.py [--min-time 1.0] [--context 512 4096] [--heads 128]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from tessera.stages.families.spec.mla import MlaSpec
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.layers.attention import StepContext
from tessera.stages.layers.cache import LatentRows
from tessera.stages.layers.mla import LatentAttention
from tessera.stages.layers.rope import Rotary

HIDDEN = 7168
YARN = RopeSpec("yarn", 10000.0, (("beta_fast", 32), ("beta_slow", 1), ("factor", 40), ("mscale", 1.0),
                                  ("mscale_all_dim", 1.0), ("original_max_position_embeddings", 4096)))


def deepseek_v3_attention(heads: int) -> MlaSpec:
    return MlaSpec(heads, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   q_lora_rank=1536, rope=YARN, rope_interleave=True)


def median_time(fn: Callable[[], object], *, min_time: float, min_reps: int = 3) -> float:
    fn()  # warm-up
    times: list[float] = []
    while len(times) < min_reps or sum(times) < min_time:
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def layer(spec: MlaSpec) -> LatentAttention:
    with torch.device("meta"):
        attention = LatentAttention(HIDDEN, spec, 1e-6)
    attention = attention.to_empty(device="cpu").train(False)
    with torch.no_grad():
        for name, p in attention.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                bound = 1.0 / math.sqrt(p.shape[-1])
                p.uniform_(-bound, bound)
    return attention


def step_time(attention: LatentAttention, context: int, tokens: int, path: str, *,
              min_time: float) -> tuple[float, torch.Tensor]:
    """Seconds one step of `tokens` takes after `context` cached positions, and its output."""
    spec = attention.spec
    rows = LatentRows(spec.cache, context + tokens, dtype=torch.float32, device="cpu")
    rows.rows[:context].normal_(generator=torch.Generator().manual_seed(context))  # the same cache for both ways
    positions = torch.arange(context, context + tokens)
    ctx = StepContext(context, {(spec.rope, spec.rope_dim): Rotary(spec.rope, spec.rope_dim).cos_sin(positions)},
                      torch.device("cpu"))
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    attention.path = path

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return attention(x, ctx, rows)  # writes its own positions again each time: a rollback

    return median_time(run, min_time=min_time), run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--min-time", type=float, default=1.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    spec = deepseek_v3_attention(args.heads)
    attention = layer(spec)
    latent = spec.cache.bytes_per_position(2)
    expanded = spec.num_heads * (spec.qk_head_dim + spec.v_head_dim) * 2
    print(f"cache per position and layer (bf16): latent {latent} B, as keys and values {expanded} B "
          f"({expanded / latent:.0f}x)")
    ratios = []
    for tokens in args.tokens:
        for context in args.context:
            slow, want = step_time(attention, context, tokens, "expanded", min_time=args.min_time)
            fast, got = step_time(attention, context, tokens, "absorbed", min_time=args.min_time)
            print(f"tokens {tokens:2d}  S {context:5d}: expanded {slow * 1e3:8.2f} ms  absorbed {fast * 1e3:8.2f} ms  "
                  f"max |diff| {float((want - got).abs().max()):.2g}")
            ratios.append((tokens, context, slow / fast))
    print(f"one thread, {spec.num_heads} heads, float32")
    for tokens, context, ratio in ratios:
        print(f"expanded / absorbed, {tokens} token(s) at S={context}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
