"""NVFP4 matrices as ModelOpt and compressed-tensors ship them (GLM-5.x, MiniMax-M2.x NVFP4 checkpoints).

A weight [N, K] is e2m1 codes, two a byte, the low nibble the even input (uint8 [N, K/2]), an
FP8 e4m3 scale per 16 inputs [N, K/16], and one float32 global scale g per matrix:

    w[r, c] = FP4[code] * (scale[r, c // 16] / g)        FP4 = (0, .5, 1, 1.5, 2, 3, 4, 6, -0, ..., -6)

in float32, as compressed-tensors' NVFP4 decompressor computes it (its `dequantize`: the scale
divided by the global scale first, then the product). compressed-tensors stores g
(`weight_global_scale`); ModelOpt stores its inverse (`weight_scale_2`, a multiplier), which is read
as compressed-tensors' ModelOpt converter reads it, g = 1 / weight_scale_2 in float32: the same
model a ModelOpt checkpoint converted by that library is (families/shipped.py says which tensors).

Eagerly a chunk of rows widens as MXFP4's does (mxfp4.py `widen_groups`: each byte's two codes
become two float16s of FP4[code] * 2^-14 in a few whole-word operations), each group then times its
scale * 2^14 — exact scaling by a power of two, so each weight is the reference's to the bit.
Under torch.compile (`fused_rows`, nibble_pairs.py) the codes are integer arithmetic (ggml/fp4.py
`fp4_values`) and the e4m3 scale its bits (fp8.py's fused trick), the scale applied once per 16.
"""

from __future__ import annotations

import torch

from tessera.stages.kernels.ggml.fp4 import fp4_values
from tessera.stages.kernels.linear import ShippedLinear
from tessera.stages.kernels.mxfp4 import CODE_EXPONENT, FP4_VALUES, widen_groups
from tessera.stages.kernels.nibble_pairs import interleave, nibbles, pair_rows

GROUP = 16  # inputs per e4m3 scale
FUSED_EXPONENT = 120  # an e4m3 byte's bits shifted into float32's read its value * 2^-120 (fp8.py)


def nvfp4_dense(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of `codes` uint8 [N, K/2], e4m3 `scales` [N, K/16] and the global scale
    (compressed-tensors' arithmetic: FP4 value times (scale / global))."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    low, high = nibbles(codes)
    values = interleave(lut[low], lut[high])  # [N, K]
    scale = scales.float() / global_scale.float()  # [N, K/16]
    n, k = values.shape
    return (values.view(n, k // GROUP, GROUP) * scale[..., None]).view(n, k)


def e4m3_value(b: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (int32) -> their float32 values, as integer operations and a bit cast (fp8.py)."""
    return (((b & 0x80) << 24) | ((b & 0x7F) << 20)).view(torch.float32) * 2.0**FUSED_EXPONENT


class Nvfp4Linear(ShippedLinear):
    """y = x W^T for W an NVFP4 matrix (module docstring): `codes` uint8 [N, K/2], `scales` float8_e4m3fn
    [N, K/16], `global_scale` float32 [] (the divisor); `input_scale`, a W4A4 checkpoint's, is kept, not used."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                 bias: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], 2 * codes.shape[1]
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("global_scale", global_scale.float().reshape(()))
        self.register_buffer("bias", bias)
        self.register_buffer("input_scale", input_scale)  # a W4A4 checkpoint's, held as shipped, not applied

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        blocks = self.codes[lo:hi].view(hi - lo, -1, GROUP // 2)  # [r, K/16, 8]
        factors = (self.scales[lo:hi].float() / self.global_scale * 2.0**CODE_EXPONENT)[..., None]
        return widen_groups(blocks, factors, out, factors)

    def dequantized(self) -> torch.Tensor:
        return nvfp4_dense(self.codes.cpu(), self.scales.cpu(), self.global_scale.cpu())

    @property
    def stored_as(self) -> str:
        return "NVFP4"

    def fused_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scales.view(torch.uint8), self.global_scale

    def _fused(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(low values, high values [N, K/16, 8], scale [N, K/16])."""
        n = codes.shape[0]
        low, high = nibbles(codes.view(n, -1, GROUP // 2))
        scale = e4m3_value(scales.to(torch.int32) & 0xFF) / global_scale
        return fp4_values(low) * 0.5, fp4_values(high) * 0.5, scale

    def fused_weight(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
        low, high, scale = self._fused(codes, scales, global_scale)
        return (interleave(low, high) * scale[..., None]).reshape(self.out_features, self.in_features)

    def fused_rows(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   global_scale: torch.Tensor) -> torch.Tensor:
        return pair_rows(x, *self._fused(codes, scales, global_scale))
