"""One decoder layer, composed from its `LayerSpec`: the readable model of every family here.

    x = x + attention(rms_norm(x))
    x = x + mlp(rms_norm(x))

or, under hyper-connections (DeepSeek-V4, `LayerSpec.hyper`: layers/hyper.py), over a residual
of n streams x [T, n, H], each block through its own connection:

    pre, post, comb = connection(x)
    x = post (x) block(rms_norm(pre . x)) + combᵀ x

And where the spec asks (Gemma 4): each half's output normed before it is added
(`LayerSpec.sandwich`), then the layer's per-layer input added (`per_layer_input`,
layers/per_layer.py), then the whole multiplied by a learned scalar (`scalar`):

    x = x + rms_norm(attention(rms_norm(x)))
    x = x + rms_norm(mlp(rms_norm(x)))           (Gemma 4's sparse MLP norms its inputs itself)
    x = (x + rms_norm(W_proj (gelu(W_gate x) * per_layer))) * scalar

The attention (token mixer) and the MLP are chosen by kind (families/spec/) from ATTENTIONS
and MLPS: a new kind is a module and a line in these tables. A family is a spec (families/),
never a copy of this file. A layer may lack one half (`LayerSpec.attention` or `.mlp` None: a
Nemotron-H layer is one mixer or one MLP), and then has neither its module nor its norm.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.layers.attention import Attention, LayerCache, StepRows
from tessera.stages.layers.compressed import CompressedAttention, CompressedCache
from tessera.stages.layers.dsa import SparseLatentAttention
from tessera.stages.layers.recurrent.gated_deltanet import GatedDeltaNet
from tessera.stages.layers.hyper import HyperConnection
from tessera.stages.layers.recurrent.kda import KimiDeltaAttention
from tessera.stages.layers.recurrent.mamba2 import Mamba2Mixer
from tessera.stages.layers.mla import LatentAttention, LatentCache
from tessera.stages.layers.mlp import glu_mlp
from tessera.stages.layers.moe import DenseAndMoE, MoE
from tessera.stages.layers.norm import RMSNorm
from tessera.stages.layers.per_layer import PerLayerGate

# kind -> constructor(hidden, its kind's spec: AttentionSpec, MlaSpec, DsaSpec, GatedDeltaNetSpec, KdaSpec,
# Mamba2Spec or CompressedAttentionSpec, rms_norm_eps)
ATTENTIONS: dict[str, Callable[[int, Any, float], nn.Module]] = {
    "gqa": Attention, "mla": LatentAttention, "dsa": SparseLatentAttention, "gated_deltanet": GatedDeltaNet,
    "kda": KimiDeltaAttention, "mamba2": Mamba2Mixer, "compressed": CompressedAttention,
}
# kind -> constructor(hidden, its MlpSpec, rms_norm_eps: for a kind that holds norms of its own)
MLPS: dict[str, Callable[[int, MlpSpec, float], nn.Module]] = {
    "dense": lambda hidden, spec, eps: glu_mlp(hidden, spec),
    "moe": lambda hidden, spec, eps: MoE(hidden, spec),
    "dense_and_moe": DenseAndMoE,
}
OWN_NORMS = ("dense_and_moe",)  # MLP kinds that norm their inputs themselves: no `mlp_norm` in the Block


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
        self.attn_out_norm = RMSNorm(h, eps) if layer.sandwich and layer.attention is not None else None
        self.mlp_norm = RMSNorm(h, eps) if layer.mlp is not None and layer.mlp.kind not in OWN_NORMS else None
        self.mlp = MLPS[layer.mlp.kind](h, layer.mlp, eps) if layer.mlp is not None else None
        self.mlp_out_norm = RMSNorm(h, eps) if layer.sandwich and layer.mlp is not None else None
        # a hash layer's router reads each row's token id (StepContext.token_ids)
        self.by_token = layer.mlp is not None and layer.mlp.router is not None and bool(layer.mlp.router.hash_vocab)
        # hyper-connections around the attention and the MLP (DeepSeek-V4): x is then [T, n, H]
        self.attn_hc = HyperConnection(h, layer.hyper, eps) if layer.hyper is not None else None
        self.mlp_hc = HyperConnection(h, layer.hyper, eps) if layer.hyper is not None else None
        self.per_layer = PerLayerGate(h, layer.per_layer_input, eps) if layer.per_layer_input else None
        self.scalar = nn.Parameter(torch.ones(1)) if layer.scalar else None

    def forward(self, x: torch.Tensor, ctx: StepRows, cache: LayerCache | LatentCache | CompressedCache,
                per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] ([T, n, H] under hyper-connections) -> the same; `per_layer` [T, P]: this layer's
        per-layer input, where it takes one."""
        x = self.with_mlp(self.with_attention(x, ctx, cache), getattr(ctx, "token_ids", None))
        if self.per_layer is not None:
            assert per_layer is not None, "a layer with a per-layer input is given it"
            x = self.per_layer.forward(x, per_layer)
        return x if self.scalar is None else x * self.scalar

    # The two residual halves, also called apart: a CUDA-graph step captures the halves it can
    # (engine/compiled/cuda_graphs.py) and runs a sparse MLP's data-dependent dispatch between them.
    # `.forward` directly: nn.Module.__call__'s hook machinery costs more than the small ops of a
    # one-token step (no hooks are ever registered on these modules).
    def with_attention(self, x: torch.Tensor, ctx: StepRows,
                       cache: LayerCache | LatentCache | CompressedCache) -> torch.Tensor:
        if self.attn is None:
            return x
        if self.attn_hc is None:
            return x + self._after(self.attn_out_norm, self.attn.forward(self.attn_norm.forward(x), ctx, cache))
        pre, post, comb = self.attn_hc.weights(x)
        out = self.attn.forward(self.attn_norm.forward(HyperConnection.collapse(x, pre)), ctx, cache)
        return HyperConnection.expand(x, self._after(self.attn_out_norm, out), post, comb)

    def with_mlp(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.mlp is None:
            return x
        if self.mlp_hc is None:
            return x + self._after(self.mlp_out_norm, self._mlp(x, token_ids))
        pre, post, comb = self.mlp_hc.weights(x)
        out = self._mlp(HyperConnection.collapse(x, pre), token_ids)
        return HyperConnection.expand(x, self._after(self.mlp_out_norm, out), post, comb)

    def _mlp(self, x: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """The MLP of x [T, H], normed first unless the MLP norms its input itself (OWN_NORMS)."""
        x = x if self.mlp_norm is None else self.mlp_norm.forward(x)
        return self.mlp.forward(x, token_ids) if self.by_token else self.mlp.forward(x)

    @staticmethod
    def _after(norm: RMSNorm | None, out: torch.Tensor) -> torch.Tensor:
        """A half's output, normed before it joins the residual where the layer says so (`sandwich`)."""
        return out if norm is None else norm.forward(out)


def linear_paths(block: nn.Module) -> list[str]:
    """Dotted paths of the block's weight matrices (its nn.Linear modules: what quantization
    stores as integers), e.g. "attn.wqkv", "mlp.experts.3.w_down". A router is not among them:
    it stays in float, since it picks the experts."""
    return [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]
