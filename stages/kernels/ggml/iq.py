"""llama.cpp's IQ types as scaled codes (ggml/scaled.py): the 1- to 4-bit "importance" quants that the
dynamic low-bit GGUF files of the large MoE models are made of.

    IQ2_XXS (66 B / 256)  d f16; per 32 weights 8 bytes: 4 grid indices (256 points of 8 values
                          in {8, 25, 43}), a uint32 holding 4 seven-bit sign indices and a 4-bit scale
                          w = (d (0.5 + s) / 4) grid[i] sign
    IQ2_XS  (74 B / 256)  d f16; 32 uint16: a 9-bit grid index (512 points), a 7-bit sign index;
                          8 bytes of 4-bit scales, one per 16 weights
    IQ2_S   (82 B / 256)  d f16; 32 grid index bytes, 32 bytes of sign bits, 8 bytes of two high
                          index bits each (1024 points), 8 bytes of 4-bit scales (per 16)
    IQ3_XXS (98 B / 256)  d f16; 64 grid indices (256 points of 4 values), per 32 weights a uint32 of
                          4 sign indices and a 4-bit scale      w = (d (0.5 + s) / 2) grid[i] sign
    IQ3_S  (110 B / 256)  d f16; 64 index bytes, 8 bytes of ninth bits (512 points of 4), 32 bytes
                          of sign bits, 4 bytes of 4-bit scales (per 32)   w = d (1 + 2 s) grid[i] sign
    IQ1_S   (50 B / 256)  d f16; 32 index bytes; per 32 weights a uint16: four 3-bit high index parts
                          (2048 points of 8 values in {-1, 0, 1}), a 3-bit scale, a delta sign
                          w = d (2 s + 1) (grid[i] +- 1/8)
    IQ1_M   (56 B / 256)  32 index bytes; 16 bytes: per 8 weights 3 high index bits and a delta sign;
                          4 uint16 of 3-bit scales (per 16) whose top nibbles are d's 16 bits
    IQ4_NL  (18 B / 32)   d f16; 16 bytes of nibbles (the low ones the first 16 weights) into a
                          16-value table                    w = d KVALUES[q]
    IQ4_XS (136 B / 256)  d f16; 6-bit scales per 32 (low nibbles in 4 bytes, two high bits each in a
                          uint16); 128 bytes of nibbles, per 32 weights as IQ4_NL's
                          w = (d (sc - 32)) KVALUES[q]

A sign index is seven sign bits, the eighth making the count of negatives even (llama.cpp's
`ksigns`, computed). The grids are llama.cpp's tables as the gguf package carries them (read once,
the reference's own numbers), each point packed into one int32 of 2- or 3-bit codes (`GRIDS`), so
that a compiled product gathers one int per point and computes its values; IQ4's 16-value table is
a quartic rounded (`IQ4_QUARTIC`). Each `parts` follows the gguf package's numpy dequantizer step
for step, so the reference agrees with it to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from tessera.stages.kernels.ggml.scaled import (
    ScaledType, bits_of, byte, float16_of, half, nibbles, parity_signs, signs_of, spread, words16, words32,
)

IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# IQ4_KVALUES[q] = round(p(q)) for this quartic (Horner, float32; a minimax fit, within 0.433 of every
# value: a table lookup is a gather per weight, which inductor does not vectorise; the test checks all 16)
IQ4_QUARTIC = (0.0015860428, 0.03108644, -1.371927, 24.17383, -126.56701)
IQ1_DELTA = 0.125


@dataclass(frozen=True)
class Grid:
    """An IQ type's lattice grid as ints: each point's `values` codes of `bits` bits packed in one int32
    (the lowest first), and `value(code)`, the grid value of a code, in integer arithmetic."""

    name: str  # the gguf package's class carrying the table
    bits: int
    values: int
    value: Callable[[torch.Tensor], torch.Tensor]


GRIDS = {
    "IQ2_XXS": Grid("IQ2_XXS", 2, 8, lambda c: 8 + 17 * c + (c >> 1)),  # 8, 25, 43
    "IQ2_XS": Grid("IQ2_XS", 2, 8, lambda c: 8 + 17 * c + (c >> 1)),
    "IQ2_S": Grid("IQ2_S", 2, 8, lambda c: 8 + 17 * c + (c >> 1)),
    "IQ3_XXS": Grid("IQ3_XXS", 3, 4, lambda c: 4 + 8 * c + 2 * ((c + 1) >> 3)),  # 4, 12, ..., 52, 62
    "IQ3_S": Grid("IQ3_S", 3, 4, lambda c: 2 * c + 1),  # 1, 3, ..., 15
    "IQ1_S": Grid("IQ1_S", 2, 8, lambda c: c - 1),  # -1, 0, 1
}


@lru_cache(maxsize=None)
def packed_grid(name: str) -> torch.Tensor:
    """The grid of IQ type `name` (the gguf package's table: the reference's own numbers) packed as
    GRIDS says, int32 [points]."""
    from gguf import quants

    spec = GRIDS[name]
    kind = getattr(quants, spec.name)
    kind.init_grid()
    values = torch.from_numpy(kind.grid.reshape(kind.grid_shape).copy())  # float32 [points, values]
    codes = torch.tensor([kind.grid_map.index(v) for v in values.flatten().tolist()], dtype=torch.int32)
    codes = codes.view(values.shape) << (spec.bits * torch.arange(spec.values, dtype=torch.int32))
    packed = codes.sum(-1, dtype=torch.int32)
    unpacked = spec.value((packed[:, None] >> (spec.bits * torch.arange(spec.values))) & ((1 << spec.bits) - 1))
    assert torch.equal(unpacked.float(), values), f"{name}: the packed grid reads back the table"
    return packed


def points(packed: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
    """Grid points `index` [...] -> their values, int32 [..., values] (a gather of one int per point)."""
    spec = GRIDS[name]
    word = packed[index]
    return spec.value(spread(word[..., None], spec.values, spec.bits, (1 << spec.bits) - 1)[..., 0])


def iq4_values(q: torch.Tensor) -> torch.Tensor:
    """IQ4 codes (int32, 0..15) -> IQ4_KVALUES[q] as float32 (IQ4_QUARTIC)."""
    x = q.float()
    v = torch.full_like(x, IQ4_QUARTIC[0])
    for c in IQ4_QUARTIC[1:]:
        v = v * x + c
    return torch.round(v)


def _grid(name: str):
    return lambda: (packed_grid(name),)


def _sign_indices(aux: torch.Tensor) -> torch.Tensor:
    """IQ2_XXS/IQ3_XXS's uint32s [..., g] -> their four 7-bit sign indices' sign bits [..., g, 4, 8]."""
    return parity_signs(spread(aux, 4, 7, 0x7F).transpose(-1, -2).to(torch.int32))


def iq2_xxs(blocks: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 8, 4, 8]: per 32 weights, 4 grid points of 8, each with a sign index."""
    lead = blocks.shape[:-1]
    q = byte(blocks, 2, 66).reshape(*lead, 8, 8)  # per 32 weights: 4 index bytes, then a uint32
    aux = words32(q[..., 4:8], 0, 4)[..., 0]  # [..., 8]
    scale = half(blocks, 0)[..., None] * (0.5 + (aux >> 28).float()) * 0.25
    return points(table, q[..., 0:4], "IQ2_XXS") * signs_of(_sign_indices(aux)), scale[..., None, None], None


def iq2_xs(blocks: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 16, 2, 8]: per 16 weights, 2 uint16s of a 9-bit point and a 7-bit sign index."""
    lead = blocks.shape[:-1]
    qs = words16(blocks, 2, 66).reshape(*lead, 16, 2)
    s = nibbles(byte(blocks, 66, 74)).transpose(-1, -2).reshape(*lead, 16)  # scale 2 i + a: byte i's nibble a
    scale = half(blocks, 0)[..., None] * (0.5 + s.float()) * 0.25
    return points(table, qs & 511, "IQ2_XS") * signs_of(parity_signs(qs >> 9)), scale[..., None, None], None


def iq2_s(blocks: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 16, 2, 8]: point i = 2 g + p is index byte i with bits 2 (i % 4) of byte i / 4 of
    the high bits above, its signs the bits of sign byte i."""
    lead = blocks.shape[:-1]
    qh = spread(byte(blocks, 66, 74), 4, 2, 3).transpose(-1, -2).reshape(*lead, 16, 2)  # point 4 i + a
    index = byte(blocks, 2, 34).reshape(*lead, 16, 2) | (qh << 8)
    s = nibbles(byte(blocks, 74, 82)).transpose(-1, -2).reshape(*lead, 16)
    scale = half(blocks, 0)[..., None] * (0.5 + s.float()) * 0.25
    signs = bits_of(byte(blocks, 34, 66).reshape(*lead, 16, 2), 8)  # [..., 16, 2, 8]
    return points(table, index, "IQ2_S") * signs_of(signs), scale[..., None, None], None


def iq3_xxs(blocks: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 8, 4, 2, 4]: per 32 weights, 4 sign indices of 8 weights, each 2 grid points of 4."""
    lead = blocks.shape[:-1]
    aux = words32(blocks, 66, 98)  # [..., 8]
    scale = half(blocks, 0)[..., None] * (0.5 + (aux >> 28).float()) * 0.5
    values = points(table, byte(blocks, 2, 66).reshape(*lead, 8, 4, 2), "IQ3_XXS")  # [..., 8, 4, 2, 4]
    signs = _sign_indices(aux).reshape(*lead, 8, 4, 2, 4)
    return values * signs_of(signs), scale[..., None, None, None], None


def iq3_s(blocks: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 8, 4, 2, 4]: point i = 8 g + 2 j + m is index byte i with bit i % 8 of high byte
    i / 8 above; sign byte 4 g + j's bits sign its 8 weights."""
    lead = blocks.shape[:-1]
    qh = bits_of(byte(blocks, 66, 74), 8).reshape(*lead, 8, 4, 2)
    index = byte(blocks, 2, 66).reshape(*lead, 8, 4, 2) | (qh << 8)
    s = nibbles(byte(blocks, 106, 110)).transpose(-1, -2).reshape(*lead, 8)
    scale = half(blocks, 0)[..., None] * (1 + 2 * s).float()
    signs = bits_of(byte(blocks, 74, 106), 8).reshape(*lead, 8, 4, 2, 4)
    return points(table, index, "IQ3_S") * signs_of(signs), scale[..., None, None, None], None


def iq1_s(blocks: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 8, 4, 8]: point 4 g + j is index byte 4 g + j with bits 3 j of uint16 g above."""
    lead = blocks.shape[:-1]
    qh = words16(blocks, 34, 50)  # [..., 8]
    scale = half(blocks, 0)[..., None] * (2 * ((qh >> 12) & 7) + 1).float()
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA)  # [..., 8]
    high = spread(qh, 4, 3, 7).transpose(-1, -2)  # [..., 8, 4]
    values = points(table, byte(blocks, 2, 34).reshape(*lead, 8, 4) | (high << 8), "IQ1_S")  # [..., 8, 4, 8]
    return values + delta[..., None, None], scale[..., None, None], None


def iq1_m(blocks: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 16, 2, 8]: point i = 2 t + p is index byte i with the low 3 bits of nibble p of
    byte t of the 16 above, the nibble's bit 3 its delta's sign; scale t per 16 weights."""
    lead = blocks.shape[:-1]
    sc = words16(blocks, 48, 56)  # [..., 4]
    d = float16_of((sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0xF0) | ((sc[..., 2] >> 4) & 0xF00) | (sc[..., 3] & 0xF000))
    s = spread(sc, 4, 3, 7).transpose(-1, -2).reshape(*lead, 16)  # scale 4 i + a
    scale = d[..., None] * (2 * s + 1).float()
    qh = nibbles(byte(blocks, 32, 48)).transpose(-1, -2)  # [..., 16, 2]
    delta = torch.where((qh & 0x08) == 0, IQ1_DELTA, -IQ1_DELTA)
    values = points(table, byte(blocks, 0, 32).reshape(*lead, 16, 2) | ((qh & 7) << 8), "IQ1_S")  # [..., 16, 2, 8]
    return values + delta[..., None], scale[..., None, None], None


def iq4_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 2, 16]: the low nibbles first."""
    return iq4_values(nibbles(byte(blocks, 2, 18))), half(blocks, 0)[..., None, None], None


def iq4_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 8, 2, 16]: per 32 weights, 16 bytes' low nibbles, then their high ones."""
    lead = blocks.shape[:-1]
    low = nibbles(byte(blocks, 4, 8)).transpose(-1, -2).reshape(*lead, 8)  # scale 2 i + a
    high = spread(words16(blocks, 2, 4), 8, 2, 3).reshape(*lead, 8)
    scale = half(blocks, 0)[..., None] * ((low | (high << 4)) - 32).float()
    return iq4_values(nibbles(byte(blocks, 8, 136).reshape(*lead, 8, 16))), scale[..., None, None], None


IQ_TYPES = {t.name: t for t in (
    ScaledType("IQ2_XXS", (8, 4, 8), iq2_xxs, _grid("IQ2_XXS"), 2), ScaledType("IQ2_XS", (16, 2, 8), iq2_xs, _grid("IQ2_XS"), 2),
    ScaledType("IQ2_S", (16, 2, 8), iq2_s, _grid("IQ2_S"), 2), ScaledType("IQ3_XXS", (8, 4, 2, 4), iq3_xxs, _grid("IQ3_XXS"), 3),
    ScaledType("IQ3_S", (8, 4, 2, 4), iq3_s, _grid("IQ3_S"), 3), ScaledType("IQ1_S", (8, 4, 8), iq1_s, _grid("IQ1_S"), 2),
    ScaledType("IQ1_M", (16, 2, 8), iq1_m, _grid("IQ1_S"), 2), ScaledType("IQ4_NL", (2, 16), iq4_nl, group_dims=2),
    ScaledType("IQ4_XS", (8, 2, 16), iq4_xs, group_dims=2),
)}
