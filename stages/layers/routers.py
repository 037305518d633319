"""Routers: which experts each token of a sparse MLP goes to, and with what weight.

A router is a module holding its parameters (here the [E, H] logit projection, engine name
`mlp.router.weight`) whose `forward(x [T, H])` returns (weights [T, k] float32, experts [T, k]
long). ROUTERS maps a `RouterSpec.kind` (families/spec.py) to its module.

Float32 reference semantics of "softmax_topk" (Mixtral; Qwen3-MoE): p = softmax(x Wᵀ) in
float32, the k largest (torch.topk: ties to the lower index, as transformers), divided by
their sum when `renormalize`.

A new router (DeepSeek-V3 / GLM: sigmoid scores plus a learned correction bias used only to
choose, top-k within the best `topk_group` of `n_group` expert groups, weights from the
uncorrected scores, renormalised and times `routed_scaling_factor`) is a module here with
its own parameters (`e_score_correction_bias`), named in ROUTERS, with its tensors mapped in
families/tensors.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.spec import RouterSpec


class SoftmaxTopK(nn.Module):
    """Kind "softmax_topk" (module docstring)."""

    def __init__(self, hidden: int, num_experts: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).float().softmax(-1)  # [T, E]
        weights, experts = probs.topk(self.spec.top_k, dim=-1)  # [T, k] each
        if self.spec.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts


ROUTERS = {"softmax_topk": SoftmaxTopK}


def build_router(hidden: int, num_experts: int, spec: RouterSpec) -> nn.Module:
    """The router module of `spec`'s kind (UnsupportedModel for a kind without one here)."""
    router = ROUTERS.get(spec.kind)
    if router is None:
        raise UnsupportedModel(f"router kind {spec.kind!r} has no module in this engine ({sorted(ROUTERS)})")
    return router(hidden, num_experts, spec)
