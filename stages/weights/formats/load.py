"""Loading a span of a checkpoint that ships quantized (fp8 blocks, MXFP4, GGUF blocks) as it ships.

The model's spec says how its matrices are stored (`ModelSpec.shipped`, families/shipped.py).
`shipped_block` builds a layer on the meta device and gives each of its linear modules
(stages/layers/block.py `linear_paths`) the stored tensors of its checkpoint matrices, read
from the memory-mapped files one matrix at a time and copied out (a view would keep the
file's neighbouring pages mapped: see stages/kernels/quant.py `quantize_block`), never widened:
the span holds what it would on disk, plus its norms and routers in the compute dtype.
`dense_tensor` gives what a span holds dense — the embedding and the head (a requester holds
them in float anyway), norms, routers, MLA's `wkv_b` parameter — dequantized, whichever form
the checkpoint stores them in.

A layout of an engine matrix (families/tensors.py: experts one tensor each, or fused) is
taken when the folder holds every stored tensor of its parts, so a gpt-oss-style fused
`experts.gate_up_proj_blocks` and per-expert `experts.7.gate_proj.weight_blocks` both load.
"""

from __future__ import annotations

import torch

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.catalog import tensors_of_layer
from tessera.stages.families.shipped import FLOAT_DTYPES, GGML_TYPES, ShippedFormat
from tessera.stages.families.tensors import Choices, Stacked
from tessera.stages.layers.block import Block, linear_paths
from tessera.stages.weights.folder import WeightFolder
from tessera.stages.kernels.fp8 import Fp8BlockLinear, check_codes, fp8_dense
from tessera.stages.kernels.ggml import ggml_rows
from tessera.stages.kernels.ggml_linear import GgmlLinear
from tessera.stages.kernels.linear import FloatLinear, RowStack, ShippedLinear
from tessera.stages.kernels.mxfp4 import Mxfp4Linear, mxfp4_dense
from tessera.stages.kernels.quant import QuantLinear, release_freed_memory


def shipped_block(weights: WeightFolder, layer: int, *, dtype: torch.dtype, device: torch.device | str) -> Block:
    """Layer `layer` of a shipped-quantized folder, its matrices as stored (module docstring).
    Raises ModelFormatError (a stored tensor missing, misshapen or of another dtype)."""
    spec = weights.spec
    shipped = spec.shipped
    assert shipped is not None, "a folder whose config names a quantization_config"
    tensors = tensors_of_layer(spec, layer)
    with torch.device("meta"):
        block = Block(spec, spec.layers[layer])
    paths = linear_paths(block)
    for path in paths:
        source = stored_layout(weights, shipped, tensors[path + ".weight"])
        bias = weights.read_stacked(weights.choose(tensors[path + ".bias"]), dtype).to(device) \
            if path + ".bias" in tensors else None
        parts = [stored_matrix(weights, shipped, source, i, device) for i in range(len(source.names))]
        module: QuantLinear = parts[0] if len(parts) == 1 else RowStack(parts, None)
        module.bias = bias
        owner, _, name = path.rpartition(".")
        setattr(block.get_submodule(owner), name, module)
    # the rest (norms, a router, MLA's wkv_b parameter) dense in the stage's dtype, dequantized if stored so
    rest = {ours: weights.choose(choices) for ours, choices in tensors.items() if ours.rpartition(".")[0] not in paths}
    block.load_state_dict({ours: dense_tensor(weights, s.names[0], s.shapes[0], dtype).to(device, copy=True)
                           for ours, s in rest.items()}, assign=True, strict=False)
    release_freed_memory()
    return block.requires_grad_(False)


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


def stored_linear(shipped: ShippedFormat, name: str, stored: dict[str, torch.Tensor], *, cols: int) -> ShippedLinear:
    """The linear module (no bias) of checkpoint matrix `name` from its stored tensors (by stored
    name: families/shipped.py `stored_tensors`), `cols` its inputs. Raises ModelFormatError (fp8 NaN codes)."""
    form = shipped.form_of(name)
    if form == "fp8":
        codes, scale_inv = stored[name], stored[name + "_scale_inv"]
        check_codes(codes, name)
        return Fp8BlockLinear(codes, scale_inv.float(), shipped.block, None)
    if form == "mxfp4":
        return Mxfp4Linear(stored[name + "_blocks"], stored[name + "_scales"], None)
    if form == "float" or GGML_TYPES[form].is_float:
        return FloatLinear(stored[name], None)
    return GgmlLinear(stored[name], GGML_TYPES[form], cols, None)


def dense_tensor(weights: WeightFolder, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` that a span holds dense (the embedding, the head, a norm, a router, MLA's wkv_b)
    dequantized to `dtype`, whichever form the checkpoint holds it in (fp8 with its scales, MXFP4
    blocks, GGUF blocks, or float): the checkpoint says which."""
    shipped = weights.spec.shipped
    assert shipped is not None, "a folder whose config names a quantization_config"
    if weights.has(name + "_scale_inv"):
        fp8 = ShippedFormat("fp8", block=shipped.block)
        stored = fp8.stored_tensors(name, shape)
        codes, scales = (weights.read_stored(n, s, d) for n, (s, d) in stored.items())
        return fp8_dense(codes, scales, shipped.block).to(dtype)
    if weights.has(name + "_blocks"):
        stored = ShippedFormat("mxfp4").stored_tensors(name, shape)
        blocks, scales = (weights.read_stored(n, s, d) for n, (s, d) in stored.items())
        return mxfp4_dense(blocks, scales).to(dtype)
    form = shipped.form_of(name) if shipped.method == "gguf" and len(shape) == 2 else "float"
    if form == "float" or GGML_TYPES[form].is_float:
        return weights.read_stored(name, shape, FLOAT_DTYPES if form == "float" else (form,)).to(dtype)
    ((stored_name, (stored_shape, dtypes)),) = shipped.stored_tensors(name, shape).items()
    return ggml_rows(weights.read_stored(stored_name, stored_shape, dtypes), GGML_TYPES[form]).to(dtype)


EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


def read_embedding(weights: WeightFolder, dtype: torch.dtype) -> torch.Tensor:
    """The embedding matrix [V, H] in `dtype`, whatever form the folder ships it in."""
    spec = weights.spec
    if spec.shipped is None:
        return weights.embedding(dtype)
    return dense_tensor(weights, EMBEDDING, (spec.vocab_size, spec.hidden_size), dtype)


def read_head(weights: WeightFolder, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(final norm weight, head matrix) in `dtype`; the embedding when the model ties them."""
    spec = weights.spec
    if spec.shipped is None:
        return weights.head(dtype)
    norm = weights.read({FINAL_NORM: (spec.hidden_size,)}, dtype)[FINAL_NORM]
    name = EMBEDDING if spec.tie_embeddings else HEAD
    return norm, dense_tensor(weights, name, (spec.vocab_size, spec.hidden_size), dtype)
