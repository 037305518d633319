"""The short causal convolution a recurrent layer runs before its recurrence (Gated DeltaNet, KDA,
Mamba2), over a session's window of its last inputs.

A depthwise convolution of kernel Kc over each channel reads the Kc - 1 inputs before a row:
for the first rows of a step those are the session's window (layers/state.py keeps it, [Kc - 1, C],
zeros at position 0), so a step of any length, alone or after others, computes what one
convolution over the whole history would (the reference's `causal_conv1d_fn` with its left
padding, or `causal_conv1d_update` over its cached window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(window: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of `rows` [T, C] after `window` [Kc - 1, C] (the inputs before
    them), kernel `weight` [C, 1, Kc] (plus `bias` [C]), then SiLU. Returns (outputs [T, C], the new
    window: the last Kc - 1 inputs, a new tensor)."""
    kc = weight.shape[-1]
    inputs = torch.cat((window, rows.to(window.dtype)))  # [Kc - 1 + T, C]
    bias = bias.to(inputs.dtype) if bias is not None else None
    out = F.conv1d(inputs.t()[None], weight.to(inputs.dtype), bias, groups=inputs.shape[1])[0].t()  # [T, C]
    return F.silu(out), inputs[inputs.shape[0] - (kc - 1):].clone()
