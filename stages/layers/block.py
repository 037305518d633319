"""One decoder layer, composed from its `LayerSpec`: the readable model of every family here.

    x = x + attention(rms_norm(x))
    x = x + mlp(rms_norm(x))

The attention (token mixer) and the MLP are chosen by kind (families/spec.py) from ATTENTIONS
and MLPS: a new kind is a module and a line in these tables. A family is a spec (families/),
never a copy of this file. A layer may lack one half (`LayerSpec.attention` or `.mlp` None: a
Nemotron-H layer is one mixer or one MLP), and then has neither its module nor its norm.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.spec import LayerSpec, MlpSpec, ModelSpec
from tessera.stages.layers.attention import Attention, LayerCache, StepRows
from tessera.stages.layers.dsa import SparseLatentAttention
from tessera.stages.layers.gated_deltanet import GatedDeltaNet
from tessera.stages.layers.kda import KimiDeltaAttention
from tessera.stages.layers.mamba2 import Mamba2Mixer
from tessera.stages.layers.mla import LatentAttention, LatentCache
from tessera.stages.layers.mlp import glu_mlp
from tessera.stages.layers.moe import MoE
from tessera.stages.layers.norm import RMSNorm

# kind -> constructor(hidden, its kind's spec: AttentionSpec, MlaSpec, DsaSpec, GatedDeltaNetSpec, KdaSpec or
# Mamba2Spec, rms_norm_eps)
ATTENTIONS: dict[str, Callable[[int, Any, float], nn.Module]] = {
    "gqa": Attention, "mla": LatentAttention, "dsa": SparseLatentAttention, "gated_deltanet": GatedDeltaNet,
    "kda": KimiDeltaAttention, "mamba2": Mamba2Mixer,
}
MLPS: dict[str, Callable[[int, MlpSpec], nn.Module]] = {
    "dense": glu_mlp,
    "moe": MoE,
}


class Block(nn.Module):
    """One pre-norm decoder layer of `spec`, shaped by `layer`."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        if layer.attention is not None and layer.attention.kind not in ATTENTIONS:
            raise UnsupportedModel(f"attention kind {layer.attention.kind!r} has no module in this engine")
        if layer.mlp is not None and layer.mlp.kind not in MLPS:
            raise UnsupportedModel(f"MLP kind {layer.mlp.kind!r} has no module in this engine")
        self.layer = layer
        self.attn_norm = RMSNorm(h, eps) if layer.attention is not None else None
        self.attn = ATTENTIONS[layer.attention.kind](h, layer.attention, eps) if layer.attention is not None else None
        self.mlp_norm = RMSNorm(h, eps) if layer.mlp is not None else None
        self.mlp = MLPS[layer.mlp.kind](h, layer.mlp) if layer.mlp is not None else None

    def forward(self, x: torch.Tensor, ctx: StepRows, cache: LayerCache | LatentCache) -> torch.Tensor:
        return self.with_mlp(self.with_attention(x, ctx, cache))

    # The two residual halves, also called apart: a CUDA-graph step captures the halves it can
    # (engine/compiled/cuda_graphs.py) and runs a sparse MLP's data-dependent dispatch between them.
    # `.forward` directly: nn.Module.__call__'s hook machinery costs more than the small ops of a
    # one-token step (no hooks are ever registered on these modules).
    def with_attention(self, x: torch.Tensor, ctx: StepRows, cache: LayerCache | LatentCache) -> torch.Tensor:
        if self.attn is None:
            return x
        return x + self.attn.forward(self.attn_norm.forward(x), ctx, cache)

    def with_mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp is None:
            return x
        return x + self.mlp.forward(self.mlp_norm.forward(x))


def linear_paths(block: nn.Module) -> list[str]:
    """Dotted paths of the block's weight matrices (its nn.Linear modules: what quantization
    stores as integers), e.g. "attn.wqkv", "mlp.experts.3.w_down". A router is not among them:
    it stays in float, since it picks the experts."""
    return [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]
