"""The compiled one-row product of the ggml types whose code bytes hold two 4-bit codes, a scale group's
low nibbles its first half of weights and the high nibbles its second: Q4_0, Q4_1, IQ4_NL, IQ4_XS and
llama.cpp's MXFP4 and NVFP4, held as row tiles (kernels/row_tiles.py).

Such a block is `header` bytes (its scales) and then `groups` runs of `half` code bytes:

    type     block      header                               groups x half   w
    Q4_0     18 B / 32  d f16                                1 x 16          d (q - 8)
    Q4_1     20 B / 32  d, m f16                             1 x 16          d q + m
    IQ4_NL   18 B / 32  d f16                                1 x 16          d KVALUES[q]
    IQ4_XS  136 B / 256 d f16, 8 six-bit scales              8 x 16          d (sc - 32) KVALUES[q]
    MXFP4    17 B / 32  an e8m0 exponent                     1 x 16          2^(e - 128) FP4x2[q]
    NVFP4    36 B / 64  4 unsigned e4m3 scales               4 x 8           ue4m3 / 2 FP4x2[q]

(ggml/blocks.py, iq.py and fp4.py give each type's reference.) `pair_tile_rows` reads each code byte
once, as int32 from its int8 view, and makes both its values from it (`values`: for e2m1 a bit cast,
ggml/fp4.py; for IQ4 its quartic, ggml/iq.py): the low value times the group's input i and the high
one times input half + i, summed over the group along the tile's lanes (16 rows a vector, every load
contiguous, the inputs broadcast), then times the group's scale, less its offset times the inputs'
sum over the group. The general scaled-codes product (ggml/scaled.py `scaled_tile_rows`) instead cuts
each nibble from its byte apart, the codes laid out in the weights' order. Each code's value and each
scale are the reference's; the product differs from the dequantized weight's in the order of the
float32 sum, and where a type has an offset (Q4_1's m) in taking it times the inputs' sum apart, as
ggml/scaled.py's product does (the tests hold it to the dequantized weight's product).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tessera.stages.kernels.ggml.fp4 import e8m0_half, fp4_byte_values, ue4m3_half
from tessera.stages.kernels.ggml.iq import iq4_values
from tessera.stages.kernels.ggml.k_lanes import lane_bytes, lane_half

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PairType:
    """values(code bytes, int32 sign-extended from int8) -> (low, high) float32;
    scales(blocks uint8 [T, nb, nbytes, width]) -> scale [T, nb, groups, width] from the header bytes,
    offset like it or None (w = scale * value - offset)."""

    header: int
    groups: int
    half: int
    values: Callable[[torch.Tensor], Pair]
    scales: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]

    @property
    def nbytes(self) -> int:
        return self.header + self.groups * self.half


def _nibble_values(value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Pair]:
    """A 4-bit code's value function -> a byte's (low, high) values."""
    return lambda b: (value(b & 0xF), value((b >> 4) & 0xF))


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at bytes [at, at + 2) of each block -> float32 [T, nb, 1, width] (a group's scale)."""
    return lane_half(blocks, at)[:, :, None]


def _iq4_xs_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, None]:
    """d (sc - 32) per 32 weights: scale 2 i + a is byte 4 + i's nibble a with bits 2 (2 i + a) of the
    uint16 at bytes 2, 3 above it."""
    t, nb, _, width = blocks.shape
    nibbles = lane_bytes(blocks, 4, 8)
    low = torch.stack((nibbles & 0xF, nibbles >> 4), dim=3).reshape(t, nb, 8, width)
    words = lane_bytes(blocks, 2, 3) | (lane_bytes(blocks, 3, 4) << 8)  # [T, nb, 1, width]
    high = (words >> (2 * torch.arange(8, dtype=torch.int32, device=blocks.device))[:, None]) & 3
    return _f16(blocks, 0) * ((low | (high << 4)) - 32).float(), None


PAIR_TYPES = {
    "Q4_0": PairType(2, 1, 16, _nibble_values(lambda q: (q - 8).float()), lambda b: (_f16(b, 0), None)),
    "Q4_1": PairType(4, 1, 16, _nibble_values(lambda q: q.float()), lambda b: (_f16(b, 0), -_f16(b, 2))),
    "IQ4_NL": PairType(2, 1, 16, _nibble_values(iq4_values), lambda b: (_f16(b, 0), None)),
    "IQ4_XS": PairType(8, 8, 16, _nibble_values(iq4_values), _iq4_xs_scales),
    "MXFP4": PairType(1, 1, 16, fp4_byte_values, lambda b: (e8m0_half(lane_bytes(b, 0, 1)), None)),
    "NVFP4": PairType(4, 4, 8, fp4_byte_values, lambda b: (ue4m3_half(lane_bytes(b, 0, 4)), None)),
}


def pair_tile_rows(name: str, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """x [R, K] float32 @ W^T for W's row tiles uint8 [T, K / block * nbytes, width] of `name`'s blocks
    -> [R, T width] (module docstring)."""
    kind = PAIR_TYPES[name]
    t, row, width = tiles.shape
    r, groups, half = x.shape[0], kind.groups, kind.half
    blocks = tiles.view(t, row // kind.nbytes, kind.nbytes, width)
    codes = blocks.view(torch.int8)[:, :, kind.header :, :].to(torch.int32)  # sign-extended (`values`)
    low, high = kind.values(codes.view(t, -1, groups, half, width))
    xs = x.view(r, 1, -1, groups, 2, half, 1)  # [R, 1, nb, groups, low/high, half, 1]
    dots = (xs[..., 0, :, :] * low + xs[..., 1, :, :] * high).sum(-2)  # [R, T, nb, groups, width]
    scale, offset = kind.scales(blocks)  # [T, nb, groups, width]
    y = dots * scale
    if offset is not None:
        y = y - x.view(r, 1, -1, groups, 2 * half).sum(-1)[..., None] * offset
    return y.sum((2, 3)).reshape(r, -1)
