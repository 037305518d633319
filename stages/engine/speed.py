"""How fast this machine runs one decoder layer: the number a peer advertises.

Compute cost does not depend on the weights' values, so the benchmark builds one
block of the model's shape with random weights, warms it up, and times decode
steps against a short cache. The result is tokens per second through ONE layer
(a span of n layers runs a token in n / throughput seconds).
"""

from __future__ import annotations

import time

import torch

from tessera.stages.layers.model import Block
from tessera.stages.weights.quant import BLOCK_LINEARS, NO_QUANT, Quant, quantize_linear
from tessera.stages.families.spec import ModelSpec
from tessera.stages.engine.stage import Stage

WARMUP_STEPS = 3
CONTEXT = 64  # positions already cached when the timed steps run


def measure_layer_throughput(
    spec: ModelSpec,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quant: Quant = NO_QUANT,
    seconds: float = 0.3,
    max_steps: int = 200,
) -> float:
    """Decode tokens/s through one layer of `spec` on this machine (median of timed steps),
    its matrices stored as `quant`."""
    gen = torch.Generator().manual_seed(0)
    block = Block(spec)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    block = block.to(device=device, dtype=dtype).requires_grad_(False)
    for path in BLOCK_LINEARS if quant.active else ():
        owner, name = path.split(".")
        dense = getattr(getattr(block, owner), name)
        setattr(getattr(block, owner), name, quantize_linear(
            dense.weight.cpu(), None if dense.bias is None else dense.bias.cpu(), quant, dtype=dtype, device=device))
    stage = Stage(spec, 0, [block], device=device, dtype=dtype)
    stage.open("speed", capacity=CONTEXT + WARMUP_STEPS + max_steps + 1)
    x = torch.randn(CONTEXT, spec.hidden_size, generator=gen).to(device=device, dtype=dtype)
    stage.forward("speed", x, 0)
    token = x[-1:]
    pos = CONTEXT
    for _ in range(WARMUP_STEPS):
        stage.forward("speed", token, pos)
        pos += 1
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < max_steps and (time.perf_counter() < deadline or len(times) < 5):
        started = time.perf_counter()
        stage.forward("speed", token, pos)
        times.append(time.perf_counter() - started)
        pos += 1
    times.sort()
    return 1.0 / times[len(times) // 2]
