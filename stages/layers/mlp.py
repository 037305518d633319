"""The dense MLP: SwiGLU, down(silu(gate(x)) * up(x)), gate and up as ONE stacked matmul.

Also each expert of a sparse MLP (layers/moe.py). The projections are called as modules, so
that a quantized span can hold `tessera.stages.weights.quant` linears in their place (same
call, integer weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """SwiGLU of `width` over a residual stream of `hidden`."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.w_gate_up = nn.Linear(hidden, 2 * width, bias=False)
        self.w_down = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        gate, up = self.w_gate_up.forward(x).split(self.width, dim=-1)  # [T, I] each
        return self.w_down.forward(F.silu(gate).mul_(up))
