"""A ggml block type as scaled codes: per group g of a block, w[g, i] = scale[g] * code[g, i] - offset[g].

Every ggml type that a GGUF's low-bit files mix (the k-quants Q2_K .. Q6_K, the IQ types, MXFP4 and
NVFP4: ggml/kquants.py, ggml/iq.py, ggml/fp4.py) has that shape once its bytes are read: a block of
256 (32, 64) weights is groups of 8 to 32 weights, each group with one float scale (a float16
super-block scale times a small integer, a power of two, an e4m3 byte) and for some types a float
offset (Q2_K, Q4_K, Q5_K: dmin times a small integer), and each weight a small code: an integer,
a value of a 16-entry table (IQ4, FP4), or a point of a lattice grid of 8 or 4 values times signs
(the IQ2/IQ3/IQ1 types). A type here is its `parts` function, which turns blocks into those three
tensors with torch operations only (integer shifts and masks, a gather from the type's constant
tables, float16 read from its bits), and nothing else: so one function is

- the reference (`scaled_weight`): `scale * code - offset` in float32, the order of operations of
  the gguf package's numpy dequantizer for the type, so that the two agree to the bit (the tests
  hold every type to it over random blocks);
- the eager product: rows of the weight into the scratch chunk, then the float32 matmul;
- the fused form under torch.compile (`scaled_rows`): per group, the codes times the activations
  summed first, then times the group's scale (and minus the offset times the activations' sum
  over the group), summed over groups: x . w = sum_g scale_g (x_g . code_g) - offset_g sum(x_g).
  The scale and offset work is once per group instead of once per weight, and the codes are read
  once, in the inputs' order (contiguous on both sides); only the order of float32 summation
  differs from the dequantized weight's product.

Bytes are read as int32 (`byte`, `half`, `word`) from a uint8 (or int8) view of the blocks: a
block of an odd or non-multiple-of-four size has no aligned wider view, and an int32 widening
vectorises in inductor where a dtype view of a slice would not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

Parts = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]
FLOAT16_BITS_SCALE = 2.0 ** 112  # `float16_value`: 127 - 15, float32's exponent bias less float16's


@dataclass(frozen=True)
class ScaledType:
    """One ggml block type in scaled-codes form (module docstring).

    shape:  a block's codes as `parts` lays them out (their product: the type's block), the last
            dimension the one along which code bytes are contiguous and the scale is constant.
    parts:  (blocks [..., nbytes] of uint8 or int8, *tables) -> codes float32 [..., *shape] in the
            weights' order, scale [..., *shape[:-1] or 1s, 1], offset like scale or None.
    tables: the type's constant tables (packed grids), built once on the CPU.
    group_dims: how many trailing dimensions of `shape` one scale covers (its scale's trailing 1s):
            the fused product sums over them first.
    """

    name: str
    shape: tuple[int, ...]
    parts: Callable[..., Parts]
    tables: Callable[[], tuple[torch.Tensor, ...]] = field(default=lambda: ())
    group_dims: int = 1

    @property
    def block(self) -> int:
        return math.prod(self.shape)



def byte(blocks: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Bytes [lo, hi) of each block as int32 [..., hi - lo] (0..255 whether the view is uint8 or int8)."""
    widened = blocks[..., lo:hi].to(torch.int32)
    return widened if blocks.dtype == torch.uint8 else widened & 0xFF


def half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian float16 at bytes [at, at + 2) of each block, as float32 [...] (read through a
    float16 view where every block's two bytes start at an even byte of the storage, which inductor loads
    and widens in vectors; from the bytes in arithmetic where the blocks are row tiles, their bytes a
    tile's width apart, or where a span's rows start at an odd byte of the file's mapping)."""
    field = blocks[..., at : at + 2]
    # under torch.compile the graph's stored inputs are taken to start at an even byte (dynamo does not
    # trace storage_offset; an odd one fails the view as the graph is made, and the layer decodes eagerly)
    even = at % 2 == 0 if torch.compiler.is_compiling() else field.storage_offset() % 2 == 0
    if field.stride(-1) == 1 and even and all(st % 2 == 0 for st in field.stride()[:-1]):
        return field.view(torch.float16)[..., 0].float()
    bits = byte(blocks, at, at + 1)[..., 0] | (byte(blocks, at + 1, at + 2)[..., 0] << 8)
    return float16_value(bits) if blocks.stride(-1) != 1 else float16_of(bits)


def float16_value(bits: torch.Tensor) -> torch.Tensor:
    """int32 holding a float16's 16 bits -> its value as float32, by a bit cast: the exponent and
    mantissa shifted 13 left (the sign to bit 31) read as float32 the value times 2^-112 (a float16
    subnormal lands on a float32 subnormal of the same value times 2^-112), and 2^112 (exact) scales
    it; the all-ones exponent is inf or NaN. An int32-to-float32 bit cast runs in inductor's vector
    code (an int16-to-float16 one does not: fp8.py)."""
    v = (((bits & 0x7FFF) << 13) | ((bits & 0x8000) << 16)).view(torch.float32) * FLOAT16_BITS_SCALE
    special = torch.where((bits & 0x3FF) == 0, v * math.inf, math.nan)  # v is +-2^16 there: +-inf
    return torch.where((bits & 0x7C00) == 0x7C00, special, v)


def float16_of(bits: torch.Tensor) -> torch.Tensor:
    """int32 holding a float16's 16 bits -> its value as float32."""
    return bits.to(torch.int16).view(torch.float16).float()


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] (int32) -> [..., 2, n]: their low nibbles, then their high nibbles."""
    return spread(codes, 2, 4, 0xF)


def words16(blocks: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Bytes [lo, hi) read as little-endian uint16s, int32 [..., (hi - lo) / 2]."""
    b = byte(blocks, lo, hi)
    return b[..., 0::2] | (b[..., 1::2] << 8)


def words32(blocks: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Bytes [lo, hi) read as little-endian uint32s, int64 [..., (hi - lo) / 4] (no sign wraps)."""
    b = byte(blocks, lo, hi).to(torch.int64)
    return b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)


def spread(values: torch.Tensor, count: int, step: int, mask: int) -> torch.Tensor:
    """values [..., n] -> [..., count, n]: (values >> step i) & mask for i < count, the shift outermost
    (the shifts an iota, which inductor folds into its loop index)."""
    shifts = torch.arange(0, count * step, step, dtype=values.dtype, device=values.device)[:, None]
    return (values[..., None, :] >> shifts) & mask


def bits_of(values: torch.Tensor, count: int) -> torch.Tensor:
    """values [..., n] -> [..., n, count]: bit k of each value at position k (the lowest first)."""
    s = torch.arange(count, dtype=values.dtype, device=values.device)
    return (values[..., None] >> s) & 1


def signs_of(bits: torch.Tensor) -> torch.Tensor:
    """Sign bits (1: negative) -> float32 +-1."""
    return 1.0 - 2.0 * bits.float()


def parity_signs(index: torch.Tensor) -> torch.Tensor:
    """IQ2/IQ3's 7-bit sign indices [..., n] -> their 8 sign bits [..., n, 8]: the index's seven bits, and
    an eighth that makes the count of negatives even (llama.cpp's `ksigns` table, computed)."""
    p = index ^ (index >> 4)
    p = p ^ (p >> 2)
    p = (p ^ (p >> 1)) & 1
    return torch.cat((bits_of(index, 7), p[..., None]), dim=-1)


def own_tables(kind: ScaledType, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The type's tables on `device` (the blocks')."""
    return tuple(t.to(device) for t in kind.tables())


def scaled_weight(kind: ScaledType, blocks: torch.Tensor, *tables: torch.Tensor) -> torch.Tensor:
    """blocks [..., nbytes] -> float32 weights [..., block] (the reference's arithmetic); the type's own
    tables unless given (a compiled graph passes them as inputs)."""
    codes, scale, offset = kind.parts(blocks, *(tables or own_tables(kind, blocks.device)))
    w = scale * codes
    if offset is not None:
        w = w - offset
    return w.reshape(*blocks.shape[:-1], kind.block)


def scaled_tile_rows(kind: ScaledType, nbytes: int, x: torch.Tensor, tiles: torch.Tensor, *tables: torch.Tensor
                     ) -> torch.Tensor:
    """x [R, K] float32 @ W^T for W's row tiles [T, row bytes, width] (kernels/row_tiles.py) of blocks of
    `nbytes` -> [R, T width],
    factored per group as `scaled_rows`, along the tiles' lanes: each group's codes times the inputs summed
    first (a reduction whose every load is contiguous, the width innermost), then times its scale."""
    t, row, width = tiles.shape
    nb = row // nbytes
    blocks = tiles.view(t, nb, nbytes, width).permute(0, 3, 1, 2)  # [T, width, nb, nbytes]: a view
    codes, scale, offset = kind.parts(blocks, *(tables or own_tables(kind, tiles.device)))  # [T, width, nb, *shape]
    group = kind.group_dims
    inner = tuple(range(-group - 1, -1))  # a scale's group, the lanes after it
    per_group = scale.shape[: scale.dim() - group]  # [T, width, nb, groups...]
    xs = x.view(x.shape[0], 1, 1, nb, *kind.shape)
    dots = (xs * codes).movedim(2, -1).sum(inner)  # [R, T, nb, groups..., width]
    y = (dots * scale.reshape(per_group).movedim(1, -1)).flatten(2, -2).sum(2)  # [R, T, width]
    if offset is not None:
        sums = x.view(x.shape[0], 1, nb, *kind.shape).sum(tuple(range(-group, 0)))[..., None]  # [R, 1, nb, groups..., 1]
        y = y - (sums * offset.reshape(per_group).movedim(1, -1)).flatten(2, -2).sum(2)
    return y.reshape(x.shape[0], -1)


def scaled_rows(kind: ScaledType, x: torch.Tensor, blocks: torch.Tensor, *tables: torch.Tensor) -> torch.Tensor:
    """x [R, K] float32 @ W^T for W's blocks [N, K / block, nbytes] -> [R, N], factored per group
    (module docstring)."""
    codes, scale, offset = kind.parts(blocks, *(tables or own_tables(kind, blocks.device)))  # [N, nb, *shape]
    xs = x.view(x.shape[0], 1, blocks.shape[1], *kind.shape)  # [R, 1, nb, *shape]
    group = kind.group_dims
    inner = tuple(range(-group, 0))  # the dimensions of one scale's group: summed first
    per_group = scale.shape[: scale.dim() - group]  # [N, nb, groups...]
    y = ((xs * codes).sum(inner) * scale.reshape(per_group)).flatten(2).sum(-1)
    if offset is not None:
        y = y - (xs.sum(inner) * offset.reshape(per_group)).flatten(2).sum(-1)
    return y
