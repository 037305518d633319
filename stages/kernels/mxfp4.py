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
e2m1's subnormal 0.5 included — and the scale 2^(e - 127 + 14), built once per matmul from
its exponent bits in float32, multiplies each group of 32. The same value, bit for bit.

Under torch.compile (`fused_weight`) a code and its group's exponent become float32 bits: the
magnitude bits shifted to float32's exponent and top mantissa bit (bits 22..24) read as
FP4[code] * 2^-126, so adding (scale - 1) to the exponent field makes it FP4[code] *
2^(scale - 127); e2m1's subnormal 0.5 (and zero) take the exponent field alone (or nothing);
the sign goes to bit 31. Integer operations and a bit cast, which inductor vectorises. It holds
for exponents FUSED_SCALES (every normal result; a checkpoint's scales lie far inside), and a
matrix with a scale outside has no fused form. A one-row product (`fused_rows`) runs over the
bytes, each byte's low code times an even input and its high code times the next: the codes
are read contiguously (interleaving them in the weights' order would make every load a gather).
"""

from __future__ import annotations

import torch

from tessera.stages.kernels.chunked import SCRATCH, chunked_matmul
from tessera.stages.kernels.ggml.fp4 import fp4_byte_values
from tessera.stages.kernels.linear import ShippedLinear
from tessera.stages.kernels.row_tiles import rows_of, tile_rows, tiles_of

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # inputs per scale
E8M0_BIAS = 127
CODE_EXPONENT = 14  # the float16 trick reads FP4[code] * 2^-14
FLOAT32_EXPONENT_BITS = 23
FUSED_SCALES = (2, 252)  # e8m0 exponents whose every product with an e2m1 value is a normal float32


def mxfp4_dense(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of `blocks` [N, K/32, 16] and `scales` [N, K/32] (transformers' formula)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    rows, groups, half = blocks.shape
    out = torch.empty(rows, groups, 2 * half, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    torch.ldexp(out, (scales.int() - E8M0_BIAS)[..., None], out=out)
    return out.view(rows, groups * 2 * half)


# A byte's two codes -> the int32 holding both float16s (the low nibble's in the low half, as
# little-endian float16 pairs lie: the even input first). Magnitudes: bits 0-2 and 4-6 times
# 2^9 + 2^21 land on 9-11 and 25-27 (and, harmlessly, 13-15 and 21-23, masked off); signs:
# bits 3 and 7 times 2^12 + 2^24 land on 15 and 31 (and on 19 and 27, masked off).
MAGNITUDES, MAGNITUDE_SPREAD, MAGNITUDE_MASK = 0x77, (1 << 9) + (1 << 21), 0x0E000E00
SIGNS, SIGN_SPREAD, SIGN_MASK = 0x88, (1 << 12) + (1 << 24), -0x7FFF8000  # int32 0x80008000


def group_scales(scales: torch.Tensor) -> torch.Tensor:
    """uint8 exponents [r, G] -> float32 2^(e - 127 + 14) [r, G, 1] (built from its exponent bits,
    clamped to the finite exponents): what the float16 trick's values are multiplied by."""
    exponent = (scales.int() - (E8M0_BIAS - CODE_EXPONENT) + 127).clamp_(1, 254)
    return exponent.bitwise_left_shift_(FLOAT32_EXPONENT_BITS).view(torch.float32)[..., None]


def widen_groups(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                 factors: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `blocks` [r, G, 16] / `scales` [r, G] as float32 into `out` [r, 32 G] (module
    docstring); `factors`, their `group_scales` when already computed. Each byte becomes the int32
    of its two float16s in a few whole-word operations (MAGNITUDES, SIGNS above)."""
    r, groups, half = blocks.shape
    byte = SCRATCH.take(r * groups * half, torch.int32, "bytes").view(r, groups, half)
    byte.copy_(blocks.view(torch.int8))
    pair = SCRATCH.take(r * groups * half, torch.int32, "pairs").view(r, groups, half)
    torch.bitwise_and(byte, MAGNITUDES, out=pair).mul_(MAGNITUDE_SPREAD).bitwise_and_(MAGNITUDE_MASK)
    byte.bitwise_and_(SIGNS).mul_(SIGN_SPREAD).bitwise_and_(SIGN_MASK)
    pair.bitwise_or_(byte)
    w = out.view(r, groups, 2 * half)
    w.copy_(pair.view(torch.float16).view(r, groups, 2 * half))
    w.mul_(group_scales(scales) if factors is None else factors)
    return out


class Mxfp4Linear(ShippedLinear):
    """y = x W^T for W stored as MXFP4 `blocks` [N, K/32, 16] and `scales` [N, K/32] (module docstring),
    held as row tiles (`blocks`, `scales` and their `_tail`s)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        rows, groups, half = blocks.shape
        self.out_features, self.in_features = rows, groups * 2 * half
        for name, part in (("blocks", blocks), ("scales", scales)):
            head, tail = tiles_of(part)
            self.register_buffer(name, head)
            self.register_buffer(name + "_tail", tail)
        self.register_buffer("bias", bias)

    def _stored_rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) as shipped: blocks [r, K/32, 16], scales [r, K/32]."""
        return tile_rows(self.blocks, self.blocks_tail, lo, hi), tile_rows(self.scales, self.scales_tail, lo, hi)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> [T, N]: on a CPU, the whole matrix's scales once, its codes a chunk at a time."""
        if rows.device.type != "cpu":
            return super().matmul(rows)
        _, scales = self._stored_rows(0, self.out_features)
        factors = group_scales(scales)
        return chunked_matmul(rows.float(), self.out_features, lambda lo, hi, out: widen_groups(
            tile_rows(self.blocks, self.blocks_tail, lo, hi), scales[lo:hi], out, factors[lo:hi])).to(rows.dtype)

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        return widen_groups(*self._stored_rows(lo, hi), out)

    def dequantized(self) -> torch.Tensor:
        blocks, scales = self._stored_rows(0, self.out_features)
        return mxfp4_dense(blocks.cpu(), scales.cpu())

    def fused_inputs(self) -> tuple[torch.Tensor, ...] | None:
        low, high = FUSED_SCALES
        scales = [s for s in (self.scales, self.scales_tail) if s is not None and s.numel()]
        if scales and not low <= min(int(s.min()) for s in scales) <= max(int(s.max()) for s in scales) <= high:
            return None
        tails = () if self.blocks_tail is None else (self.blocks_tail, self.scales_tail)
        return self.blocks, self.scales, *tails

    def _tiles(self, stored: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`fused_inputs` -> (blocks, scales) of the head tiles and of the tail (those holding rows)."""
        tiles = [(stored[0], stored[1])] + ([(stored[2], stored[3])] if len(stored) > 2 else [])
        return [(b, s) for b, s in tiles if b.shape[0]]

    def fused_weight(self, *stored: torch.Tensor) -> torch.Tensor:
        tiles = self._tiles(stored)
        blocks, scales = torch.cat([rows_of(b) for b, _ in tiles]), torch.cat([rows_of(s) for _, s in tiles])
        low, high = self._fused_halves(blocks, scales)  # [N, G, 16] each
        return torch.stack((low, high), dim=-1).reshape(self.out_features, self.in_features)  # the low the even input

    def fused_rows(self, x: torch.Tensor, *stored: torch.Tensor) -> torch.Tensor:
        pairs = x.view(x.shape[0], 1, -1, GROUP // 2, 1, 2)  # [R, 1, G, 16, 1, 2]: even and odd inputs
        outs = []
        for blocks, scales in self._tiles(stored):  # blocks [T, G, 16, width], scales [T, G, width]
            b = blocks.view(torch.int8).to(torch.int32)  # sign-extended (fp4_byte_values)
            low, high = fp4_byte_values(b)
            dots = (pairs[..., 0] * low + pairs[..., 1] * high).sum(3)  # [R, T, G, width]
            scale = torch.exp2((scales.to(torch.int32) - (E8M0_BIAS + 1)).float())  # 2^(e - 127) / 2: fp4_byte_values are doubled
            outs.append((dots * scale).sum(2).reshape(x.shape[0], -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @staticmethod
    def _fused_halves(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 weights of each byte's low and high code [N, G, 16] (module docstring)."""
        exponent = ((scales.to(torch.int32) - 1) << FLOAT32_EXPONENT_BITS)[..., None]  # [N, G, 1]
        b = blocks.to(torch.int32)
        return scaled_fp4(b & 15, exponent), scaled_fp4(b >> 4, exponent)


def scaled_fp4(codes: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """FP4[code] * 2^(scale - 127) as float32 for e2m1 codes (int32, 0..15), `exponent` (scale - 1)
    shifted to float32's exponent field (module docstring)."""
    normal = ((codes & 7) << 22) + exponent
    subnormal = exponent & -(codes & 1)  # 0, or 0.5 * 2^(scale - 127): the field alone where the mantissa bit is set
    bits = torch.where((codes & 6) == 0, subnormal, normal) | ((codes & 8) << 28)
    return bits.view(torch.float32)
