"""Matrices stored as 4-bit codes two a byte, the low nibble the even input, with a scale per group of
inputs held beside them: the layout NVFP4 (nvfp4.py), compressed-tensors' INT4 (int4_packed.py) and
the FP4 experts of gpt-oss and DeepSeek-V4 (mxfp4.py) share.

`pair_rows` is their fused one-row product under torch.compile: per group, the even inputs times the
low codes plus the odd inputs times the high codes, summed (the code bytes read once, contiguously),
then times the group's scale, and summed over groups — x . w = sum_g s_g (x_g . c_g), the scale's
work once per group. Only the order of float32 summation differs from the dequantized weight's
product.
"""

from __future__ import annotations

import torch


def nibbles(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (or int8) code bytes -> their low and high nibbles as int32."""
    b = codes.to(torch.int32)
    b = b if codes.dtype == torch.uint8 else b & 0xFF
    return b & 0xF, b >> 4


def interleave(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """[..., n] low and high values -> [..., 2 n], each low one before its high one (the inputs' order)."""
    return torch.stack((low, high), dim=-1).flatten(-2)


def pair_rows(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, scale: torch.Tensor,
              offset: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] float32 @ W^T -> [R, N] for W [N, K] with w = scale_g * code - offset_g per group of inputs:
    low and high float32 codes [N, G, S/2] (inputs 2i and 2i + 1 of each group), scale (and offset)
    [N, G] (module docstring)."""
    n, groups, half = low.shape
    pairs = x.view(x.shape[0], 1, groups, half, 2)
    dots = (pairs[..., 0] * low + pairs[..., 1] * high).sum(-1)  # [R, N, G]
    y = (dots * scale).sum(-1)
    if offset is not None:
        y = y - (pairs.sum((-1, -2)) * offset).sum(-1)
    return y
