"""compressed-tensors' INT4 "pack-quantized" matrices (Kimi K2.x's native INT4, llm-compressor's W4A16).

A weight [N, K] is int32 `weight_packed` [N, K/8]: eight 4-bit codes a word, the lowest bits first,
each stored as q + 8 for q in [-8, 7] — on a little-endian machine its bytes are code pairs, the low
nibble the even input (nibble_pairs.py's layout). A scale per group of G inputs `weight_scale` [N, K/G]
(bf16, f16 or f32 as shipped; G = K for strategy channel) and, asymmetric, a zero point per group,
packed the same way along the rows: `weight_zero_point` int32 [ceil(N/8), K/G], zero z of row r in
nibble r % 8 of word (r / 8, g), stored as z + 8:

    w[r, c] = (q[r, c] - z[r, c / G]) * s[r, c / G]

in float32: compressed-tensors' `dequantize` given float32 scales (its own arithmetic in the scale's
dtype would round a bf16 product to bf16; the float32 one is exact: a 4-bit integer times a bf16
scale fits float32's mantissa). Eagerly the codes of a chunk of rows widen and scale per group;
under torch.compile (`fused_rows`) the product is factored per group (nibble_pairs.py `pair_rows`):
sum_g s_g (x_g . q_g) - (z_g s_g) sum(x_g).
"""

from __future__ import annotations

import torch

from tessera.stages.errors import ModelFormatError
from tessera.stages.kernels.linear import ShippedLinear
from tessera.stages.kernels.nibble_pairs import interleave, nibbles, pair_rows

CODE_OFFSET = 8  # a stored code is q + 8
PER_WORD = 8  # codes an int32 holds


def unpack_zero_points(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [ceil(N/8), G] zero points packed along the rows -> int32 [N, G] (z in [-8, 7])."""
    words = packed.to(torch.int32)
    shifts = 4 * torch.arange(PER_WORD, dtype=torch.int32, device=packed.device)
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [N/8, 8, G]: row 8 w + i
    return codes.reshape(-1, packed.shape[-1])[:rows] - CODE_OFFSET


class PackedInt4Linear(ShippedLinear):
    """y = x W^T for W a pack-quantized INT4 matrix (module docstring): `packed` int32 [N, K/8], `scales`
    [N, K/G] as shipped, `zero_points` int32 [ceil(N/8), K/G] or None (symmetric)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                 bias: torch.Tensor | None, shape: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], PER_WORD * packed.shape[1]
        if shape is not None and tuple(shape.tolist()) != (self.out_features, self.in_features):
            raise ModelFormatError(f"an INT4 matrix's weight_shape {shape.tolist()} is not its packed shape "
                                   f"{[self.out_features, self.in_features]}")
        self.register_buffer("shape", shape)  # held as shipped (a checkpoint's weight_shape)
        self.group = self.in_features // scales.shape[1]
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zero_points", zero_points)
        self.register_buffer("bias", bias)

    def _codes(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q of the even and of the odd inputs, int32 [r, K/G, G/2] each, from the int32 words or their bytes."""
        code_bytes = packed.contiguous().view(torch.uint8) if packed.dtype == torch.int32 else packed
        low, high = nibbles(code_bytes.view(packed.shape[0], -1, self.group // 2))
        return low - CODE_OFFSET, high - CODE_OFFSET

    def _zeros(self, lo: int, hi: int) -> torch.Tensor | None:
        if self.zero_points is None:
            return None
        first = lo // PER_WORD
        zeros = unpack_zero_points(self.zero_points[first : -(-hi // PER_WORD)], hi - first * PER_WORD)
        return zeros[lo - first * PER_WORD :]

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        """float32 rows [lo, hi) of the weight (the reference's arithmetic)."""
        low, high = self._codes(self.packed[lo:hi])
        q = interleave(low, high)  # [r, K/G, G]
        zeros = self._zeros(lo, hi)
        if zeros is not None:
            q = q - zeros[..., None]
        return (q.float() * self.scales[lo:hi].float()[..., None]).reshape(hi - lo, self.in_features)

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self._rows(lo, hi))

    def dequantized(self) -> torch.Tensor:
        return self._rows(0, self.out_features).cpu()

    @property
    def stored_as(self) -> str:
        return f"INT4 (group {self.group})"

    def fused_inputs(self) -> tuple[torch.Tensor, ...]:
        zeros = () if self.zero_points is None else (self.zero_points,)
        return self.packed.view(torch.uint8), self.scales, *zeros  # the words' bytes: code pairs

    def _fused(self, packed: torch.Tensor, scales: torch.Tensor, *zero_points: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        low, high = self._codes(packed)
        scale = scales.float()
        if not zero_points:
            return low.float(), high.float(), scale, None
        zeros = unpack_zero_points(zero_points[0], self.out_features)
        return low.float(), high.float(), scale, zeros.float() * scale

    def fused_weight(self, packed: torch.Tensor, scales: torch.Tensor, *zero_points: torch.Tensor) -> torch.Tensor:
        low, high = self._codes(packed)
        q = interleave(low, high)
        if zero_points:
            q = q - unpack_zero_points(zero_points[0], self.out_features)[..., None]
        return (q.float() * scales.float()[..., None]).reshape(self.out_features, self.in_features)

    def fused_rows(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                   *zero_points: torch.Tensor) -> torch.Tensor:
        return pair_rows(x, *self._fused(packed, scales, *zero_points))
