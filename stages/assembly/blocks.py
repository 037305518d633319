"""A decoder layer's modules filled from a model folder: the one place where a `Block`
(stages/layers/) meets the weights as stored (stages/weights/).

The Block is built on the meta device and takes its tensors by assignment, so no memory is
spent on initial values. Three ways, by how the span holds its matrices:

- `float_block`: every tensor in the stage's dtype (the reference, and the default);
- `quantized_block`: the matrices quantized as they are read (`--quant`: stages/weights/quantize.py),
  the rest in the stage's dtype;
- `shipped_block`: the matrices as the checkpoint ships them (fp8 blocks, MXFP4, GGUF blocks:
  stages/weights/formats/load.py), the rest dequantized into the stage's dtype.

The weights name a layer's matrices from the family's tensor names (families/tensors.py
`matrix_paths`); a Block whose own linear modules are other ones is an error of the engine,
refused here before any module is left on the meta device. `dense_block` is a quantized or
shipped layer's reference: a float32 copy with its matrices dequantized.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tessera.stages.engine.residency import settle
from tessera.stages.errors import StageError
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.kernels.chunked import release_freed_memory
from tessera.stages.kernels.quant import Quant, dense_weight
from tessera.stages.layers.block import Block, linear_paths
from tessera.stages.weights.folder import WeightFolder
from tessera.stages.weights.formats.load import shipped_matrices, shipped_rest
from tessera.stages.weights.gguf_blocks import GgufQ4Source
from tessera.stages.weights.quantize import float_rest, quantized_matrices


def empty_block(spec: ModelSpec, layer: int) -> Block:
    """Layer `layer`'s Block on the meta device (no memory), for its tensors to be assigned."""
    with torch.device("meta"):
        return Block(spec, spec.layers[layer])


def float_block(weights: WeightFolder, layer: int, *, dtype: torch.dtype, device: torch.device | str) -> Block:
    """Layer `layer` of `weights`, every tensor in `dtype` on `device` (in huge pages on a CPU,
    where the OS gives them: engine/residency.py). Raises ModelFormatError."""
    block = empty_block(weights.spec, layer)
    state = {k: v.to(device) for k, v in weights.layer_state(layer, dtype).items()}
    block.load_state_dict(state, assign=True, strict=True)
    if torch.device(device).type == "cpu":
        settle(block)
    return block.requires_grad_(False)


def quantized_block(weights: WeightFolder, layer: int, quant: Quant, *, dtype: torch.dtype,
                    device: torch.device | str, gguf: GgufQ4Source | None = None) -> Block:
    """Layer `layer` of a float folder with its matrices stored as `quant`, read one matrix at a time
    (stages/weights/quantize.py; `gguf`: a source GGUF whose Q4_1 blocks an int4 span takes as they
    are). Raises ModelFormatError, QuantError."""
    block = empty_block(weights.spec, layer)
    matrices = quantized_matrices(weights, layer, quant, dtype=dtype, device=device, gguf=gguf)
    return _filled(block, matrices, float_rest(weights, layer, dtype, device))


def shipped_block(weights: WeightFolder, layer: int, *, dtype: torch.dtype, device: torch.device | str) -> Block:
    """Layer `layer` of a shipped-quantized folder, its matrices as stored. Raises ModelFormatError
    (a stored tensor missing, misshapen or of another dtype)."""
    block = empty_block(weights.spec, layer)
    return _filled(block, shipped_matrices(weights, layer, dtype=dtype, device=device),
                   shipped_rest(weights, layer, dtype, device))


def _filled(block: Block, matrices: Iterable[tuple[str, nn.Module]], rest: dict[str, torch.Tensor]) -> Block:
    """`block` with each matrix module put at its path (taken one at a time, as the weights read them)
    and the rest of its tensors assigned."""
    expected, placed = set(linear_paths(block)), set()
    for path, module in matrices:
        if path not in expected:
            raise StageError(f"the weights give a matrix at {path!r}, which this layer's modules do not have")
        owner, _, name = path.rpartition(".")
        setattr(block.get_submodule(owner), name, module)
        placed.add(path)
        del module
    if placed != expected:
        raise StageError(f"this layer's module {sorted(expected - placed)[0]!r} got no matrix from the weights")
    block.load_state_dict(rest, assign=True, strict=False)
    release_freed_memory()
    return block.requires_grad_(False)


def dense_block(block: Block, spec: ModelSpec) -> Block:
    """A float32 copy of `block` whose matrices are the dequantized ones: the reference model."""
    with torch.device("meta"):
        dense = Block(spec, block.layer)
    paths = linear_paths(dense)
    owners = tuple(path + "." for path in paths)  # a matrix's own tensors, its parts' included
    state = {name: (t.detach().float() if t.is_floating_point() else t.detach()).cpu()  # a hash table stays integer
             for name, t in block.state_dict().items() if not name.startswith(owners)}
    for path in paths:
        layer = block.get_submodule(path)
        state[path + ".weight"] = dense_weight(layer)
        if layer.bias is not None:
            state[path + ".bias"] = layer.bias.detach().float().cpu()
    dense.load_state_dict(state, assign=True, strict=True)
    return dense.requires_grad_(False)
