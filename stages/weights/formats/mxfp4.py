"""MXFP4 matrices as gpt-oss ships its experts (OCP microscaling: e2m1 values, e8m0 scales).

A weight [N, K] is `x_blocks` uint8 [N, K/32, 16] — two e2m1 codes a byte, the low nibble the
even input — and `x_scales` uint8 [N, K/32], a power-of-two exponent per 32 inputs:

    w[r, 32 g + i] = FP4[code] * 2^(scale[r, g] - 127)
    FP4 = (0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6)

`mxfp4_dense` is the reference, computed as transformers' `convert_moe_packed_tensors` does
(a table lookup, then ldexp). Each value is exact in float32 (two mantissa bits).

At compute time a table lookup is slow on a CPU (an index per weight), so the codes widen
through float16 as fp8's do: a code's magnitude bits shifted to float16's top mantissa bit
and exponent (bits 9..11), its sign to bit 15, are the float16 of FP4[code] * 2^-14 —
e2m1's subnormal 0.5 included — and the scale 2^(e - 127 + 14) is built from its exponent
bits in float32 and multiplies each group of 32. The same value, bit for bit.
"""

from __future__ import annotations

import torch

from tessera.stages.weights.formats.linear import ShippedLinear
from tessera.stages.weights.quant import SCRATCH

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # inputs per scale
E8M0_BIAS = 127
CODE_EXPONENT = 14  # the float16 trick reads FP4[code] * 2^-14
FLOAT32_EXPONENT_BITS = 23


def mxfp4_dense(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of `blocks` [N, K/32, 16] and `scales` [N, K/32] (transformers' formula)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    rows, groups, half = blocks.shape
    out = torch.empty(rows, groups, 2 * half, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    torch.ldexp(out, (scales.int() - E8M0_BIAS)[..., None], out=out)
    return out.view(rows, groups * 2 * half)


def widen_groups(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of `blocks` [r, G, 16] / `scales` [r, G] as float32 into `out` [r, 32 G] (module docstring)."""
    r, groups, half = blocks.shape
    codes = SCRATCH.take(r * groups * 2 * half, torch.uint8).view(r, groups, half, 2)
    torch.bitwise_and(blocks, 0x0F, out=codes[..., 0])
    torch.bitwise_right_shift(blocks, 4, out=codes[..., 1])
    bits = SCRATCH.take(codes.numel(), torch.int16).view(codes.shape)
    bits.copy_(codes)
    sign = (bits & 8).bitwise_left_shift_(12)
    bits.bitwise_and_(7).bitwise_left_shift_(9).bitwise_or_(sign)
    w = out.view(r, groups, 2 * half)
    w.copy_(bits.view(r, groups, 2 * half).view(torch.float16))
    # 2^(e - 127 + 14) from its float32 exponent bits, clamped to the finite exponents
    exponent = (scales.int() - (E8M0_BIAS - CODE_EXPONENT) + 127).clamp_(1, 254)
    return w.mul_(exponent.bitwise_left_shift_(FLOAT32_EXPONENT_BITS).view(torch.float32)[..., None]).view(r, -1)


class Mxfp4Linear(ShippedLinear):
    """y = x W^T for W stored as MXFP4 `blocks` [N, K/32, 16] and `scales` [N, K/32] (module docstring)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        rows, groups, half = blocks.shape
        self.out_features, self.in_features = rows, groups * 2 * half
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        return widen_groups(self.blocks[lo:hi], self.scales[lo:hi], out)

    def dequantized(self) -> torch.Tensor:
        return mxfp4_dense(self.blocks.cpu(), self.scales.cpu())

    def dequantized_on(self, device: torch.device) -> torch.Tensor:
        return mxfp4_dense(self.blocks.to(device), self.scales.to(device))
