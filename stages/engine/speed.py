"""How fast this machine runs one decoder layer: the number a peer advertises.

Compute cost does not depend on the weights' values, so the benchmark builds one
block of the model's shape with random weights, warms it up, and times decode
steps against a short cache. The result is tokens per second through ONE layer
(a span of n layers runs a token in n / throughput seconds). Where layers differ
(Qwen3-MoE's dense and sparse ones), the layer timed is the model's most common
kind: the throughput is one number per peer, and the most common kind is what most
spans are made of. A sparse layer's random router picks random experts, as a real
one spreads tokens over them.
"""

from __future__ import annotations

import time

import torch

from collections import Counter

from tessera.stages.engine.stage import Stage
from tessera.stages.families.catalog import tensors_of_layer
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.layers.block import Block, linear_paths
from tessera.stages.kernels.encode import encoded_linear
from tessera.stages.kernels.quant import NO_QUANT, Quant, quantize_linear

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
    its matrices stored as `quant`, or as the model ships them (`spec.shipped`)."""
    gen = torch.Generator().manual_seed(0)
    layer = typical_layer(spec)
    block = Block(spec, spec.layers[layer])
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for b in block.buffers():  # a hash layer's expert table (DeepSeek-V4): experts at random
            if not b.is_floating_point():
                b.copy_(torch.randint(0, spec.layers[layer].mlp.num_experts, b.shape, generator=gen))
    block = block.to(device=device, dtype=dtype).requires_grad_(False)
    tensors = tensors_of_layer(spec, layer)
    for path in linear_paths(block) if quant.active or spec.shipped is not None else ():
        owner, _, name = path.rpartition(".")
        dense = block.get_submodule(path)
        bias = None if dense.bias is None else dense.bias.cpu()
        if spec.shipped is not None:  # the form the model ships in (stages/kernels/)
            module = encoded_linear(spec.shipped, tensors[path + ".weight"][0], dense.weight.cpu(), std=0.02, gen=gen)
            module.bias = bias
        else:
            module = quantize_linear(dense.weight.cpu(), bias, quant, dtype=dtype, device=device)
        setattr(block.get_submodule(owner), name, module.to(device))
    stage = Stage(spec, layer, [block], device=device, dtype=dtype)
    stage.open("speed", capacity=CONTEXT + WARMUP_STEPS + max_steps + 1)
    # the hop a stage takes (stages/layers/hop.py): the residual's streams, token ids where a layer reads them,
    # and every layer's per-layer inputs where the layers take them (random: a speed, not an answer)
    ids = torch.randint(0, spec.vocab_size, (CONTEXT,), generator=gen)
    per_layer = torch.randn(CONTEXT, (spec.num_layers - layer) * spec.per_layer_width, generator=gen)  # from `layer` on
    x = stage.hop.from_embedding(torch.randn(CONTEXT, spec.hidden_size, generator=gen), ids, per_layer)
    x = x.to(device=device, dtype=dtype)
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


def typical_layer(spec: ModelSpec) -> int:
    """The first layer of the model's most common kind of layer (the first kind on a tie), among
    those a span may start at (a DSA layer reusing another's selection cannot run alone)."""
    counts: Counter[LayerSpec] = Counter(spec.layers[i] for i in spec.span_starts[:-1])
    kind = max(counts, key=lambda k: (counts[k], -spec.layers.index(k)))
    return spec.layers.index(kind)
