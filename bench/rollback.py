"""Speculative rollback through a recurrent state: a checkpoint per position, or a checkpoint per step and recompute.

A KV cache goes back to position p by moving its pointer. A Gated DeltaNet layer's state
(a matrix per value head, and a convolution window) cannot be cut back: a verified block of
T = K + 1 tokens [last, d1..dK] at [p, p + T) that keeps `kept` drafts must leave the state at
p + kept + 1. Two ways, measured side by side on one layer's token mixer (the projections and
the MLP are the same work either way and are left out):

  per-position: run the block token by token (the recurrent form) and keep the state after
                every token; going back is picking one. Memory: T states per block in flight.
  recompute:    (what layers/state.py does) keep the state at the start of a run of short
                steps (no copy: the layer makes new state tensors) and the run's per-token
                inputs; going back restores it and folds the kept tokens' inputs in again
                before the next block. Memory: one state per kept run and its input rows.

For each, at the tiny test shape and at a Qwen3-Next-80B / Qwen3.5 layer's (hidden 2048,
16 key and 32 value heads of 128, kernel 4), per block: ms of the token mixer's work (drafts
accepted as in a stream where half the blocks are kept whole and half cut after one draft),
and MB of state a session holds for it. Printed last, one line per shape:

    rollback: shape qwen3-next: per-position 9.1 ms/block 12.6 MB; recompute 6.2 ms/block 6.1 MB

    .venv/bin/python bench/rollback.py [--blocks 40] [--k 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.stages.families.spec.recurrent import GatedDeltaNetSpec
from tessera.stages.layers.recurrent.gated_deltanet import GatedDeltaNet
from tessera.stages.layers.state import RecurrentState

SHAPES = {
    "tiny": (64, GatedDeltaNetSpec(2, 4, 8, 8, 4)),  # the family tests' layer
    "qwen3-next": (2048, GatedDeltaNetSpec(16, 32, 128, 128, 4)),  # Qwen3-Next-80B-A3B's and Qwen3.5's linear layers
}


def layer(hidden: int, spec: GatedDeltaNetSpec) -> GatedDeltaNet:
    torch.manual_seed(0)
    module = GatedDeltaNet(hidden, spec, 1e-6)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.02 * torch.randn_like(p))
        module.out_norm.weight.fill_(1.0)
    return module.requires_grad_(False)


def blocks(n: int, k: int) -> list[int]:
    """Drafts kept per block: every other block whole, the others cut after one draft."""
    return [k if i % 2 else 1 for i in range(n)]


def per_position(module: GatedDeltaNet, inputs: list[torch.Tensor], kept: list[int]) -> tuple[float, int]:
    """Seconds for the blocks, and the most state bytes held at once (T + 1 states per block)."""
    state = torch.zeros(module.spec.num_value_heads, module.spec.key_dim, module.spec.value_dim)
    window = torch.zeros(module.spec.conv_kernel - 1, module.spec.conv_channels)
    held, began = 0, time.perf_counter()
    for rows, keep in zip(inputs, kept):
        states = [(state, window)]
        for t in range(rows.shape[0]):  # token by token, every state kept
            _, state, window = module.fold(rows[t : t + 1], state, window)
            states.append((state, window))
        held = max(held, sum(s.nbytes + w.nbytes for s, w in states))
        state, window = states[keep + 1]  # back to the accepted position: pick it
    return time.perf_counter() - began, held


def recompute(module: GatedDeltaNet, inputs: list[torch.Tensor], kept: list[int], cache) -> tuple[float, int]:
    """Seconds for the blocks through the store's checkpoint and recompute, and its most bytes."""
    store = RecurrentState(cache, dtype=torch.float32, device="cpu")
    held, began = 0, time.perf_counter()
    for rows, keep in zip(inputs, kept):
        start = store.position
        module.step(rows, store)  # folds in whatever the last rewind left pending first
        held = max(held, store.nbytes)
        store.rewind(start + keep + 1)
    return time.perf_counter() - began, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--k", type=int, default=4, help="drafts per block (a block is K + 1 tokens)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = []
    with torch.inference_mode():
        for name, (hidden, spec) in SHAPES.items():
            module = layer(hidden, spec)
            torch.manual_seed(1)
            inputs = [torch.randn(args.k + 1, spec.cache.replay_width) for _ in range(args.blocks)]
            kept = blocks(args.blocks, args.k)
            times: dict[str, list[float]] = {"per-position": [], "recompute": []}
            held: dict[str, int] = {}
            for _ in range(args.rounds):  # alternated, so that machine noise hits both alike
                seconds, held["per-position"] = per_position(module, inputs, kept)
                times["per-position"].append(seconds)
                seconds, held["recompute"] = recompute(module, inputs, kept, spec.cache)
                times["recompute"].append(seconds)
            ms = {how: 1000 * statistics.median(t) / args.blocks for how, t in times.items()}
            print(f"{name}: {ms} ms/block, {held} bytes")
            lines.append(f"rollback: shape {name}: per-position {ms['per-position']:.2f} ms/block "
                         f"{held['per-position'] / 2**20:.2f} MB; recompute {ms['recompute']:.2f} ms/block "
                         f"{held['recompute'] / 2**20:.2f} MB")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
