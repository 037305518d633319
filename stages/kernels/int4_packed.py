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
scale fits float32's mantissa).

The codes and scales are held in row tiles (row_tiles.py: made at load, the same bytes): eagerly
the codes of a chunk of rows widen and scale per group; under torch.compile (`fused_rows`) each
tile's lanes form their weights (q - 8) * s and sum them against the inputs (every load
contiguous), and an asymmetric matrix subtracts sum_g z_g s_g sum(x_g) per row after.
"""

from __future__ import annotations

import torch

from tessera.stages.errors import ModelFormatError
from tessera.stages.kernels.linear import ShippedLinear
from tessera.stages.kernels.nibble_pairs import interleave, nibbles
from tessera.stages.kernels.row_tiles import rows_of, tile_rows, tiles_of

CODE_OFFSET = 8  # a stored code is q + 8
PER_WORD = 8  # codes an int32 holds


def unpack_zero_points(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """int32 [ceil(N/8), G] zero points packed along the rows -> int32 [N, G] (z in [-8, 7])."""
    words = packed.to(torch.int32)
    shifts = 4 * torch.arange(PER_WORD, dtype=torch.int32, device=packed.device)
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [N/8, 8, G]: row 8 w + i
    return codes.reshape(-1, packed.shape[-1])[:rows] - CODE_OFFSET


class PackedInt4Linear(ShippedLinear):
    """y = x W^T for W a pack-quantized INT4 matrix (module docstring), given as shipped: `packed` int32
    [N, K/8], `scales` [N, K/G], `zero_points` int32 [ceil(N/8), K/G] or None (symmetric); the code bytes
    and scales are held as row tiles (`codes`, `scales` and their `_tail`s), the zero points as shipped."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                 bias: torch.Tensor | None, shape: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], PER_WORD * packed.shape[1]
        if shape is not None and tuple(shape.tolist()) != (self.out_features, self.in_features):
            raise ModelFormatError(f"an INT4 matrix's weight_shape {shape.tolist()} is not its packed shape "
                                   f"{[self.out_features, self.in_features]}")
        self.register_buffer("shape", shape)  # held as shipped (a checkpoint's weight_shape)
        self.group = self.in_features // scales.shape[1]
        code_bytes = packed.contiguous().view(torch.uint8)  # [N, K/2]: a word's bytes are code pairs (little-endian)
        for name, rows in (("codes", code_bytes), ("scales", scales)):
            head, tail = tiles_of(rows)
            self.register_buffer(name, head)
            self.register_buffer(name + "_tail", tail)
        self.register_buffer("zero_points", zero_points)
        self.register_buffer("bias", bias)

    def _q(self, code_bytes: torch.Tensor) -> torch.Tensor:
        """q (int32 [r, K/G, G]) of code bytes [r, K/2]."""
        low, high = nibbles(code_bytes.reshape(code_bytes.shape[0], -1, self.group // 2))
        return interleave(low.sub_(CODE_OFFSET), high.sub_(CODE_OFFSET))

    def _zeros(self, lo: int, hi: int) -> torch.Tensor | None:
        if self.zero_points is None:
            return None
        first = lo // PER_WORD
        zeros = unpack_zero_points(self.zero_points[first : -(-hi // PER_WORD)], hi - first * PER_WORD)
        return zeros[lo - first * PER_WORD :]

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """float32 rows [lo, hi) of the weight written into `out` [hi - lo, K], the reference's arithmetic:
        the stored codes q + 8 widen straight into `out` (small integers: exact in float32), less 8 + z,
        times s. No int32 or float temporary of the chunk's size: the eager forward's temporaries are
        what glibc keeps on its heap after a step (a span held 1.16x its bytes on one machine)."""
        codes = tile_rows(self.codes, self.codes_tail, lo, hi)  # uint8 [r, K/2]
        pairs = out.view(hi - lo, -1, 2)
        pairs[..., 0].copy_(codes & 0xF)
        pairs[..., 1].copy_(codes >> 4)
        groups = out.view(hi - lo, -1, self.group)
        zeros = self._zeros(lo, hi)
        groups.sub_(CODE_OFFSET if zeros is None else (zeros + CODE_OFFSET).float()[..., None])
        groups.mul_(tile_rows(self.scales, self.scales_tail, lo, hi).float()[..., None])
        return out

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        """float32 rows [lo, hi) of the weight."""
        return self.rows_into(lo, hi, torch.empty(hi - lo, self.in_features, device=self.codes.device))

    def dequantized(self) -> torch.Tensor:
        return self._rows(0, self.out_features).cpu()

    @property
    def stored_as(self) -> str:
        return f"INT4 (group {self.group})"

    def fused_inputs(self) -> tuple[torch.Tensor, ...]:
        tails = () if self.codes_tail is None else (self.codes_tail, self.scales_tail)
        zeros = () if self.zero_points is None else (self.zero_points,)
        return self.codes, self.scales, *tails, *zeros

    def _parts(self, stored: tuple[torch.Tensor, ...]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """`fused_inputs` -> ([(codes, scales) of the head tiles and of the tail], zero points or None)."""
        tiles = [(stored[0], stored[1])] + ([(stored[2], stored[3])] if self.codes_tail is not None else [])
        return [(c, s) for c, s in tiles if c.shape[0]], (stored[-1] if self.zero_points is not None else None)

    def fused_weight(self, *stored: torch.Tensor) -> torch.Tensor:
        tiles, zero_points = self._parts(stored)
        q = self._q(torch.cat([rows_of(codes) for codes, _ in tiles]))
        if zero_points is not None:
            q = q - unpack_zero_points(zero_points, self.out_features)[..., None]
        scales = torch.cat([rows_of(scales) for _, scales in tiles])
        return (q.float() * scales.float()[..., None]).reshape(self.out_features, self.in_features)

    def fused_rows(self, x: torch.Tensor, *stored: torch.Tensor) -> torch.Tensor:
        tiles, zero_points = self._parts(stored)
        pairs = x.view(x.shape[0], 1, -1, self.group // 2, 1, 2)  # [R, 1, K/G, G/2, 1, 2]: even and odd inputs
        outs = []
        for codes, scales in tiles:  # codes [T, K/2, width], scales [T, K/G, width]
            b = codes.view(codes.shape[0], -1, self.group // 2, codes.shape[-1]).to(torch.int32)
            s = scales.float()[:, :, None, :]  # [T, K/G, 1, width]
            low, high = ((b & 0xF) - CODE_OFFSET).float() * s, ((b >> 4) - CODE_OFFSET).float() * s
            outs.append((pairs[..., 0] * low + pairs[..., 1] * high).sum((2, 3)).reshape(x.shape[0], -1))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if zero_points is not None:  # minus sum_g z_g s_g sum(x_g), per row
            scales = torch.cat([rows_of(scales) for _, scales in tiles]).float()  # [N, K/G]
            offset = unpack_zero_points(zero_points, self.out_features).float() * scales
            y = y - (x.view(x.shape[0], 1, -1, self.group).sum(-1) * offset).sum(-1)
        return y
