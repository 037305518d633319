"""A float folder's layer read with its matrices quantized as they are read (`--quant int8 / int4`).

`quantized_matrices` reads the layer's weight matrices (families/tensors.py `matrix_paths`) ONE
at a time and hands each out as a linear module stored as the `Quant` asks (stages/kernels/quant.py
`quantize_linear`): the float copy of a stacked matrix is dropped once quantized, so loading a span
never holds more float weights than its largest matrix (gate/up: 2 I x H). With a source GGUF
beside the folder (stages/weights/gguf_blocks.py, where `takes_gguf_blocks`), a matrix whose
blocks are Q4_1 there is taken as it is, with no float copy at all. `float_rest` reads what a
quantized layer keeps in float (norms, biases of no matrix, a router, MLA's wkv_b, an indexer).
Putting them into a layer's modules is stages/assembly/'s.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from tessera.stages.families.catalog import layer_matrices, tensors_of_layer
from tessera.stages.kernels.quant import Int4BlockLinear, Quant, quantize_linear
from tessera.stages.weights.folder import WeightFolder
from tessera.stages.weights.gguf_blocks import GgufQ4Source, takes_gguf_blocks


def quantized_matrices(weights: WeightFolder, layer: int, quant: Quant, *, dtype: torch.dtype,
                       device: torch.device | str, gguf: GgufQ4Source | None = None
                       ) -> Iterator[tuple[str, nn.Module]]:
    """(path, linear module) for each weight matrix of layer `layer`, read and quantized one at a
    time (module docstring), each with its bias. Raises ModelFormatError, QuantError."""
    spec = weights.spec
    tensors = tensors_of_layer(spec, layer)
    as_is = gguf if gguf is not None and takes_gguf_blocks(quant, device, dtype) else None
    for path in layer_matrices(spec, layer):
        source = weights.choose(tensors[path + ".weight"])
        bias = weights.read_stacked(weights.choose(tensors[path + ".bias"]), torch.float32) \
            if path + ".bias" in tensors else None
        blocks = as_is.matrix(list(source.names), dict(zip(source.names, source.shapes))) \
            if as_is is not None and source.index is None else None
        if blocks is not None:
            nibbles, scales, mins = blocks
            module: nn.Module = Int4BlockLinear(nibbles, scales, mins, None if bias is None else bias.to(dtype))
        else:
            weight = weights.read_stacked(source, torch.float32)
            module = quantize_linear(weight, bias, quant, dtype=dtype, device=device)
            del weight
        del bias, blocks
        yield path, module


def float_rest(weights: WeightFolder, layer: int, dtype: torch.dtype, device: torch.device | str
               ) -> dict[str, torch.Tensor]:
    """Layer `layer`'s tensors outside its matrices (norms, a router, a convolution...) in `dtype`, by
    engine name: most one tensor of the checkpoint, read together; one stacked from several (KDA's
    convolution, published as q's, k's and v's) read part by part."""
    spec = weights.spec
    paths = set(layer_matrices(spec, layer))
    rest = {ours: weights.choose(choices) for ours, choices in tensors_of_layer(spec, layer).items()
            if ours.rpartition(".")[0] not in paths}
    whole = {ours: s for ours, s in rest.items() if len(s.names) == 1 and s.index is None}
    read = weights.read({s.names[0]: s.shapes[0] for s in whole.values()}, dtype)
    # Copies, not views of the memory-mapped file: a view keeps the whole file mapped, and the page
    # cache maps a 2 KiB norm's neighbours in with it (large folios: 128 KiB to 4 MiB each), which
    # held a quantized span 23.6 MiB of float weights it does not use once the file had been read whole.
    out = {ours: read[s.names[0]].to(device, copy=True) for ours, s in whole.items()}
    out.update({ours: weights.read_stacked(s, dtype).to(device) for ours, s in rest.items() if ours not in whole})
    return out
