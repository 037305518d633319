"""NVFP4 matrices as ModelOpt and compressed-tensors ship them (GLM-5.x, MiniMax-M2.x NVFP4 checkpoints).

A weight [N, K] is e2m1 codes, two a byte, the low nibble the even input (uint8 [N, K/2]), an
FP8 e4m3 scale per 16 inputs [N, K/16], and one float32 global scale g per matrix:

    w[r, c] = FP4[code] * (scale[r, c // 16] / g)        FP4 = (0, .5, 1, 1.5, 2, 3, 4, 6, -0, ..., -6)

in float32, as compressed-tensors' NVFP4 decompressor computes it (its `dequantize`: the scale
divided by the global scale first, then the product). compressed-tensors stores g
(`weight_global_scale`); ModelOpt stores its inverse (`weight_scale_2`, a multiplier), which is read
as compressed-tensors' ModelOpt converter reads it, g = 1 / weight_scale_2 in float32: the same
model a ModelOpt checkpoint converted by that library is (families/shipped.py says which tensors).

The codes and scales are held as row tiles (row_tiles.py: made at load, the same bytes). Eagerly a
chunk of rows widens as MXFP4's does (mxfp4.py `widen_groups`: each byte's two codes become two
float16s of FP4[code] * 2^-14 in a few whole-word operations), each group then times its scale *
2^14 — exact scaling by a power of two, so each weight is the reference's to the bit. Under
torch.compile (`fused_rows`) each tile's lanes sum their groups' codes (shifts, masks and a bit cast:
ggml/fp4.py `fp4_values`) against the inputs, every load contiguous, and then times each group's
scale, its e4m3 bits read the same way (fp8.py `e4m3_values`).
"""

from __future__ import annotations

import torch

from tessera.stages.kernels.fp8 import e4m3_values
from tessera.stages.kernels.ggml.fp4 import fp4_byte_values, fp4_values
from tessera.stages.kernels.linear import ShippedLinear
from tessera.stages.kernels.mxfp4 import CODE_EXPONENT, FP4_VALUES, widen_groups
from tessera.stages.kernels.nibble_pairs import interleave, nibbles
from tessera.stages.kernels.row_tiles import rows_of, tile_rows, tiles_of

GROUP = 16  # inputs per e4m3 scale


def nvfp4_dense(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of `codes` uint8 [N, K/2], e4m3 `scales` [N, K/16] and the global scale
    (compressed-tensors' arithmetic: FP4 value times (scale / global))."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    low, high = nibbles(codes)
    values = interleave(lut[low], lut[high])  # [N, K]
    scale = scales.float() / global_scale.float()  # [N, K/16]
    n, k = values.shape
    return (values.view(n, k // GROUP, GROUP) * scale[..., None]).view(n, k)


class Nvfp4Linear(ShippedLinear):
    """y = x W^T for W an NVFP4 matrix (module docstring), given as shipped: `codes` uint8 [N, K/2], `scales`
    float8_e4m3fn [N, K/16], `global_scale` float32 [] (the divisor), held as row tiles (`codes`, `scales`
    as their bytes, and their `_tail`s); `input_scale`, a W4A4 checkpoint's, is kept, not used."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], 2 * codes.shape[1]
        for name, rows in (("codes", codes), ("scales", scales.view(torch.uint8))):
            head, tail = tiles_of(rows)
            self.register_buffer(name, head)
            self.register_buffer(name + "_tail", tail)
        self.register_buffer("global_scale", global_scale.float().reshape(()))
        self.register_buffer("bias", bias)
        self.register_buffer("input_scale", input_scale)  # a W4A4 checkpoint's, held as shipped, not applied

    def _stored_rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) as shipped: codes uint8 [r, K/2], scales float8_e4m3fn [r, K/16]."""
        return (tile_rows(self.codes, self.codes_tail, lo, hi),
                tile_rows(self.scales, self.scales_tail, lo, hi).view(torch.float8_e4m3fn))

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        codes, scales = self._stored_rows(lo, hi)
        blocks = codes.view(hi - lo, -1, GROUP // 2)  # [r, K/16, 8]
        factors = (scales.float() / self.global_scale * 2.0**CODE_EXPONENT)[..., None]
        return widen_groups(blocks, factors, out, factors)

    def dequantized(self) -> torch.Tensor:
        codes, scales = self._stored_rows(0, self.out_features)
        return nvfp4_dense(codes.cpu(), scales.cpu(), self.global_scale.cpu())

    @property
    def stored_as(self) -> str:
        return "NVFP4"

    def fused_inputs(self) -> tuple[torch.Tensor, ...]:
        tails = () if self.codes_tail is None else (self.codes_tail, self.scales_tail)
        return self.codes, self.scales, *tails, self.global_scale

    def _tiles(self, stored: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`fused_inputs` -> (codes, scales) of the head tiles and of the tail (those holding rows)."""
        tiles = [(stored[0], stored[1])] + ([(stored[2], stored[3])] if self.codes_tail is not None else [])
        return [(c, s) for c, s in tiles if c.shape[0]]

    def fused_weight(self, *stored: torch.Tensor) -> torch.Tensor:
        tiles, global_scale = self._tiles(stored), stored[-1]
        codes = torch.cat([rows_of(c) for c, _ in tiles])  # [N, K/2]
        scales = torch.cat([rows_of(s) for _, s in tiles]).view(torch.int8).to(torch.int32)  # [N, K/16]
        low, high = nibbles(codes.view(self.out_features, -1, GROUP // 2))
        scale = e4m3_values(scales) / global_scale
        values = interleave(fp4_values(low), fp4_values(high)) * 0.5
        return (values * scale[..., None]).reshape(self.out_features, self.in_features)

    def fused_rows(self, x: torch.Tensor, *stored: torch.Tensor) -> torch.Tensor:
        pairs = x.view(x.shape[0], 1, -1, GROUP // 2, 1, 2)  # [R, 1, K/16, 8, 1, 2]: even and odd inputs
        outs = []
        for codes, scales in self._tiles(stored):  # codes [T, K/2, width], scales [T, K/16, width]
            b = codes.view(codes.shape[0], -1, GROUP // 2, codes.shape[-1]).view(torch.int8).to(torch.int32)
            low, high = fp4_byte_values(b)
            dots = (pairs[..., 0] * low + pairs[..., 1] * high).sum(3)  # [R, T, K/16, width]
            scale = e4m3_values(scales.view(torch.int8).to(torch.int32)) / stored[-1]  # each group's scale / g
            outs.append(((dots * scale).sum(2) * 0.5).reshape(x.shape[0], -1))  # fp4_values are doubled
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
