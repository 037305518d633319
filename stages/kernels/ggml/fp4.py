"""llama.cpp's FP4 block types, MXFP4 and NVFP4, as scaled codes (ggml/scaled.py).

Both store e2m1 codes, two a byte, a block's low nibbles its first half and the high nibbles its
second (ggml's order; gpt-oss's MXFP4 pairs them instead: formats/mxfp4.py). ggml keeps the e2m1
values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives: integers) and halves the scale:

    MXFP4 (17 B / 32)   an e8m0 exponent e, 16 B of codes      w = 2^(e - 128) KVALUES[q]
                        (e < 2: the subnormal 2^-128 or 2^-127, as ggml_e8m0_to_fp32_half has it)
    NVFP4 (36 B / 64)   4 unsigned e4m3 scales (one per 16 weights; bit 7 unused, 0x7F reads 0),
                        32 B of codes, per 16 weights 8 bytes   w = (ue4m3(s) / 2) KVALUES[q]

Every product is exact in float32 (a 2-bit mantissa times a 1- or 4-bit one).
"""

from __future__ import annotations

import torch

from tessera.stages.kernels.fp8 import e4m3_values
from tessera.stages.kernels.ggml.scaled import ScaledType, byte, nibbles

FP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1, doubled
UE4M3_NAN = 0x7F
FP4_BITS_SHIFT = 22  # `fp4_values`: an e2m1 magnitude at float32's bits 22..24 ...
FP4_BITS_SCALE = 2.0 ** 127  # ... reads its doubled value times 2^-127


FP4_MAGNITUDE_BITS = 0x01C00000  # float32's bits 22..24
FLOAT32_SIGN_BIT = -(1 << 31)  # bit 31 of an int32


def _low_code_bits(b: torch.Tensor) -> torch.Tensor:
    """int32 whose bits 0..3 are an e2m1 code -> float32 bits of its doubled value times 2^-127."""
    return ((b << FP4_BITS_SHIFT) & FP4_MAGNITUDE_BITS) | ((b << 28) & FLOAT32_SIGN_BIT)


def fp4_values(q: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (int32, 0..15) -> FP4_KVALUES[q] as float32, by shifts, masks and a bit cast (a table
    lookup is a gather per weight, which inductor does not vectorise): the magnitude bits (two of
    exponent, one of mantissa) at float32's bits 22..24 and the sign at bit 31 read the doubled value
    times 2^-127 (the code of 1, e2m1's subnormal, a float32 subnormal), and 2^127 (exact) scales it."""
    return _low_code_bits(q).view(torch.float32) * FP4_BITS_SCALE


def fp4_byte_values(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of two e2m1 codes, as int32 read from their int8 view (sign-extended: the high code's sign
    bit is the integer's) -> (FP4_KVALUES of the low code, of the high one) as float32: `fp4_values`
    with each code's bits shifted into place from the byte directly (fewer operations a byte)."""
    high = ((b << (FP4_BITS_SHIFT - 4)) & FP4_MAGNITUDE_BITS) | (b & FLOAT32_SIGN_BIT)
    return _low_code_bits(b).view(torch.float32) * FP4_BITS_SCALE, high.view(torch.float32) * FP4_BITS_SCALE


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """int32 exponents -> 2^(e - 128) as float32 (ggml_e8m0_to_fp32_half; 2^-128 and 2^-127 subnormal), as
    exp2 of an integer: exact (once per block, so its cost is small beside the codes')."""
    return torch.exp2((e - 128).float())


def ue4m3_half(x: torch.Tensor) -> torch.Tensor:
    """int32 unsigned-e4m3 bytes -> their value / 2 as float32 (0 for 0x00 and 0x7F; bit 7 ignored): the
    low seven bits read as an e4m3 code (fp8.py `e4m3_values`: a bit cast), halved (exact)."""
    return torch.where(x == UE4M3_NAN, 0.0, e4m3_values(x & 0x7F) * 0.5)


def mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 2, 16]: the low nibbles first."""
    return fp4_values(nibbles(byte(blocks, 1, 17))), e8m0_half(byte(blocks, 0, 1))[..., None], None


def nvfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """codes [..., 4, 2, 8]: per 16 weights, 8 bytes' low nibbles, then their high ones."""
    lead = blocks.shape[:-1]
    codes = fp4_values(nibbles(byte(blocks, 4, 36).reshape(*lead, 4, 8)))
    return codes, ue4m3_half(byte(blocks, 0, 4))[..., None, None], None


FP4_TYPES = {t.name: t for t in (ScaledType("MXFP4", (2, 16), mxfp4, group_dims=2),
                                 ScaledType("NVFP4", (4, 2, 8), nvfp4, group_dims=2))}
