"""Q4_K and Q5_K's compiled one-row product over their row tiles, every tensor with the tile's lanes last.

Held as row tiles (kernels/row_tiles.py), a Q4_K or Q5_K matrix is `[T, nb * nbytes, width]`: byte j
of a block of 16 rows side by side. ggml/scaled.py's general tile product reads each block's parts
through a view that puts the lanes before the bytes, and for these two types inductor then materialises
the decoded scales in that order and loops over the rows one lane at a time (transposes of 4 bytes;
measured, a 2816 x 1024 matrix, one thread: Q4_K 0.58x float32's product, where the blocks as stored
take 0.78x: a horizontal sum per 32 weights and a scalar scale decode per row). Here every tensor keeps
the lanes last, so each loop inductor writes runs along the lanes with contiguous loads:

- the codes: sub-block s = 2 c + h of a Q4_K block is nibble h of bytes 16 + 32 c .. + 32 (Q5_K: of
  bytes 48 + 32 c .., with bit s of byte 16 + l above it as its fifth bit); per sub-block, the codes
  times the inputs are summed first (`dots`, one float per sub-block and lane: a vector multiply-add
  per code nibble per 16 rows, the inputs broadcast), a byte's two nibbles by two sums in one loop
  (one load feeds both, and two independent accumulators halve the chain of dependent adds:
  measured 1.02 -> 1.07x float32's for Q4_K, 0.87 -> 0.94x for Q5_K; all eight sub-blocks' sums in
  one loop measured no better);
- the scales: each sub-block's six-bit scale and min (llama.cpp's get_scale_min_k4, as
  ggml/kquants.py `_k_header` selects them) times d and dmin, float16s read in arithmetic (no bit
  cast: scaled.py `float16_value`), once per sub-block and 16 rows, in vectors;
- y = sum over sub-blocks of scale * dots - min * (the inputs' sum over the sub-block), the inputs'
  sums computed once per call.

The weights are the reference's (`scale * q - min`, ggml/kquants.py); only the order of the float32
sum differs (the tests hold the product to the dequantized weight's).
"""

from __future__ import annotations

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


def _nibble_shifts(device: torch.device) -> torch.Tensor:
    return (4 * torch.arange(2, dtype=torch.int32, device=device))[:, None, None]  # [h, 1, 1]


def q4_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """int32 [T, nb, 4, 2, 32, width]: nibble h of byte 16 + 32 c + l."""
    t, nb, _, width = blocks.shape
    qs = lane_bytes(blocks, 16, 144).view(t, nb, 4, 1, SUB, width)
    return (qs >> _nibble_shifts(blocks.device)) & 0xF


def q5_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """int32 [T, nb, 4, 2, 32, width]: nibble h of byte 48 + 32 c + l, bit 2 c + h of byte 16 + l above."""
    t, nb, _, width = blocks.shape
    qs = lane_bytes(blocks, 48, 176).view(t, nb, 4, 1, SUB, width)
    qh = lane_bytes(blocks, 16, 48).view(t, nb, 1, 1, SUB, width)
    s = torch.arange(8, dtype=torch.int32, device=blocks.device).view(4, 2, 1, 1)  # sub-block 2 c + h
    return ((qs >> _nibble_shifts(blocks.device)) & 0xF) | (((qh >> s) & 1) << 4)


K_LANE_CODES = {"Q4_K": (144, q4_k_codes), "Q5_K": (176, q5_k_codes)}


def k_tile_rows(kind: str, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """x [R, K] float32 @ W^T for W's row tiles uint8 [T, K / 256 * nbytes, width] of Q4_K or Q5_K blocks
    -> [R, T width] (module docstring)."""
    nbytes, codes_of = K_LANE_CODES[kind]
    t, row, width = tiles.shape
    nb = row // nbytes
    blocks = tiles.view(t, nb, nbytes, width)
    scale, low = k_scales(blocks)  # [T, nb, 4, 2, width]
    xs = x.view(x.shape[0], 1, nb, *SUB_BLOCKS, SUB, 1)
    codes = codes_of(blocks).float()
    # a byte's two nibbles summed by two reductions over the same loop (one load, two independent sums)
    dots = torch.stack([(xs[:, :, :, :, h] * codes[:, :, :, h]).sum(-2) for h in range(2)], dim=4)  # [R, T, nb, 4, 2, width]
    sums = x.view(x.shape[0], 1, nb, *SUB_BLOCKS, SUB).sum(-1)[..., None]  # [R, 1, nb, 4, 2, 1]
    return (dots * scale - sums * low).sum((2, 3, 4)).reshape(x.shape[0], -1)
