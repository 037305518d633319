"""A block's decode form: the same modules and parameters, with one-row products inductor streams well.

Measured on this machine's CPU (AMD EPYC, AVX-512, one thread, float32, weights in huge pages):
torch's matmul for one row through a [N, K] weight moves 9-14 GB/s for K = 576-1536 (MKL's
GEMV takes short rows poorly here), and 6-10 GB/s for 2-8 rows; the same product written as
a reduction, `(x[:, None, :] * W).sum(-1)`, which inductor turns into one vectorised loop
over W's rows, moves 17-23 GB/s for one row, 14-15 for two and 11 for four, and no more than
the matmul at eight. So under torch.compile a `RowLinear` multiplies up to
ROW_REDUCTION_ROWS rows that way; more rows, and every eager call, take F.linear as before.

`decode_form(block)` is a shallow copy of the block's module tree whose nn.Linear modules are
RowLinear: no weight is copied (the parameters are the block's own), and the eager path
keeps running the block itself.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

ROW_REDUCTION_ROWS = 4  # rows up to which the reduction beats torch's matmul (module docstring)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] @ weight [N, K]ᵀ (+ bias) -> [R, N]; as a reduction under torch.compile for few rows."""
    if torch.compiler.is_compiling() and x.shape[0] <= ROW_REDUCTION_ROWS:
        y = (x[:, None, :] * weight).sum(-1)  # [R, N], summed over K in one pass over each row of W
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class RowLinear(nn.Linear):
    """nn.Linear whose product goes through `rows_linear` (made by `decode_form`, never built)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_linear(x, self.weight, self.bias)


def decode_form(module: nn.Module) -> nn.Module:
    """A copy of `module`'s tree sharing every parameter and buffer, each plain nn.Linear a RowLinear."""
    form = copy.copy(module)  # shares _parameters and _buffers: the same tensors
    form._modules = {name: None if child is None else decode_form(child) for name, child in module._modules.items()}
    if type(module) is nn.Linear:
        form.__class__ = RowLinear
    return form
