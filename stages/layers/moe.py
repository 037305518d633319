"""A sparse mixture of experts: a router picks k of E SwiGLU experts per token (or experts of another
`GluSpec` activation: gpt-oss's clamped SwiGLU, Nemotron-H's ungated relu^2).

Float32 reference semantics (transformers' `...Experts.forward`): for each token, the sum over
its k picked experts of weight * expert(x), the experts added in increasing index order.

Shared experts (DeepSeek-V3, GLM-4.5; `MlpSpec.shared_width`) are one SwiGLU every token goes
through, with the experts' gated activation, added to the picked experts' sum with weight 1 — or,
with `shared_gate` (Qwen3-Next, Qwen3.5), with weight sigmoid(x · w_gate). A hash layer's router
(DeepSeek-V4) picks by token id: its forward is given the rows' ids.

Gemma 4's (`DenseAndMoE`, MLP kind "dense_and_moe") sets a dense MLP and the experts side by side,
each between its own norms: dense_out_norm(dense(norm(x))) + experts_out_norm(experts(experts_norm(x)))
with the router reading the layer's residual x itself (layers/routers.py "normed_softmax_topk").

Only the experts some token picked run, each ONCE, over the rows that picked it: the
(token, slot) pairs are sorted by expert (one argsort), and each active expert takes its rows
as one gathered matrix — one matmul per active expert, reading only that expert's weights.
A decode step of one token reads k experts, not E. In a stacked step of several sessions
(layers/attention.py's `Segment`) the rows of all sessions go through one router call and
each expert's matmul covers every session that picked it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.families.spec.mlp import MlpSpec
from tessera.stages.layers.mlp import glu_mlp
from tessera.stages.layers.norm import RMSNorm
from tessera.stages.layers.routers import NormedSoftmaxTopK, build_router


class MoE(nn.Module):
    """`spec.num_experts` SwiGLU experts of `spec.width` (each `glu_mlp`: its `spec.glu`, biased when
    `spec.bias`) and the router of `spec.router` (and the shared experts as one SwiGLU of
    `spec.shared_width`, when it has them)."""

    def __init__(self, hidden: int, spec: MlpSpec) -> None:
        super().__init__()
        assert spec.router is not None, "a sparse MLP has a router"
        self.router = build_router(hidden, spec.num_experts, spec.router)
        self.experts = nn.ModuleList(glu_mlp(hidden, spec) for _ in range(spec.num_experts))
        # the shared experts as one MLP of their summed width, of the experts' activation
        self.shared = glu_mlp(hidden, MlpSpec(spec.shared_width, glu=spec.glu)) if spec.shared_width else None
        # the shared expert's gate [1, H] (Qwen3-Next), in float as a router: not a matrix quantization stores
        self.shared_gate = nn.Parameter(torch.empty(1, hidden)) if spec.shared_gate else None
        self.hashed = bool(spec.router.hash_vocab)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; `token_ids` [T]: each row's token id, which a hash layer's router reads."""
        weights, picks = self.router.forward(x, token_ids) if self.hashed else self.router.forward(x)  # [T, k] each
        run = untraced_dispatch() if torch.compiler.is_compiling() else dispatch
        out = run(x, weights, picks, self.experts)
        if self.shared is None:
            return out
        shared = self.shared.forward(x)
        if self.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared  # [T, 1] * [T, H]
        return out + shared


class DenseAndMoE(nn.Module):
    """Gemma 4's MLP (module docstring): a dense MLP of `spec.shared_width` and `spec.num_experts` experts
    of `spec.width` (both `spec.glu`), and the four norms around them; it takes the layer's residual
    stream (it norms its inputs itself: the Block has no MLP norm for this kind)."""

    def __init__(self, hidden: int, spec: MlpSpec, eps: float) -> None:
        super().__init__()
        assert spec.router is not None and spec.shared_width, "Gemma 4's MLP has a router and a dense MLP"
        self.norm = RMSNorm(hidden, eps)  # pre_feedforward_layernorm
        self.dense = glu_mlp(hidden, replace(spec, kind="dense", width=spec.shared_width, num_experts=0, router=None,
                                             shared_width=0))
        self.dense_out_norm = RMSNorm(hidden, eps)  # post_feedforward_layernorm_1
        self.router = NormedSoftmaxTopK(hidden, spec.num_experts, spec.router, eps)
        self.experts_norm = RMSNorm(hidden, eps)  # pre_feedforward_layernorm_2
        self.experts = nn.ModuleList(glu_mlp(hidden, spec) for _ in range(spec.num_experts))
        self.experts_out_norm = RMSNorm(hidden, eps)  # post_feedforward_layernorm_2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (the residual stream) -> [T, H]."""
        dense = self.dense_out_norm.forward(self.dense.forward(self.norm.forward(x)))
        weights, picks = self.router.forward(x)  # [T, k] each
        run = untraced_dispatch() if torch.compiler.is_compiling() else dispatch
        return dense + self.experts_out_norm.forward(run(self.experts_norm.forward(x), weights, picks, self.experts))


_untraced: Callable[..., torch.Tensor] | None = None


def untraced_dispatch() -> Callable[..., torch.Tensor]:
    """`dispatch` behind torch.compiler.disable: torch.compile leaves it eager (a graph break), as it
    is data-dependent (which experts, how many rows each): traced, each new count would recompile.
    Made on first use, not at import: marking it imports torch._dynamo, a second of every peer's
    start-up that only a compiled stage needs (stages/engine/compiled/inductor.py makes it before
    it compiles, having imported dynamo anyway)."""
    global _untraced
    if _untraced is None:
        _untraced = torch.compiler.disable(dispatch)
    return _untraced


def dispatch(x: torch.Tensor, weights: torch.Tensor, picks: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """sum_j weights[t, j] * experts[picks[t, j]](x[t]) for every row t: each picked expert runs once,
    over the rows that picked it, in increasing expert order (the reference's order of addition)."""
    k = picks.shape[1]
    flat = picks.reshape(-1)  # [T k]: entry t k + j is token t's j-th pick
    order = torch.argsort(flat, stable=True)  # entries grouped by expert, tokens ascending within
    rows = order // k  # the token of each entry
    scale = weights.reshape(-1)[order].to(x.dtype)[:, None]  # [T k, 1]
    out = torch.zeros_like(x)
    at = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=len(experts)).tolist()):
        if count:
            took = rows[at : at + count]  # [n]
            out.index_add_(0, took, experts[expert].forward(x[took]) * scale[at : at + count])  # [n, H]
            at += count
    return out
