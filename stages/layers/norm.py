"""RMSNorm: the one norm of every family here (over the hidden state, and over each head of q
and k in Qwen3), and its gated forms: Gated DeltaNet's output norm (silu gate), Kimi Delta
Attention's (sigmoid gate), Mamba2's (silu gate first, then an RMSNorm per group).

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


class SigmoidGatedRMSNorm(nn.Module):
    """rms_norm(x) * weight * sigmoid(gate), over the last dim, all in float32, then cast back (Kimi
    Delta Attention's output norm, as its reference computes it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., size] -> [..., size]."""
        normed = F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps)
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)


class GroupGatedRMSNorm(nn.Module):
    """Mamba2's gated norm (Nemotron-H): x * silu(gate) first, then an RMSNorm over each of `groups`
    equal groups of the last dim, times the weight; in float32 until the weight, as the reference."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.eps, self.groups = eps, groups
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [T, size] -> [T, size]."""
        gated = x.float() * F.silu(gate.float())
        grouped = gated.view(*x.shape[:-1], self.groups, x.shape[-1] // self.groups)
        normed = F.rms_norm(grouped, grouped.shape[-1:], eps=self.eps).view(x.shape)
        return self.weight * normed.to(x.dtype)


def offset_norms(module: nn.Module, offset: float) -> None:
    """Add `offset` to the weight of every RMSNorm in `module` (not a GatedRMSNorm's), as new tensors
    (a loaded weight may be a view of a read-only mapped file)."""
    if offset == 0.0:
        return
    for norm in module.modules():
        if type(norm) is RMSNorm:
            norm.weight = nn.Parameter(norm.weight.detach() + offset, requires_grad=False)
