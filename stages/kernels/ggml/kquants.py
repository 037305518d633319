"""The k-quants (llama.cpp's 256-weight super-blocks) as scaled codes (ggml/scaled.py): Q2_K and Q3_K,
the low-bit files' bulk, and Q4_K, Q5_K, Q6_K again for their fused compiled form.

    Q2_K (84 B / 256)   16 B of scales (low nibble: the scale, high: the min, per 16 weights),
                        64 B of 2-bit codes (per 128 weights: 32 bytes, bits 2j of byte l is weight
                        32 j + l), d and dmin f16            w = (d sc) q - dmin m
    Q3_K (110 B / 256)  32 B of high bits (bit j of byte l: weight 32 j + l), 64 B of 2-bit codes as
                        Q2_K's, 12 B of 6-bit scales (low nibbles in bytes 0-7, two high bits each in
                        bytes 8-11), d f16                   w = (d (sc - 32)) (q - 4 (1 - high bit))
    Q4_K, Q5_K, Q6_K    as ggml.py's docstring lays them out (groups of 32, 32 and 16 weights)

Each `parts` follows the gguf package's numpy dequantizer step for step (so the reference agrees
with it to the bit), in int32 over the block bytes.
"""

from __future__ import annotations

import torch

from tessera.stages.kernels.ggml.scaled import ScaledType, byte, half, nibbles, spread

QK_K = 256


def q2_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [..., 2, 4, 2, 16]: weight 128 h + 32 j + 16 half + l is bits 2 j of byte 32 h + 16 half + l."""
    lead = blocks.shape[:-1]
    sc = byte(blocks, 0, 16).reshape(*lead, 2, 4, 2, 1)  # per 16 weights, in order
    d, dmin = half(blocks, 80)[..., None, None, None, None], half(blocks, 82)[..., None, None, None, None]
    scale, offset = d * (sc & 0xF).float(), dmin * (sc >> 4).float()
    codes = spread(byte(blocks, 16, 80).reshape(*lead, 2, 1, 32), 4, 2, 3)  # [..., 2, 1, 4, 32]
    return codes.reshape(*lead, 2, 4, 2, 16).float(), scale, offset


def q3_scales(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes of scales (int32 [..., 12]) -> the 16 six-bit scales minus 32 [..., 16]: scale
    8 a + i is byte i's nibble a and, above it, bits 2 b of byte 8 + i for scale 4 b + i."""
    low = spread(sc[..., 0:8], 2, 4, 0xF).flatten(-2)
    high = spread(sc[..., 8:12], 4, 2, 3).flatten(-2)
    return (low | (high << 4)) - 32


def q3_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 2, 4, 2, 16] as Q2_K's, less 4 where bit 4 h + j of hmask byte 16 half + l is clear."""
    lead = blocks.shape[:-1]
    scale = half(blocks, 108)[..., None] * q3_scales(byte(blocks, 96, 108)).float()
    low = spread(byte(blocks, 32, 96).reshape(*lead, 2, 1, 32), 4, 2, 3).reshape(*lead, 2, 4, 2, 16)
    high = spread(byte(blocks, 0, 32), 8, 1, 1).reshape(*lead, 2, 4, 2, 16)  # bit 4 h + j of byte l
    return (low - ((high ^ 1) << 2)).float(), scale.reshape(*lead, 2, 4, 2, 1), None


def _k_header(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: d * scale and dmin * min per sub-block of 32, [..., 4, 2, 1]. The 12 bytes hold 8
    six-bit scales and mins (llama.cpp's get_scale_min_k4): sub-block i < 4 in the low six bits of
    bytes i and 4 + i; sub-block 4 + i in byte 8 + i's nibbles and the top two bits of bytes i, 4 + i.
    Selected by a broadcast `where` over [2, 4], not concatenated: inductor computes it in place."""
    lead = blocks.shape[:-1]
    d, m, m_d = (byte(blocks, at, at + 4)[..., None, :] for at in (4, 8, 12))  # [..., 1, 4] each
    upper = torch.arange(2, device=blocks.device)[:, None] == 1  # [2, 1]: sub-blocks 4..7
    sc = torch.where(upper, (m_d & 0x0F) | ((d >> 2) & 0x30), d & 0x3F)  # [..., 2, 4]
    mins = torch.where(upper, (m_d >> 4) | ((m >> 2) & 0x30), m & 0x3F)
    return ((half(blocks, 0)[..., None, None] * sc.float()).reshape(*lead, 4, 2, 1),
            (half(blocks, 2)[..., None, None] * mins.float()).reshape(*lead, 4, 2, 1))


def q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [..., 4, 2, 32]: per 64 weights, byte 32 c + l's low nibble, then its high nibble."""
    lead = blocks.shape[:-1]
    scale, offset = _k_header(blocks)
    return nibbles(byte(blocks, 16, 144).reshape(*lead, 4, 32)).float(), scale, offset


def q5_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes as Q4_K's, with bit 2 c + half of byte l of the 32 high-bit bytes above each."""
    lead = blocks.shape[:-1]
    scale, offset = _k_header(blocks)
    low = nibbles(byte(blocks, 48, 176).reshape(*lead, 4, 32))
    high = spread(byte(blocks, 16, 48), 8, 1, 1).reshape(*lead, 4, 2, 32)
    return (low | (high << 4)).float(), scale, offset


def q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 2, 2, 2, 2, 16]: weight 128 h + 32 (2 t + s) + 16 half + l is the nibble t of low
    byte 64 h + 32 s + 16 half + l and bits 2 (2 t + s) of high byte 32 h + 16 half + l, less 32."""
    lead = blocks.shape[:-1]
    scales = byte(blocks, 192, 208)
    scale = half(blocks, 208)[..., None] * (scales - ((scales & 0x80) << 1)).float()  # int8 scales, per 16
    low = nibbles(byte(blocks, 0, 128).reshape(*lead, 2, 1, 64)).reshape(*lead, 2, 2, 2, 2, 16)
    high = spread(byte(blocks, 128, 192).reshape(*lead, 2, 1, 32), 4, 2, 3).reshape(*lead, 2, 2, 2, 2, 16)
    return ((low | (high << 4)) - 32).float(), scale.reshape(*lead, 2, 2, 2, 2, 1), None


K_QUANTS = {t.name: t for t in (
    ScaledType("Q2_K", (2, 4, 2, 16), q2_k), ScaledType("Q3_K", (2, 4, 2, 16), q3_k),
    ScaledType("Q4_K", (4, 2, 32), q4_k), ScaledType("Q5_K", (4, 2, 32), q5_k),
    ScaledType("Q6_K", (2, 2, 2, 2, 16), q6_k),
)}
