"""Routers: which experts each token of a sparse MLP goes to, and with what weight.

A router is a module holding its parameters (here the [E, H] logit projection, engine name
`mlp.router.weight`) whose `forward(x [T, H])` returns (weights [T, k] float32, experts [T, k]
long). ROUTERS maps a `RouterSpec.kind` (families/spec/mlp.py) to its module.

Float32 reference semantics of "softmax_topk" (Mixtral; Qwen3-MoE): p = softmax(x Wᵀ) in
float32, the k largest (torch.topk: ties to the lower index, as transformers), divided by
their sum when `renormalize`.

Float32 reference semantics of "sigmoid_group_topk" (DeepSeek-V3, GLM-4.5; transformers'
`DeepseekV3TopkRouter`): s = sigmoid(x Wᵀ) in float32; the choice is made on s + b (b the
learned correction bias, engine name `mlp.router.correction_bias`, [E]): the E experts fall
into G groups of E/G, each group scored by the sum of its two best corrected scores, every
expert outside the best `topk_groups` groups set to -inf, then the k best; each pick weighted
by its UNcorrected score s, divided by their sum (+ 1e-20) when `renormalize`, times `scale`
(`routed_scaling_factor`). With G = 1, or every group kept, the group step changes nothing and
is skipped.

Of "topk_softmax" (gpt-oss): logits = x Wᵀ + b (with `RouterSpec.bias`, engine name
`mlp.router.bias`), the k largest (torch.topk), their softmax the weights (float32).

Of "sqrtsoftplus_topk" (DeepSeek-V4; transformers' `DeepseekV4TopKRouter`): s = sqrt(softplus(x Wᵀ)),
then as "sigmoid_group_topk" with one group: the k best of s + b, weighted by s, divided by their
sum (+ 1e-20), times `scale`. A hash layer (`RouterSpec.hash_vocab`, DeepSeek-V4's
`DeepseekV4HashRouter`) takes its k experts from row `token id` of a fixed table (engine name
`mlp.router.table`, [V, k], integer) instead, weighted the same way by its scores (sigmoid or
sqrt-softplus); its forward is given the rows' token ids.

Of "normed_softmax_topk" (Gemma 4; transformers' `Gemma4TextRouter`): it reads the layer's
residual stream x, not the MLP's normed input: h = rms_norm(x) (no weight) * s * H^-1/2 (s the
learned [H] vector, engine name `mlp.router.scale`); p = softmax(h Wᵀ) in float32; the k largest
(torch.topk), divided by their sum, each times its expert's learned scale (`mlp.router.expert_scale`, [E]).

A new router is a module here with its own parameters, named in ROUTERS, with its tensors
mapped in families/tensors.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.spec.mlp import RouterSpec


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


class TopKSoftmax(nn.Module):
    """Kind "topk_softmax" (module docstring), its logits biased when `spec.bias`."""

    def __init__(self, hidden: int, num_experts: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if spec.bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias).float()  # [T, E]
        top, experts = logits.topk(self.spec.top_k, dim=-1)  # [T, k] each
        return top.softmax(-1), experts



class SigmoidGroupTopK(nn.Module):
    """Kind "sigmoid_group_topk" (module docstring). Its weight and bias are used in float32 whatever
    the stage's dtype, as the reference keeps them."""

    def __init__(self, hidden: int, num_experts: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.correction_bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.correction_bias.float()
        if spec.topk_groups < spec.num_groups:
            choice = choice.masked_fill(~kept_groups(choice, spec), float("-inf"))
        experts = choice.topk(spec.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, experts)
        if spec.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * spec.scale, experts


SCORES = {"sigmoid_group_topk": torch.sigmoid, "sqrtsoftplus_topk": lambda logits: F.softplus(logits).sqrt()}


class ScoredTopK(nn.Module):
    """Kind "sqrtsoftplus_topk", and DeepSeek-V4's sigmoid router (kind "sigmoid_group_topk", one group):
    module docstring. With `spec.hash_vocab`, a hash layer's: the experts from its table by token id."""

    def __init__(self, hidden: int, num_experts: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.score = SCORES[spec.kind]
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if spec.hash_vocab:
            self.register_buffer("table", torch.empty(spec.hash_vocab, spec.top_k, dtype=torch.long))
            self.correction_bias = None
        else:
            self.correction_bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        scores = self.score(F.linear(x.float(), self.weight.float()))  # [T, E]
        if self.correction_bias is None:
            assert token_ids is not None, "a hash layer routes by token id"
            experts = self.table[token_ids.to(self.table.device)].long()  # [T, k]
        else:
            experts = (scores + self.correction_bias.float()).topk(spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if spec.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * spec.scale, experts


class NormedSoftmaxTopK(nn.Module):
    """Kind "normed_softmax_topk" (module docstring); `eps` is its input norm's (the model's rms_norm_eps)."""

    def __init__(self, hidden: int, num_experts: int, spec: RouterSpec, eps: float = 1e-6) -> None:
        super().__init__()
        self.spec = spec
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.scale = nn.Parameter(torch.empty(hidden))
        self.expert_scale = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.rms_norm(x, (x.shape[-1],), eps=self.eps) * self.scale * x.shape[-1] ** -0.5
        probs = F.linear(h, self.weight).softmax(-1, dtype=torch.float32)  # [T, E]
        weights, experts = probs.topk(self.spec.top_k, dim=-1)  # [T, k] each
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.expert_scale[experts], experts


def kept_groups(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """[T, E] True for the experts in each token's best `topk_groups` groups, a group ranked by the
    sum of its two best corrected scores."""
    t, e = choice.shape
    grouped = choice.view(t, spec.num_groups, e // spec.num_groups)  # [T, G, E/G]
    best = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, G]
    keep = torch.zeros_like(best, dtype=torch.bool)
    keep.scatter_(1, best.topk(spec.topk_groups, dim=-1, sorted=False)[1], True)
    return keep[:, :, None].expand_as(grouped).reshape(t, e)


ROUTERS = {"softmax_topk": SoftmaxTopK, "topk_softmax": TopKSoftmax, "sigmoid_group_topk": SigmoidGroupTopK,
           "sqrtsoftplus_topk": ScoredTopK, "normed_softmax_topk": NormedSoftmaxTopK}


def build_router(hidden: int, num_experts: int, spec: RouterSpec) -> nn.Module:
    """The router module of `spec`'s kind (UnsupportedModel for a kind without one here); a hash layer's
    router is `ScoredTopK` whatever its scores."""
    router = ScoredTopK if spec.hash_vocab else ROUTERS.get(spec.kind)
    if router is None:
        raise UnsupportedModel(f"router kind {spec.kind!r} has no module in this engine ({sorted(ROUTERS)})")
    return router(hidden, num_experts, spec)
