"""Float matrices written in a shipped form: for synthetic models and a peer's speed benchmark.

A peer advertises the decode speed of one layer in the form it serves (stages/engine/speed.py),
and `tessera model synth` writes random-weight models of real shapes; both need matrices in
fp8 blocks, MXFP4 or GGUF blocks without a checkpoint to take them from. Compute cost does not
depend on the values, so these encoders are plain:

- fp8: per block of the format's `block`, scale_inv = amax / 448 and q = w / scale_inv rounded
  to float8_e4m3fn (transformers' `Fp8Quantize`);
- MXFP4: per 32 inputs, the exponent that brings the largest |w| into [4, 8) (OCP's rule, as the
  gguf package's quantizer computes it) and each value's nearest e2m1 code, saturating at 6;
- GGUF block types: random codes under a float16 scale that gives weights of about `std`
  (no k-quant quantizer is needed to time or to fill a synthetic model).
"""

from __future__ import annotations

import math

import torch

from tessera.stages.families.shipped import GGML_TYPES, GgmlType, ShippedFormat
from tessera.stages.families.tensors import Stacked
from tessera.stages.kernels.fp8 import FP8_MAX
from tessera.stages.kernels.ggml.blocks import ggml_rows
from tessera.stages.kernels.linear import RowStack
from tessera.stages.kernels.mxfp4 import E8M0_BIAS, GROUP
from tessera.stages.kernels.quant import QuantLinear
from tessera.stages.kernels.stored import stored_linear

E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
E2M1_TOP_EXPONENT = 2  # 6 = 1.5 * 2^2: the largest magnitude's exponent
# where each block type keeps its float16 scales (and the typical |code| they multiply)
GGML_SCALES = {"Q8_0": ((0,), 64), "Q4_0": ((0,), 4), "Q4_1": ((0, 2), 8), "Q4_K": ((0, 2), 8 * 32),
               "Q5_K": ((0, 2), 16 * 32), "Q6_K": ((208,), 16 * 32)}


def fp8_encode(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn codes [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)])."""
    (rows, cols), (bn, bk) = w.shape, block
    nb, kb = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:rows, :cols] = w
    tiles = padded.view(nb, bn, kb, bk)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(nb * bn, kb * bk)[:rows, :cols].contiguous(), scale_inv


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float (K a multiple of 32) -> (blocks uint8 [N, K/32, 16], scales uint8 [N, K/32])."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    exponent = (torch.floor(torch.log2(amax)) - E2M1_TOP_EXPONENT).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = torch.bucketize(scaled.abs(), torch.tensor(E2M1_MIDPOINTS)).to(torch.uint8)  # 0..7
    codes = magnitude | ((scaled < 0).to(torch.uint8) << 3)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8)


# Where the lower types (ggml/kquants.py, ggml/iq.py, ggml/fp4.py) keep their float16 block scales; IQ1_M,
# MXFP4 and NVFP4 keep theirs otherwise (`set_block_scale`)
GGML_HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,),
               "IQ3_S": (0,), "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
IQ1_M_SCALES = 48  # IQ1_M: four uint16 from here, each with a nibble of d's float16 in its top four bits
UE4M3_BIAS = 7


def set_block_scale(kind: GgmlType, blocks: torch.Tensor, value: float) -> None:
    """Set the block scale of every block [..., nbytes] of a lower type to about `value` (in place)."""
    if kind.name in GGML_HALVES:
        half = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
        for at in GGML_HALVES[kind.name]:
            blocks[..., at : at + 2] = half
    elif kind.name == "IQ1_M":
        bits = int(torch.tensor([value], dtype=torch.float16).view(torch.int16)) & 0xFFFF
        for i in range(4):  # the high nibble of each uint16's second byte
            at = IQ1_M_SCALES + 2 * i + 1
            blocks[..., at] = (blocks[..., at] & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)
    elif kind.name == "MXFP4":  # e8m0, halved: 2^(e - 128)
        blocks[..., 0] = int(min(254, max(2, 128 + round(math.log2(value)))))
    elif kind.name == "NVFP4":  # unsigned e4m3 per 16 weights, halved: a power of two
        blocks[..., 0:4] = int(min(14, max(1, UE4M3_BIAS + round(math.log2(2 * value))))) << 3
    else:
        raise ValueError(f"no block scale known for {kind.name}")


def fp4_experts_encode(w: torch.Tensor, shipped: ShippedFormat) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V4's FP4 experts: MXFP4's codes as int8 pairs [N, K/2], its exponents as e8m0 [N, K/32]."""
    blocks, scales = mxfp4_encode(w)
    return blocks.reshape(w.shape[0], -1).view(torch.int8), scales.view(torch.float8_e8m0fnu)


def nvfp4_encode(w: torch.Tensor, shipped: ShippedFormat) -> tuple[torch.Tensor, ...]:
    """NVFP4 in `shipped.layout`: per 16 inputs the e4m3 scale amax / 6 (global scale 1), each value's nearest
    e2m1 code, pairs low nibble first; a zero input scale where the layout ships one."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 16, 16)
    scales = (groups.abs().amax(-1) / 6).clamp(min=2.0**-9).to(torch.float8_e4m3fn)  # [N, K/16]
    scaled = groups / scales.float()[..., None]
    magnitude = torch.bucketize(scaled.abs().clamp(max=6), torch.tensor(E2M1_MIDPOINTS)).to(torch.uint8)
    codes = (magnitude | ((scaled < 0).to(torch.uint8) << 3)).reshape(rows, cols)
    one = torch.ones(() if shipped.layout == "modelopt" else (1,))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), scales, one, one.clone()


def int4_encode(w: torch.Tensor, shipped: ShippedFormat) -> tuple[torch.Tensor, ...]:
    """compressed-tensors' pack-quantized: per group a bf16 scale amax / 7 (asymmetric: (max - min) / 15 and
    a zero point), codes round(w / s) + z in [-8, 7], packed + 8, eight a little-endian int32."""
    rows, cols = w.shape
    group = shipped.group or cols
    groups = w.float().reshape(rows, cols // group, group)
    if shipped.symmetric:
        scales = (groups.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
        zeros = torch.zeros(rows, cols // group)
    else:
        low, high = torch.aminmax(groups, dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-8).to(torch.bfloat16)
        zeros = (-8 - torch.round(low / scales.float())).clamp(-8, 7)
    q = (torch.round(groups / scales.float()[..., None]) + zeros[..., None]).clamp(-8, 7).to(torch.int32) + 8
    pairs = (q.reshape(rows, cols)[:, 0::2] | (q.reshape(rows, cols)[:, 1::2] << 4)).to(torch.uint8)
    out = [pairs.contiguous().view(torch.int32), scales, torch.tensor([rows, cols])]
    if not shipped.symmetric:
        z = (zeros.to(torch.int32) + 8)  # [N, G], packed along the rows, eight a word
        z = torch.cat((z, torch.full((-rows % 8, z.shape[1]), 8, dtype=torch.int32)))
        shifts = 4 * torch.arange(8, dtype=torch.int32)[None, :, None]
        out.append((z.reshape(-1, 8, z.shape[1]) << shifts).sum(1, dtype=torch.int32))
    return tuple(out)


def random_ggml(kind: GgmlType, rows: int, cols: int, *, std: float, gen: torch.Generator) -> torch.Tensor:
    """Random ggml blocks of `kind` for a [rows, cols] matrix of weights about `std` in size."""
    blocks = torch.randint(0, 256, (rows, cols // kind.block, kind.nbytes), dtype=torch.uint8, generator=gen)
    if kind.name not in GGML_SCALES:  # random codes: the block scale that brings them to `std`
        set_block_scale(kind, blocks, 1.0)
        unit = float(ggml_rows(blocks.view(rows, -1), kind).std())
        set_block_scale(kind, blocks, std / unit)
        return blocks.view(rows, -1)
    offsets, typical = GGML_SCALES[kind.name]
    scale = torch.full((rows, cols // kind.block), std / typical, dtype=torch.float16).view(torch.uint8)
    for at in offsets:
        blocks[..., at : at + 2] = scale.view(rows, -1, 2)
    if kind.name in ("Q4_K", "Q5_K"):  # six-bit sub-block scales and mins: small, so the weights stay near std
        blocks[..., 4:16] &= 0x3F
    return blocks.view(rows, -1)


def encode_matrix(shipped: ShippedFormat, name: str, w: torch.Tensor, *, std: float,
                  gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The stored tensors of checkpoint matrix `name` holding `w` [N, K] in `shipped`'s form (by stored name)."""
    form = shipped.form_of(name)
    if form == "fp8":
        codes, scale_inv = fp8_encode(w, shipped.block)
        return {name: codes, name + "_scale_inv": scale_inv}
    if form == "mxfp4":
        blocks, scales = mxfp4_encode(w)
        return {name + "_blocks": blocks, name + "_scales": scales}
    if form in ("fp4", "nvfp4", "int4"):
        tensors = {"fp4": fp4_experts_encode, "nvfp4": nvfp4_encode, "int4": int4_encode}[form](w, shipped)
        return dict(zip(shipped.stored_tensors(name, tuple(w.shape)), tensors))
    if form == "float":
        return {name: w.to(torch.bfloat16 if shipped.float_bytes == 2 else torch.float32)}
    kind = GGML_TYPES[form]
    if kind.is_float:
        return {name: w.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[form])}
    return {name: random_ggml(kind, *w.shape, std=std, gen=gen)}


def encoded_linear(shipped: ShippedFormat, source: Stacked, weight: torch.Tensor, *, std: float,
                   gen: torch.Generator) -> QuantLinear:
    """An engine matrix holding `weight` (its parts stacked as `source` lists them) in `shipped`'s
    form, as a span loading such a checkpoint would hold it (no bias)."""
    parts, at = [], 0
    for i, name in enumerate(source.names):
        rows = source.part_shape(i)[0]
        stored = encode_matrix(shipped, name, weight[at : at + rows].float(), std=std, gen=gen)
        parts.append(stored_linear(shipped, name, stored, cols=weight.shape[1]))
        at += rows
    return parts[0] if len(parts) == 1 else RowStack(parts, None)
