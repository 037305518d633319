"""The k-quants' (Q2_K .. Q6_K) compiled one-row product over their row tiles, every tensor with the
tile's lanes last.

Held as row tiles (kernels/row_tiles.py), a k-quant matrix is `[T, nb * nbytes, width]`: byte j of a
block of 16 rows side by side. ggml/scaled.py's general tile product reads each block's parts through a
view that puts the lanes before the bytes; for Q4_K and Q5_K inductor then materialises the decoded
scales in that order and loops over the rows one lane at a time (transposes of 4 bytes; measured, a
2816 x 1024 matrix, one thread: Q4_K 0.58x float32's product, where the blocks as stored take 0.78x: a
horizontal sum per 32 weights and a scalar scale decode per row). Here every tensor keeps the lanes
last, so each loop inductor writes runs along the lanes with contiguous loads (`LaneType`):

- the codes: each group's (a sub-block of 16 or 32 weights with one scale) codes, shifted and masked
  out of their bytes (Q4_K's sub-block 2 c + h is nibble h of bytes 16 + 32 c ..; each type's `parts`
  says its layout), times the inputs are summed first (`dots`, one float per group and lane: a vector
  multiply-add per code per 16 rows, the inputs broadcast), the codes one byte holds by as many sums
  in one loop (one load feeds them, and independent accumulators shorten the chain of dependent adds:
  measured 1.02 -> 1.07x float32's for Q4_K, 0.87 -> 0.94x for Q5_K; all eight sub-blocks' sums in
  one loop measured no better);
- the scales: each group's scale (and min) decoded from its bytes (six-bit scales and mins as
  llama.cpp's get_scale_min_k4 and ggml/kquants.py select them, Q6_K's int8s, Q2_K's nibbles) times
  d (and dmin), float16s read by an int32 bit cast (scaled.py `float16_value`), once per group
  and 16 rows, in vectors;
- y = sum over groups of scale * dots - low * (the inputs' sum over the group), the inputs' sums
  computed once per call; a constant offset of the codes (Q6_K's 32, Q3_K's 4) is in `low`.

Measured, a 2816 x 1024 matrix against the general product, one thread, a loaded machine (so
provisional): Q2_K the same (0.97 and 1.02x float32's); a synth-k span compiled (bench/shipped.py):
Q4_K 1.38x float32's, Q2_K 1.36x (`LANE_TYPES` says why only these two take this form; Q5_K has a
product of its own, `q5_k_rows`).
The weights are the reference's (`scale * q - low`, ggml/kquants.py); only the order of the float32
sum differs (the tests hold the product to the dequantized weight's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from tessera.stages.kernels.ggml.scaled import float16_value

SUB_BLOCKS = (4, 2)  # a super-block's 8 sub-blocks of 32 as (c, h): sub-block 2 c + h
SUB = 32


def lane_bytes(blocks: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Bytes [lo, hi) of each block of `blocks` uint8 [T, nb, nbytes, width] -> int32 [T, nb, hi - lo, width]."""
    return blocks[:, :, lo:hi, :].to(torch.int32)


def lane_half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at bytes [at, at + 2) of each block -> float32 [T, nb, width] (arithmetic: exact)."""
    return float16_value(blocks[:, :, at, :].to(torch.int32) | (blocks[:, :, at + 1, :].to(torch.int32) << 8))


def k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: d * scale and dmin * min of each sub-block, float32 [T, nb, 4, 2, width] (sub-block
    2 c + h at [c, h]). Sub-block i < 4 has the low six bits of bytes 4 + i and 8 + i; sub-block 4 + i
    byte 12 + i's nibbles with the top two bits of bytes 4 + i, 8 + i above them."""
    t, nb, _, width = blocks.shape
    d, m, m_d = (lane_bytes(blocks, at, at + 4)[:, :, None] for at in (4, 8, 12))  # [T, nb, 1, 4, width]
    upper = (torch.arange(2, device=blocks.device) == 1)[:, None, None]  # [2, 1, 1]: sub-blocks 4..7
    sc = torch.where(upper, (m_d & 0x0F) | ((d >> 2) & 0x30), d & 0x3F)  # [T, nb, 2, 4, width]
    mins = torch.where(upper, (m_d >> 4) | ((m >> 2) & 0x30), m & 0x3F)
    d_all, d_min = lane_half(blocks, 0)[:, :, None, None], lane_half(blocks, 2)[:, :, None, None]
    return ((d_all * sc.float()).reshape(t, nb, *SUB_BLOCKS, width),
            (d_min * mins.float()).reshape(t, nb, *SUB_BLOCKS, width))


def _shifts(device: torch.device, step: int, *shape: int) -> torch.Tensor:
    """int32 step * [0, 1, ...] shaped `shape` (inductor folds the iota into its loop index)."""
    return (step * torch.arange(math.prod(shape), dtype=torch.int32, device=device)).view(*shape)


@dataclass(frozen=True)
class LaneType:
    """A k-quant's product along its tiles' lanes. `parts(blocks [T, nb, nbytes, width])` -> codes int32
    [T, nb, *groups, sub, width] (the weights' order: `groups` of `sub` weights), scale and low float32
    [T, nb, *groups, width], each weight scale * code - low; `together`: the group axis whose sums one
    loop makes (the values one code byte holds)."""

    nbytes: int
    groups: tuple[int, ...]
    sub: int
    together: int
    parts: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [T, nb, 4, 2, 32, width]: nibble h of byte 16 + 32 c + l."""
    t, nb, _, width = blocks.shape
    qs = lane_bytes(blocks, 16, 144).view(t, nb, 4, 1, SUB, width)
    return (qs >> _shifts(blocks.device, 4, 2, 1, 1)) & 0xF, *k_scales(blocks)


def q2_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [T, nb, 2, 4, 2, 16, width]: weight 128 h + 32 j + 16 half + l is bits 2 j of byte
    16 + 32 h + 16 half + l; scale and min 8 h + 2 j + half the nibbles of its byte, times d and dmin."""
    t, nb, _, width = blocks.shape
    qs = lane_bytes(blocks, 16, 80).view(t, nb, 2, 1, 2, 16, width)
    sc = lane_bytes(blocks, 0, 16).view(t, nb, 2, 4, 2, width)
    scale = lane_half(blocks, 80)[:, :, None, None, None] * (sc & 0xF).float()
    low = lane_half(blocks, 82)[:, :, None, None, None] * (sc >> 4).float()
    return (qs >> _shifts(blocks.device, 2, 4, 1, 1, 1)) & 3, scale, low


# Q5_K, Q3_K and Q6_K formed so (their fifth or high bits or-ed in) are as fast alone (a 2816 x 1024 matrix:
# 0.95-1.1x float32's) but not inside a layer's graph (bench/shipped.py's synth-k span, compiled: Q5_K 0.27-0.42x,
# Q3_K 0.50x, Q6_K 0.37x float32's, where Q4_K was 1.38x and Q2_K 1.36x): Q3_K and Q6_K keep scaled.py's
# product, Q5_K has `q5_k_rows` (its fifth bits a product apart, never or-ed in)
LANE_TYPES = {"Q4_K": LaneType(144, SUB_BLOCKS, SUB, 1, q4_k), "Q2_K": LaneType(84, (2, 4, 2), 16, 1, q2_k)}


def lane_tile_rows(name: str, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """x [R, K] float32 @ W^T for W's row tiles uint8 [T, K / 256 * nbytes, width] of k-quant blocks `name`
    -> [R, T width] (module docstring)."""
    kind = LANE_TYPES[name]
    t, row, width = tiles.shape
    nb, r, a, g = row // kind.nbytes, x.shape[0], kind.together, len(kind.groups)
    codes, scale, low = kind.parts(tiles.view(t, nb, kind.nbytes, width))
    codes = codes.float()
    xs = x.view(r, 1, nb, *kind.groups, kind.sub, 1)
    # the values of one code byte summed by reductions over the same loop (one load, independent sums)
    dots = torch.stack([(xs.select(3 + a, i) * codes.select(2 + a, i)).sum(-2) for i in range(kind.groups[a])],
                       dim=3 + a)  # [R, T, nb, *groups, width]
    sums = x.view(r, 1, nb, *kind.groups, kind.sub).sum(-1)[..., None]  # [R, 1, nb, *groups, 1]
    return (dots * scale - sums * low).sum(tuple(range(2, 3 + g))).reshape(r, -1)


def q5_k_rows(x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """x [R, K] float32 @ W^T for W's row tiles uint8 [T, K / 256 * 176, width] of Q5_K blocks -> [R, T width].

    A Q5_K code is a nibble and a fifth bit from another byte (ggml/kquants.py `q5_k`), so x . w =
    sum_g scale_g (x_g . low_g + 16 x_g . high_g) - min_g sum(x_g): the nibbles and the fifth bits are
    two products, each over its own bytes read once (a nibble byte holds two codes' low bits, a high
    byte eight codes' fifth bits: as many sums in one loop), never or-ed together weight by weight (the
    form that was slow inside a layer's graph, LANE_TYPES). Weight 64 c + 32 h + l has nibble h of byte
    48 + 32 c + l, bit 2 c + h of byte 16 + l, and sub-block 2 c + h's scale and min."""
    t, row, width = tiles.shape
    nb, r = row // 176, x.shape[0]
    blocks = tiles.view(t, nb, 176, width)
    low = lane_bytes(blocks, 48, 176).view(t, nb, 4, SUB, width)  # [T, nb, c, l, width]
    high = lane_bytes(blocks, 16, 48)  # [T, nb, l, width]
    xs = x.view(r, 1, nb, *SUB_BLOCKS, SUB, 1)  # [R, 1, nb, c, h, l, 1]
    lows = torch.stack([(xs[:, :, :, :, h] * ((low >> (4 * h)) & 0xF).float()).sum(-2) for h in range(2)], dim=4)
    highs = torch.stack([(xs[:, :, :, j // 2, j % 2] * ((high >> j) & 1).float()).sum(-2) for j in range(8)], dim=3)
    scale, least = k_scales(blocks)  # [T, nb, c, h, width]
    sums = x.view(r, 1, nb, *SUB_BLOCKS, SUB).sum(-1)[..., None]
    dots = lows + 16 * highs.view(r, t, nb, *SUB_BLOCKS, width)  # [R, T, nb, c, h, width]
    return (dots * scale - sums * least).sum((2, 3, 4)).reshape(r, -1)
