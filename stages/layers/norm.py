"""RMSNorm: the one norm of every family here (over the hidden state, and over each head of q
and k in Qwen3)."""

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
