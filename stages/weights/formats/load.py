"""Loading a span of a checkpoint that ships quantized (fp8 blocks, MXFP4, GGUF blocks, NVFP4, INT4) as it ships.

The model's spec says how its matrices are stored (`ModelSpec.shipped`, families/shipped.py).
`shipped_matrices` gives each weight matrix of a layer (families/tensors.py `matrix_paths`) as
the linear module of its stored form (stages/kernels/stored.py), its tensors read from the
memory-mapped files one matrix at a time and copied out (a view would keep the file's
neighbouring pages mapped: see stages/weights/quantize.py `float_rest`), never widened: the
span holds what it would on disk, plus its norms and routers in the compute dtype
(`shipped_rest`); stages/assembly/ puts them into the layer's modules.
`dense_tensor` gives what a span holds dense — the embedding and the head (a requester holds
them in float anyway), norms, routers, MLA's `wkv_b` parameter — dequantized, whichever form
the checkpoint stores them in.

A layout of an engine matrix (families/tensors.py: experts one tensor each, or fused) is
taken when the folder holds every stored tensor of its parts, so a gpt-oss-style fused
`experts.gate_up_proj_blocks` and per-expert `experts.7.gate_proj.weight_blocks` both load.
"""

from __future__ import annotations

from typing import Iterator

import torch

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.catalog import layer_matrices, tensors_of_layer
from tessera.stages.families.shipped import FLOAT_DTYPES, GGML_TYPES, ShippedFormat
from tessera.stages.families.tensors import (
    HEAD_MIX, INTEGER_TENSORS, PER_LAYER_TENSORS, Choices, Stacked, edge_tensors, embedding_name, final_norm_name,
    per_layer_tensors,
)
from tessera.stages.kernels.fp8 import fp8_dense
from tessera.stages.kernels.ggml.blocks import ggml_rows
from tessera.stages.kernels.linear import RowStack, ShippedLinear
from tessera.stages.kernels.mxfp4 import mxfp4_dense
from tessera.stages.kernels.quant import QuantLinear
from tessera.stages.kernels.stored import stored_linear
from tessera.stages.weights.folder import WeightFolder


def shipped_matrices(weights: WeightFolder, layer: int, *, dtype: torch.dtype, device: torch.device | str
                     ) -> Iterator[tuple[str, QuantLinear]]:
    """(path, linear module) for each weight matrix of layer `layer` of a shipped-quantized folder, as
    stored (module docstring), each with its bias in `dtype`. Raises ModelFormatError (a stored tensor
    missing, misshapen or of another dtype)."""
    spec = weights.spec
    shipped = spec.shipped
    assert shipped is not None, "a folder whose config names a quantization_config"
    tensors = tensors_of_layer(spec, layer)
    for path in layer_matrices(spec, layer):
        source = stored_layout(weights, shipped, tensors[path + ".weight"])
        bias = weights.read_stacked(weights.choose(tensors[path + ".bias"]), dtype).to(device) \
            if path + ".bias" in tensors else None
        parts = [stored_matrix(weights, shipped, source, i, device) for i in range(len(source.names))]
        module: QuantLinear = parts[0] if len(parts) == 1 else RowStack(parts, None)
        module.bias = bias
        yield path, module


def shipped_rest(weights: WeightFolder, layer: int, dtype: torch.dtype, device: torch.device | str
                 ) -> dict[str, torch.Tensor]:
    """Layer `layer`'s tensors outside its matrices (norms, a router, MLA's wkv_b parameter) dense in
    `dtype` by engine name, dequantized where the checkpoint stores them so (copies, never views)."""
    spec = weights.spec
    paths = set(layer_matrices(spec, layer))
    rest = {ours: weights.choose(choices) for ours, choices in tensors_of_layer(spec, layer).items()
            if ours.rpartition(".")[0] not in paths}
    integers = weights.read({s.names[0]: s.shapes[0] for ours, s in rest.items() if ours in INTEGER_TENSORS}, dtype)
    return {ours: (integers[s.names[0]] if ours in INTEGER_TENSORS else dense_tensor(weights, s.names[0], s.shapes[0], dtype)
                   ).to(device, copy=True) for ours, s in rest.items()}


def stored_layout(weights: WeightFolder, shipped: ShippedFormat, choices: Choices) -> Stacked:
    """The first layout of an engine matrix whose stored tensors the folder holds completely."""
    for source in choices:
        if all(weights.has(stored) for i, name in enumerate(source.names)
               for stored in shipped.stored_tensors(name, source.shapes[i])):
            return source
    first = choices[0]
    wanted = [s for i, n in enumerate(first.names) for s in shipped.stored_tensors(n, first.shapes[i])]
    missing = next(s for s in wanted if not weights.has(s))
    raise ModelFormatError(f"tensor {missing!r} ({shipped.method}) is missing from {str(weights.folder)!r}")


def stored_matrix(weights: WeightFolder, shipped: ShippedFormat, source: Stacked, i: int,
                  device: torch.device | str) -> ShippedLinear:
    """Part i of `source` as its stored form's linear module (no bias; copies of the stored tensors)."""
    name, index = source.names[i], source.index
    stored = shipped.stored_tensors(name, source.shapes[i])
    lead = 0 if index is None else 1  # a fused tensor's expert dimension, taken by `index`
    read = {n: weights.read_stored(n, shape, dtypes, index=index).to(device, copy=True)
            for n, (shape, dtypes) in stored.items()}
    return stored_linear(shipped, name, read, cols=source.shapes[i][lead + 1])


def dense_tensor(weights: WeightFolder, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` that a span holds dense (the embedding, the head, a norm, a router, MLA's wkv_b)
    dequantized to `dtype`, whichever form the checkpoint holds it in (fp8 with its scales, MXFP4
    blocks, GGUF blocks, or float): the checkpoint says which."""
    shipped = weights.spec.shipped
    assert shipped is not None, "a folder whose config names a quantization_config"
    name = weights.stored_name(name)  # an edge tensor may be held under its family's alias (DeepSeek-V4's head.weight)
    if weights.has(name + "_scale_inv"):
        fp8 = ShippedFormat("fp8", block=shipped.block)
        stored = fp8.stored_tensors(name, shape)
        codes, scales = (weights.read_stored(n, s, d) for n, (s, d) in stored.items())
        return fp8_dense(codes, scales, shipped.block).to(dtype)
    if weights.has(name + "_blocks"):
        stored = ShippedFormat("mxfp4").stored_tensors(name, shape)
        blocks, scales = (weights.read_stored(n, s, d) for n, (s, d) in stored.items())
        return mxfp4_dense(blocks, scales).to(dtype)
    if shipped.method in ("nvfp4", "int4") and len(shape) == 2 and shipped.form_of(name) != "float":
        stored = shipped.stored_tensors(name, shape)
        read = {n: weights.read_stored(n, s, d) for n, (s, d) in stored.items()}
        return stored_linear(shipped, name, read, cols=shape[1]).dequantized().to(dtype)
    form = shipped.form_of(name) if shipped.method == "gguf" and len(shape) == 2 else "float"
    if form == "float" or GGML_TYPES[form].is_float:
        return weights.read_stored(name, shape, FLOAT_DTYPES if form == "float" else (form,)).to(dtype)
    ((stored_name, (stored_shape, dtypes)),) = shipped.stored_tensors(name, shape).items()
    return ggml_rows(weights.read_stored(stored_name, stored_shape, dtypes), GGML_TYPES[form]).to(dtype)


HEAD = "lm_head.weight"


def read_embedding(weights: WeightFolder, dtype: torch.dtype) -> torch.Tensor:
    """The embedding matrix [V, H] in `dtype`, whatever form the folder ships it in."""
    spec = weights.spec
    if spec.shipped is None:
        return weights.embedding(dtype)
    return dense_tensor(weights, embedding_name(spec), (spec.vocab_size, spec.hidden_size), dtype)


def read_per_layer(weights: WeightFolder, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The per-layer input table, projection and norm (Gemma 4's PLE: families/tensors.py
    `per_layer_tensors`) in `dtype` by engine name (layers/per_layer.py), whatever form the folder
    ships them in; empty where the layers take no per-layer inputs."""
    spec = weights.spec
    ours = {spec.prefix + name: ours for ours, name in PER_LAYER_TENSORS.items()}
    shapes = per_layer_tensors(spec)
    if spec.shipped is None:
        return {ours[name]: t for name, t in weights.read(shapes, dtype).items()}
    return {ours[name]: dense_tensor(weights, name, shape, dtype) for name, shape in shapes.items()}


def read_head(weights: WeightFolder, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(final norm weight, head matrix) in `dtype`; the embedding when the model ties them."""
    spec = weights.spec
    if spec.shipped is None:
        return weights.head(dtype)
    norm = weights.read({final_norm_name(spec): (spec.hidden_size,)}, dtype)[final_norm_name(spec)]
    name = embedding_name(spec) if spec.tie_embeddings else HEAD
    return norm, dense_tensor(weights, name, (spec.vocab_size, spec.hidden_size), dtype)


def read_head_mix(weights: WeightFolder, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's hyper-connection (DeepSeek-V4: `fn`, `base`, `scale`, layers/hyper.py `HyperHead`) in
    `dtype`, by engine name; float in every form a checkpoint ships, as its norms are."""
    shapes = edge_tensors(weights.spec)
    read = weights.read({name: shapes[name] for name in HEAD_MIX.values()}, dtype)
    return {ours: read[name] for ours, name in HEAD_MIX.items()}
