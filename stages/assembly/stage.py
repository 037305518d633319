"""A `Stage` from a model folder: layers [start, end) and, when asked, the embedding and the head.

The runtime (stages/engine/) runs a Stage over the `Block`s it is given and knows nothing of
files; the weights (stages/weights/) read a folder and know nothing of modules. `load_stage`
joins them: it reads the folder's spec, builds each layer of the span (stages/assembly/blocks.py:
float, quantized as read, or as the checkpoint ships it) and the edges (with the embedding, Gemma
4's per-layer input table: `per_layer_inputs`), and hands them to a Stage. It reads only the
span's tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.stages.assembly.blocks import float_block, quantized_block, shipped_block
from tessera.stages.engine.residency import settled
from tessera.stages.engine.stage import Stage
from tessera.stages.errors import SpanError
from tessera.stages.kernels.quant import NO_QUANT, Quant, check_quant_for
from tessera.stages.layers.hyper import HyperHead
from tessera.stages.layers.norm import offset_norms
from tessera.stages.layers.per_layer import PerLayerInputs
from tessera.stages.weights.folder import TensorCheck, WeightFolder
from tessera.stages.weights.formats.load import read_embedding, read_head, read_head_mix, read_per_layer
from tessera.stages.weights.gguf_blocks import GgufQ4Source, takes_gguf_blocks


def load_stage(
    folder: Path,
    *,
    start: int = 0,
    end: int | None = None,
    embed: bool = False,
    head: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quant: Quant = NO_QUANT,
    check: TensorCheck | None = None,
) -> Stage:
    """Load layers [start, end) (and the embedding / head if asked) — and nothing else.

    With `quant`, each matrix is quantized as it is read (the embedding and head stay in `dtype`);
    an int4 float32 CPU span takes the Q4_1 blocks of the folder's source GGUF as they are
    (stages/weights/gguf_blocks.py). A folder that ships quantized (fp8 blocks, MXFP4, GGUF blocks:
    `spec.shipped`) keeps its matrices as stored (stages/kernels/). `check` is handed every tensor
    read from the safetensors files, as stored, and may raise to refuse it (a peer's manifest
    check). Raises ModelFormatError, SpanError, QuantError, and whatever `check` raises.
    """
    weights = WeightFolder(folder, check=check)  # `check` sees every tensor read (stages/weights/folder.py)
    spec = weights.spec
    check_quant_for(spec, quant)
    end = spec.num_layers if end is None else end
    if not 0 <= start <= end <= spec.num_layers:
        raise SpanError(f"span [{start}, {end}) is outside the model's [0, {spec.num_layers})")
    spec.check_span_start(start, end)
    # a fetched model's source GGUF, whose Q4_1 blocks an int4 span takes as they are
    gguf = GgufQ4Source.beside(folder, spec) if takes_gguf_blocks(quant, device, dtype) and end > start else None
    blocks = []
    for layer in range(start, end):
        if spec.shipped is not None:
            blocks.append(shipped_block(weights, layer, dtype=dtype, device=device))
        elif quant.active:
            blocks.append(quantized_block(weights, layer, quant, dtype=dtype, device=device, gguf=gguf))
        else:
            blocks.append(float_block(weights, layer, dtype=dtype, device=device))
    for block in blocks:  # zero-centred norms (Qwen3-Next, Qwen3.5) scale by 1 + w: once, here
        offset_norms(block, spec.norm_offset)
    embedding = read_embedding(weights, dtype).to(device) if embed else None
    per_layer = per_layer_inputs(weights, dtype, device) if embed and spec.per_layer_width else None
    norm = head_weight = head_mix = None
    if head:
        norm, head_weight = (t.to(device) for t in read_head(weights, dtype))
        norm = norm + spec.norm_offset if spec.norm_offset else norm
        if embedding is not None and spec.tie_embeddings:
            head_weight = embedding  # one copy of a tied matrix
        if spec.hyper is not None:  # the streams mixed into one before the final norm (DeepSeek-V4)
            with torch.device("meta"):
                head_mix = HyperHead(spec.hidden_size, spec.hyper, spec.rms_norm_eps)
            mix = {k: v.to(device) for k, v in read_head_mix(weights, dtype).items()}
            head_mix.load_state_dict(mix, assign=True, strict=True)
            head_mix.requires_grad_(False)
    if torch.device(device).type == "cpu":  # the edges in huge pages too: the head is a step's largest matrix
        tied = head_weight is not None and head_weight is embedding
        embedding, head_weight = (None if t is None else settled([t])[0]
                                  for t in (embedding, None if tied else head_weight))
        head_weight = embedding if tied else head_weight
    return Stage(spec, start, blocks, embedding=embedding, norm=norm, head=head_weight, per_layer=per_layer,
                 device=device, dtype=dtype, quant=quant, head_mix=head_mix)


def per_layer_inputs(weights: WeightFolder, dtype: torch.dtype, device: torch.device | str) -> PerLayerInputs:
    """The module that computes every layer's per-layer input (Gemma 4), filled from `weights`."""
    spec = weights.spec
    with torch.device("meta"):
        module = PerLayerInputs(spec.per_layer_vocab, spec.hidden_size, spec.num_layers, spec.per_layer_width,
                                spec.rms_norm_eps)
    state = {name: t.to(device) for name, t in read_per_layer(weights, dtype).items()}
    module.load_state_dict(state, assign=True, strict=True)
    return module.requires_grad_(False)
