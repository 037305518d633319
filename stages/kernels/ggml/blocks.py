"""GGUF (ggml) block types, dequantized from their bytes in torch: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K here,
and every lower type (Q2_K, Q3_K, the IQ types, MXFP4, NVFP4) as scaled codes (ggml/scaled.py).

A GGUF matrix [N, K] is N rows of K / block blocks, each block `nbytes` bytes
(families/shipped.py GGML_TYPES); a row's blocks are contiguous, so the stored tensor is
uint8 [N, K / block * nbytes] and rows [lo, hi) are its rows [lo, hi). Each function below
turns such rows into float32 [r, K] with the arithmetic of llama.cpp's `dequantize_row_*`,
in the order the gguf package's numpy dequantizers compute it (so that the two agree bit
for bit; the tests hold them to that):

    Q8_0  (34 B / 32)   d f16, 32 int8 q               w = q * d
    Q4_0  (18 B / 32)   d f16, 16 B of nibbles         w = d * (q - 8)      low nibbles: the first 16
    Q4_1  (20 B / 32)   d, m f16, 16 B of nibbles      w = d * q + m
    Q4_K  (144 B / 256) d, dmin f16; 12 B of 6-bit scales and mins for 8 sub-blocks of 32;
                        128 B of nibbles (per 64 weights: the low nibbles the first 32)
                        w = (d * sc_j) * q - dmin * m_j
    Q5_K  (176 B / 256) as Q4_K plus 32 B of fifth bits (bit j of byte i: sub-block j, weight i)
    Q6_K  (210 B / 256) 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales (per 16), d f16
                        w = (d * sc_j) * (q - 32)

These are the reference (a span's `dequantized` weight); the span keeps the bytes, and
`GgmlLinear` (ggml/linear.py) widens rows of them fast, to the same values.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from tessera.stages.families.shipped import GGML_TYPES, GgmlType
from tessera.stages.kernels.ggml.fp4 import FP4_TYPES
from tessera.stages.kernels.ggml.iq import IQ_TYPES
from tessera.stages.kernels.ggml.kquants import K_QUANTS
from tessera.stages.kernels.ggml.scaled import ScaledType, byte, half, nibbles, scaled_weight

K_SCALE_BYTES = 12  # Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins
QK_K = 256


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at bytes [at, at + 2) of each block of `raw` [r, nb, nbytes], as float32 [r, nb, 1]."""
    return raw[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, span: int) -> torch.Tensor:
    """Bytes [..., n] -> codes [..., 2 n]: per run of `span` bytes, its low nibbles then its high ones."""
    *lead, n = qs.shape
    runs = qs.reshape(*lead, n // span, 1, span)
    return torch.cat((runs & 0x0F, runs >> 4), dim=-2).reshape(*lead, 2 * n)


def q8_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw, 0)
    return raw[..., 2:].view(torch.int8).float() * d


def q4_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw, 0)
    q = _nibbles(raw[..., 2:], 16).view(torch.int8) - 8
    return d * q.float()


def q4_1(raw: torch.Tensor) -> torch.Tensor:
    d, m = _f16(raw, 0), _f16(raw, 2)
    return d * _nibbles(raw[..., 4:], 16).float() + m


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> six-bit scales and mins [..., 8] (llama.cpp's get_scale_min_k4)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mins


def q4_k(raw: torch.Tensor) -> torch.Tensor:
    *lead, _ = raw.shape
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mins = k_scales(raw[..., 4 : 4 + K_SCALE_BYTES])
    scale = (d * sc.float())[..., None]  # [..., 8, 1]
    low = (dmin * mins.float())[..., None]
    q = _nibbles(raw[..., 16:], 32).reshape(*lead, 8, 32).float()
    return (scale * q - low).reshape(*lead, QK_K)


def q5_k(raw: torch.Tensor) -> torch.Tensor:
    *lead, _ = raw.shape
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mins = k_scales(raw[..., 4 : 4 + K_SCALE_BYTES])
    scale = (d * sc.float())[..., None]
    low = (dmin * mins.float())[..., None]
    qh = raw[..., 16:48]  # [..., 32]: bit j of byte i is weight i of sub-block j
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)[:, None]
    high = (qh[..., None, :] >> shifts) & 1  # [..., 8, 32]
    q = _nibbles(raw[..., 48:], 32).reshape(*lead, 8, 32) | (high << 4)
    return (scale * q.float() - low).reshape(*lead, QK_K)


def q6_k(raw: torch.Tensor) -> torch.Tensor:
    *lead, _ = raw.shape
    ql, qh = raw[..., 0:128], raw[..., 128:192]
    scales = raw[..., 192:208].view(torch.int8).float()
    d = _f16(raw, 208)
    scale = (d * scales)[..., None]  # [..., 16, 1]
    low = _nibbles(ql, 64).reshape(*lead, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)[:, None]
    high = ((qh.reshape(*lead, 2, 1, 32) >> shifts) & 3).reshape(*lead, 8, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(*lead, 16, 16).float()
    return (scale * q).reshape(*lead, QK_K)


def q8_0_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Q8_0 as scaled codes: its 32 int8 codes (read as int32 from uint8 or int8 bytes, the sign restored
    by arithmetic) and d, one group (the compiled product of its row tiles: ggml/linear.py TILED)."""
    codes = blocks[..., 2:34].to(torch.int32)
    if blocks.dtype == torch.uint8:
        codes = codes - ((codes & 0x80) << 1)
    return codes.float(), half(blocks, 0)[..., None], None


def q4_0_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Q4_0 as scaled codes [..., 2, 16] (the low nibbles the first 16 weights): q - 8, times d."""
    return (nibbles(byte(blocks, 2, 18)) - 8).float(), half(blocks, 0)[..., None, None], None


def q4_1_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 as scaled codes [..., 2, 16]: q times d, less -m (d q + m exactly: a negation is exact)."""
    return nibbles(byte(blocks, 4, 20)).float(), half(blocks, 0)[..., None, None], -half(blocks, 2)[..., None, None]


# Every type with a scaled-codes form (ggml/scaled.py): the low-bit types' only form; for the types with a
# reference of their own above, the compiled weight (`fused_weight`) and, where ggml/linear.py's
# TILE_PRODUCTS has none of their own, the compiled product (their eager product stays ggml/linear.py's
# split order)
SCALED_TYPES: dict[str, ScaledType] = {
    **K_QUANTS, **IQ_TYPES, **FP4_TYPES, "Q8_0": ScaledType("Q8_0", (32,), q8_0_parts),
    "Q4_0": ScaledType("Q4_0", (2, 16), q4_0_parts, group_dims=2), "Q4_1": ScaledType("Q4_1", (2, 16), q4_1_parts, group_dims=2),
}

OWN_REFERENCE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
}
DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    **{name: partial(scaled_weight, kind) for name, kind in SCALED_TYPES.items()}, **OWN_REFERENCE,
}
assert set(DEQUANTIZE) == {n for n, t in GGML_TYPES.items() if not t.is_float}, "every block type has its dequantizer"


def ggml_rows(raw: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """Rows of a ggml matrix, uint8 [r, K / block * nbytes] -> float32 [r, K] (the reference's arithmetic)."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, kind.nbytes)  # [r, K / block, nbytes]
    return DEQUANTIZE[kind.name](blocks).reshape(r, -1)
