"""RMSNorm: the one norm of every family here (over the hidden state, and over each head of q
and k in Qwen3), and its gated form (Gated DeltaNet's output norm).

Qwen3-Next and Qwen3.5 store their RMSNorm weights zero-centred: they scale by 1 + w
(`ModelSpec.norm_offset`). `offset_norms` adds the offset to a loaded layer's RMSNorm weights
once, so that every norm here computes x / rms(x) * weight, one kernel, whatever the family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., size] -> x / rms(x) * weight, over the last dim."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * silu(gate), over the last dim (Gated DeltaNet's output norm; its
    weight is stored as the scale it applies, never offset). Computed in float32, then cast back,
    as the reference does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., size] -> [..., size]."""
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype) * self.weight
        return (normed * F.silu(gate.float())).to(x.dtype)


def offset_norms(module: nn.Module, offset: float) -> None:
    """Add `offset` to the weight of every RMSNorm in `module` (not a GatedRMSNorm's), as new tensors
    (a loaded weight may be a view of a read-only mapped file)."""
    if offset == 0.0:
        return
    for norm in module.modules():
        if type(norm) is RMSNorm:
            norm.weight = nn.Parameter(norm.weight.detach() + offset, requires_grad=False)
