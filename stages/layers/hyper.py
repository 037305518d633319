"""Hyper-connections (DeepSeek-V4's manifold-constrained mHC): a residual of several streams.

Shapes: T = tokens, n = streams (`HyperSpec.streams`, `hc_mult`), H = hidden size. The residual
is [T, n, H]; the attention and the MLP still read and write one row [T, H] per token.

Float32 reference semantics (transformers' `DeepseekV4HyperConnection`, `DeepseekV4HyperHead`):

    x = rms(streams flattened to [T, n H]), without a weight (the model's rms_norm_eps), float32
    pre, post, comb = split(x Fnᵀ, [n, n, n n])                    one projection [(2 + n) n, n H]
    pre  = sigmoid(pre  s_pre  + b_pre) + eps                       [T, n]
    post = 2 sigmoid(post s_post + b_post)                          [T, n]
    comb = softmax(comb s_comb + b_comb, over the last axis) + eps  [T, n, n]
    comb = comb / (column sums + eps), then `sinkhorn_iters` - 1 times: rows, then columns
    block input = sum_s pre_s streams_s                             [T, H]
    streams' = post (x) block(block input) + combᵀ streams           [T, n, H]

(eps is `hc_eps`.) The head's connection mixes the n streams into one row by its own `pre`
(projection [n, n H], bias [n], one scale), before the final norm. The embedding enters every
stream alike: stages/layers/hop.py.

Each is a module of the layer (`HyperConnection`: `attn_hc`, `mlp_hc` of a Block) or of the
edge stage that holds the head (`HyperHead`), its parameters in float32 as the reference keeps
them (they are not matrices quantization stores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.families.spec.layer import HyperSpec


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, the mean in float32, as the reference's `UnweightedRMSNorm`."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One connection of a layer (the attention's or the MLP's): module docstring.

    fn [(2 + n) n, n H], base [(2 + n) n], scale [3] (pre, post, comb)."""

    def __init__(self, hidden: int, spec: HyperSpec, norm_eps: float) -> None:
        super().__init__()
        self.spec = spec
        self.norm_eps = norm_eps
        n = spec.streams
        self.fn = nn.Parameter(torch.empty(spec.mix_width, n * hidden))
        self.base = nn.Parameter(torch.empty(spec.mix_width))
        self.scale = nn.Parameter(torch.empty(3))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> (pre [T, n], post [T, n], comb [T, n, n]), float32."""
        n, eps = self.spec.streams, self.spec.eps
        flat = unweighted_rms(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + eps
        post = 2 * torch.sigmoid(post * post_s + post_b)
        comb = torch.softmax(comb.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.spec.sinkhorn_iters - 1):  # Sinkhorn-Knopp: towards a doubly stochastic mix
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return pre, post, comb

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The block's input: the streams [T, n, H] mixed by `pre` [T, n] -> [T, H] (float32 products, as
        the reference, back in the streams' dtype)."""
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The next residual: the block's output [T, H] spread by `post` [T, n], plus the streams mixed by
        combᵀ [T, n, n]."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The head's connection: the n streams [T, n, H] mixed into the one row [T, H] the final norm
    reads. fn [n, n H], base [n], scale [1]."""

    def __init__(self, hidden: int, spec: HyperSpec, norm_eps: float) -> None:
        super().__init__()
        self.spec = spec
        self.norm_eps = norm_eps
        n = spec.streams
        self.fn = nn.Parameter(torch.empty(n, n * hidden))
        self.base = nn.Parameter(torch.empty(n))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.spec.eps
        return HyperConnection.collapse(streams, pre)
