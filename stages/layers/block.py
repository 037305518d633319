"""One decoder layer, composed from its `LayerSpec`: the readable model of every family here.

    x = x + attention(rms_norm(x))
    x = x + mlp(rms_norm(x))

or, under hyper-connections (DeepSeek-V4, `LayerSpec.hyper`: layers/hyper.py), over a residual
of n streams x [T, n, H], each block through its own connection:

    pre, post, comb = connection(x)
    x = post (x) block(rms_norm(pre . x)) + combᵀ x

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
from tessera.stages.layers.compressed import CompressedAttention, CompressedCache
from tessera.stages.layers.dsa import SparseLatentAttention
from tessera.stages.layers.gated_deltanet import GatedDeltaNet
from tessera.stages.layers.hyper import HyperConnection
from tessera.stages.layers.kda import KimiDeltaAttention
from tessera.stages.layers.mamba2 import Mamba2Mixer
from tessera.stages.layers.mla import LatentAttention, LatentCache
from tessera.stages.layers.mlp import glu_mlp
from tessera.stages.layers.moe import MoE
from tessera.stages.layers.norm import RMSNorm

# kind -> constructor(hidden, its kind's spec: AttentionSpec, MlaSpec, DsaSpec, GatedDeltaNetSpec, KdaSpec,
# Mamba2Spec or CompressedAttentionSpec, rms_norm_eps)
ATTENTIONS: dict[str, Callable[[int, Any, float], nn.Module]] = {
    "gqa": Attention, "mla": LatentAttention, "dsa": SparseLatentAttention, "gated_deltanet": GatedDeltaNet,
    "kda": KimiDeltaAttention, "mamba2": Mamba2Mixer, "compressed": CompressedAttention,
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
        # a hash layer's router reads each row's token id (StepContext.token_ids)
        self.by_token = layer.mlp is not None and layer.mlp.router is not None and bool(layer.mlp.router.hash_vocab)
        # hyper-connections around the attention and the MLP (DeepSeek-V4): x is then [T, n, H]
        self.attn_hc = HyperConnection(h, layer.hyper, eps) if layer.hyper is not None else None
        self.mlp_hc = HyperConnection(h, layer.hyper, eps) if layer.hyper is not None else None

    def forward(self, x: torch.Tensor, ctx: StepRows, cache: LayerCache | LatentCache | CompressedCache
                ) -> torch.Tensor:
        return self.with_mlp(self.with_attention(x, ctx, cache), getattr(ctx, "token_ids", None))

    # The two residual halves, also called apart: a CUDA-graph step captures the halves it can
    # (engine/compiled/cuda_graphs.py) and runs a sparse MLP's data-dependent dispatch between them.
    # `.forward` directly: nn.Module.__call__'s hook machinery costs more than the small ops of a
    # one-token step (no hooks are ever registered on these modules).
    def with_attention(self, x: torch.Tensor, ctx: StepRows,
                       cache: LayerCache | LatentCache | CompressedCache) -> torch.Tensor:
        if self.attn is None:
            return x
        if self.attn_hc is None:
            return x + self.attn.forward(self.attn_norm.forward(x), ctx, cache)
        pre, post, comb = self.attn_hc.weights(x)
        out = self.attn.forward(self.attn_norm.forward(HyperConnection.collapse(x, pre)), ctx, cache)
        return HyperConnection.expand(x, out, post, comb)

    def with_mlp(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.mlp is None:
            return x
        if self.mlp_hc is None:
            return x + self._mlp(self.mlp_norm.forward(x), token_ids)
        pre, post, comb = self.mlp_hc.weights(x)
        out = self._mlp(self.mlp_norm.forward(HyperConnection.collapse(x, pre)), token_ids)
        return HyperConnection.expand(x, out, post, comb)

    def _mlp(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        return self.mlp.forward(x, token_ids) if self.by_token else self.mlp.forward(x)


def linear_paths(block: nn.Module) -> list[str]:
    """Dotted paths of the block's weight matrices (its nn.Linear modules: what quantization
    stores as integers), e.g. "attn.wqkv", "mlp.experts.3.w_down". A router is not among them:
    it stays in float, since it picks the experts."""
    return [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]
