"""Weight-only quantized linear layers: int8 per output channel, int4 group-wise.

A quantized span keeps its norms, biases and routers in the stage's dtype and every
matrix of a layer (wqkv, wo, w_gate_up, w_down; each expert's w_gate_up and w_down:
`families/tensors.py`'s `matrix_paths`) as integers plus scales; activations
stay in the stage's dtype. The matmuls are torch's own kernels, as gpt-fast's
quantize.py uses them:

- int8: `q = round(w / s)` in [-127, 127] with one scale per output row,
  `s = max|w_row| / 127`; `torch.ops.aten._weight_int8pack_mm(x, q, s)` on CPU (it wants
  the scales in x's dtype). On CUDA torch has no such kernel: `F.linear(x, q.to(x.dtype)) * s`,
  gpt-fast's own `WeightOnlyInt8Linear` form (a transient copy of one matrix per call).
- int4: per group of G consecutive inputs of a row (G = 32 by default: it divides every
  Llama width, 576 = 18 x 32 included, and is GGUF's Q4 block), asymmetric min/max:
  `s = (max - min) / 15`, `q = round((w - min) / s)` in [0, 15], stored as torch expects,
  `w ~ (q - 8) s + z` with `z = min + 8 s` (`scales_and_zeros` [K/G, N, 2]).
  `_convert_weight_to_int4pack_for_cpu` / `_weight_int4pack_mm_for_cpu` on CPU (N % 16 == 0),
  `_convert_weight_to_int4pack` / `_weight_int4pack_mm` on CUDA (bfloat16 activations,
  K a multiple of 16 x inner k tiles).

Float32 activations on a CPU (the default there: the reference is float32, and bfloat16
activations drift far enough through 30 layers to change SmolLM2's answers under int4):
torch's kernels take a slow generic path for float32 (measured, one thread, a 3072 x 576
matrix: int8 12x and int4 37x a dense float32 matmul for one row, 25x and 60x for 16 rows),
so a float32 CPU span dequantizes `DEQUANT_CHUNK_BYTES` of rows at a time (kernels/chunked.py) and multiplies
them with the dense float32 matmul (gpt-fast's CUDA int8 form, in bounded chunks). int8
converts only the codes and applies its per-row scales to the [T, N] output, since
x (q s)^T = (x q^T) s: one pass over the matrix instead of two (SmolLM2 decode went from
18.0 to 23.4 tok/s, against 15.7 for float32, one thread). int4 has a scale and a minimum
per group of a row, which do not factor out of the sum: it decodes at ~0.3-0.6x float32's
speed (unpacking nibbles costs more than the matmul at one row; a 16-row prefill ~1x). There int4 is stored in GGUF's Q4 block layout
(a group's low nibbles are its first half, the high nibbles its second half) as
`w = c s + m` (code c in [0, 15], scale s and minimum m per group), so a Q4_1 GGUF
tensor is these very integers and scales (stages/weights/gguf_blocks.py). bfloat16 activations (`--dtype bfloat16`) use
the kernels' fast path (AVX512-BF16): a declared bfloat16 peer, held to the bfloat16
tolerance as any bfloat16 peer is, not token for token.

The reference for a quantized span is its own dequantized float32 model: `dense_weight`
reads back the very weights a kernel multiplies by (it runs the kernel on the identity
matrix), so the reference is exactly what the integers and scales mean, whatever packing
the device uses; the float32 CPU forms dequantize with the very function the reference uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.errors import StageError
from tessera.stages.families.catalog import layer_matrices, tensors_of_layer
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.kernels.chunked import SCRATCH, chunked_matmul, dequantizes_in_chunks

QUANT_KINDS = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP = 32  # divides 576 (SmolLM2's width; 64 does too, 128 does not) and matches GGUF's Q4 blocks
INT8_MAX = 127
INT4_LEVELS = 15  # codes 0..15; torch's int4 kernels subtract 8
CPU_INT4_ROWS = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"


class QuantError(StageError):
    """A quantization name, group size, or a matrix shape the chosen kernels cannot take."""


@dataclass(frozen=True)
class Quant:
    """How a span's linear weights are stored.

    kind:       "none" (the stage's dtype), "int8" (per output channel) or "int4" (group-wise).
    group_size: inputs per int4 scale/zero (32, 64 or 128); ignored unless kind is "int4".
    """

    kind: str = "none"
    group_size: int = DEFAULT_INT4_GROUP

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise QuantError(f"quantization {self.kind!r} is unknown, expected one of {QUANT_KINDS}")
        if self.kind == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise QuantError(f"int4 group size {self.group_size!r} is not one of {INT4_GROUP_SIZES}")

    @property
    def tag(self) -> str:
        """The name a peer advertises (part of its model id): none, int8, int4g32 ..."""
        return f"int4g{self.group_size}" if self.kind == "int4" else self.kind

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @staticmethod
    def parse(text: str, group_size: int | None = None) -> "Quant":
        """'none' | 'int8' | 'int4' | 'int4g64' (an explicit `group_size` wins for plain 'int4')."""
        if text.startswith("int4g") and text[5:].isdigit():
            return Quant("int4", int(text[5:]))
        return Quant(text, group_size or DEFAULT_INT4_GROUP)

    def check_shape(self, rows: int, cols: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
        """Raise QuantError if a [rows, cols] weight cannot be stored this way on `device` for `dtype`
        activations (float32 on a CPU is the block layout, which takes any number of rows)."""
        if self.kind != "int4":
            return
        if cols % self.group_size:
            raise QuantError(f"int4 group size {self.group_size} does not divide a weight's {cols} inputs")
        if dequantizes_in_chunks(device, dtype):
            return
        if device.type == "cpu" and rows % CPU_INT4_ROWS:
            raise QuantError(f"torch's CPU int4 kernel needs outputs in multiples of {CPU_INT4_ROWS}, a weight has {rows}")
        if device.type != "cpu" and cols % (16 * inner_k_tiles(cols)):
            raise QuantError(f"torch's int4 kernel cannot take {cols} inputs (a multiple of 32 is needed)")

    def linear_bytes(self, rows: int, cols: int, itemsize: int) -> int:
        """Bytes a [rows, cols] weight occupies stored this way (scales in the activations' dtype)."""
        if self.kind == "int8":
            return rows * cols + rows * itemsize
        if self.kind == "int4":
            return rows * cols // 2 + (cols // self.group_size) * rows * 2 * itemsize
        return rows * cols * itemsize


NO_QUANT = Quant()


def layer_bytes(spec: ModelSpec, itemsize: int, quant: Quant = NO_QUANT, *, layer: int | None = None) -> int:
    """Bytes of decoder layer `layer` stored with `quant` (what placement counts per layer); with no
    `layer`, of any layer of a model whose layers are all alike (ValueError otherwise)."""
    if layer is None:
        if not spec.uniform:
            raise ValueError(f"the layers of this {spec.family} model differ: name the layer")
        layer = 0
    if spec.shipped is not None:
        return shipped_layer_bytes(spec, layer, itemsize)
    shape = spec.layers[layer]
    matrices = shape.matrices(spec.hidden_size)
    stored = sum(quant.linear_bytes(r, c, itemsize) for r, c in matrices)
    rest = spec.layer_param_count(layer) - sum(r * c for r, c in matrices)  # norms, biases, routers
    return stored + rest * itemsize


def shipped_layer_bytes(spec: ModelSpec, layer: int, itemsize: int) -> int:
    """Bytes of decoder layer `layer` of a model that ships quantized, held as it ships: each matrix's
    stored bytes (families/shipped.py `stored_bytes`), its norms, biases and router in `itemsize`."""
    assert spec.shipped is not None, "a model that ships quantized"
    matrices = {path + ".weight" for path in layer_matrices(spec, layer)}
    total = 0
    for ours, choices in tensors_of_layer(spec, layer).items():
        source = choices[0]  # the published layout (a fused one holds the same values)
        if ours in matrices:
            total += sum(spec.shipped.stored_bytes(name, source.part_shape(i)) for i, name in enumerate(source.names))
        else:
            total += math.prod(source.shape) * itemsize
    return total


def span_bytes(spec: ModelSpec, start: int, end: int, itemsize: int, quant: Quant = NO_QUANT) -> int:
    """Bytes of layers [start, end) stored with `quant`, each per its own shape."""
    return sum(layer_bytes(spec, itemsize, quant, layer=i) for i in range(start, end))


def check_quant_for(spec: ModelSpec, quant: Quant) -> None:
    """Raise QuantError when `quant` asks to quantize a model that ships quantized already (its
    matrices are computed as stored: stages/kernels/)."""
    if quant.active and spec.shipped is not None:
        raise QuantError(f"this model ships as {spec.shipped.tag}: --quant {quant.tag} applies to float weights only")


def model_tag(model_id: str, quant: Quant) -> str:
    """The model id a peer advertises: the plain id unquantized, `<id>+int8` / `<id>+int4g32` otherwise,
    so that only peers whose weights are the same integers and scales chain by default."""
    return model_id if not quant.active else f"{model_id}+{quant.tag}"


def base_model_id(tag: str) -> str:
    """The model id without its quantization suffix (`model_tag` undone)."""
    return tag.split("+", 1)[0]


def inner_k_tiles(cols: int) -> int:
    """torch's CUDA int4 packing parameter: the largest of 8, 4, 2 with cols % (16 x tiles) == 0."""
    return next((t for t in (8, 4, 2) if cols % (16 * t) == 0), 2)


def int8_rows(q: torch.Tensor, scales: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Float32 rows [lo, hi) of W = q s, one scale per row: the reference's weight. (The float32
    forward scales its output instead: the same product up to float32 rounding, well inside
    the stated tolerance.)"""
    return q[lo:hi].float().mul_(scales[lo:hi].float()[:, None])  # [r, K]


def int8_codes(q: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
    """Rows [lo, hi) of the int8 codes as float32, into `out` [hi - lo, K] (exact: |q| <= 127)."""
    return out.copy_(q[lo:hi])


def int4_block_rows(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, lo: int, hi: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 rows [lo, hi) of W = c s + m from GGUF's Q4 block layout (into `out` [hi - lo, K] when
    given): packed uint8 [N, K/G, G/2], the low nibbles a group's first G/2 codes, the high ones its
    last G/2; scales, mins [N, K/G]."""
    p = packed[lo:hi]  # [r, K/G, G/2]
    r, groups, half = p.shape
    codes = SCRATCH.take(r * groups * 2 * half, torch.uint8).view(r, groups, 2 * half) if out is not None \
        else torch.empty(r, groups, 2 * half, dtype=torch.uint8)
    torch.cat((p & 15, p >> 4), dim=-1, out=codes)  # [r, K/G, G]
    w = (torch.empty(r, groups * 2 * half) if out is None else out).view(r, groups, 2 * half)
    w.copy_(codes).mul_(scales[lo:hi, :, None].float()).add_(mins[lo:hi, :, None].float())
    return w.view(r, -1)  # [r, K]


class QuantLinear(nn.Module):
    """A linear layer over quantized weights: `matmul` (2-D rows, no bias) is the subclass's, and so
    is `dequantized` for a shipped format's (stages/kernels/)."""

    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, x.shape[-1]))  # [T, N]: the kernels take 2-D input
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the stored values mean (the reference model's)."""
        raise NotImplementedError


class Int8Linear(QuantLinear):
    """y = x W^T (+ b) with W = q * s[:, None]: q int8 [N, K], s [N] in the activations' dtype."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> [T, N], without the bias."""
        if dequantizes_in_chunks(rows.device, rows.dtype):  # x (q s)^T = (x q^T) s: scale the output, not W
            return chunked_matmul(rows, self.weight.shape[0], partial(int8_codes, self.weight)).mul_(self.scales)
        if rows.device.type == "cuda":  # no int8 weight-only kernel in torch for CUDA (gpt-fast's form)
            return F.linear(rows, self.weight.to(rows.dtype)) * self.scales
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)


class Int4BlockLinear(QuantLinear):
    """y = x W^T (+ b) with W = c s + m per group of `group_size` inputs, stored in GGUF's Q4 block
    layout (`int4_block_rows`); float32 activations on a CPU, dequantized in chunks."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.group_size = 2 * packed.shape[-1]
        self.register_buffer("weight", packed)  # uint8 [N, K/G, G/2]
        self.register_buffer("scales", scales)  # [N, K/G]
        self.register_buffer("mins", mins)  # [N, K/G]
        self.register_buffer("bias", bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] float32 -> [T, N], without the bias."""
        return chunked_matmul(rows.float(), self.weight.shape[0],
                              partial(int4_block_rows, self.weight, self.scales, self.mins)).to(rows.dtype)


class Int4Linear(QuantLinear):
    """y = x W^T (+ b) with W = (q - 8) s + z per group of `group_size` inputs, q packed by torch."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.group_size = group_size
        self.register_buffer("weight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/G, N, 2]
        self.register_buffer("bias", bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> [T, N], without the bias."""
        if rows.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm(rows, self.weight, self.group_size, self.scales_and_zeros)


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, quant: Quant, *,
                    dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """A float weight [N, K] (any float dtype, on the CPU) -> a linear module stored as `quant` on `device`.

    The scales are rounded to `dtype` first and the integers chosen against the rounded
    scales, so that storing them in `dtype` loses nothing further. Raises QuantError.
    """
    device = torch.device(device)
    rows, cols = weight.shape
    quant.check_shape(rows, cols, device, dtype)
    w = weight.float()
    b = None if bias is None else bias.to(device=device, dtype=dtype)
    if quant.kind == "none":
        layer = nn.Linear(cols, rows, bias=bias is not None, device="meta")
        layer.load_state_dict({"weight": w.to(device=device, dtype=dtype),
                               **({"bias": b} if b is not None else {})}, assign=True)
        return layer.requires_grad_(False)
    if quant.kind == "int8":
        peak = torch.linalg.vector_norm(w, ord=float("inf"), dim=1)  # max |w| per row [N]
        scales = (peak / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)
        w = w.clone() if w is weight else w  # divided in place below; never the caller's tensor
        q = w.div_(scales.float()[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # [N, K]
        return Int8Linear(q.to(device), scales.to(device), b)
    g = quant.group_size
    groups = w.reshape(rows, cols // g, g)  # [N, K/G, G]
    low, high = torch.aminmax(groups, dim=-1)  # [N, K/G]
    scales = ((high - low) / INT4_LEVELS).clamp(min=torch.finfo(torch.float32).tiny).to(dtype)
    if dequantizes_in_chunks(device, dtype):  # W = c s + m, GGUF's Q4_1 form and layout
        codes = (groups - low[..., None]).div_(scales[..., None]).round_().clamp_(0, INT4_LEVELS).to(torch.uint8)
        packed = codes[..., : g // 2] | codes[..., g // 2:] << 4  # [N, K/G, G/2]
        return Int4BlockLinear(packed.contiguous(), scales, low, b)
    zeros = (low + 8 * scales.float()).to(dtype)  # so that code c means (c - 8) s + z
    lowest = zeros.float() - 8 * scales.float()  # what code 0 means once rounded
    codes = (groups - lowest[..., None]).div_(scales.float()[..., None]).round_().clamp_(0, INT4_LEVELS)
    codes = codes.to(torch.int32).reshape(rows, cols)  # [N, K]
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
    if device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    else:
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # [N, K/2], even input high
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), inner_k_tiles(cols))
    return Int4Linear(packed.to(device), scales_and_zeros.to(device), g, b)


@torch.no_grad()
def dense_weight(layer: nn.Module) -> torch.Tensor:
    """The float32 weight [N, K] a linear module means: q s for int8, (q - 8) s + z for int4,
    computed in float32 from the stored integers and scales (the reference model's weights).

    int4 codes are read back out of torch's packed layout by the kernel itself: with every
    scale 1 and zero 8 it returns each code exactly, for any packing the device uses."""
    if isinstance(layer, nn.Linear):
        return layer.weight.detach().float().cpu().clone()
    if isinstance(layer, Int8Linear):
        return int8_rows(layer.weight.cpu(), layer.scales.cpu(), 0, layer.weight.shape[0])
    if isinstance(layer, Int4BlockLinear):
        return int4_block_rows(layer.weight.cpu(), layer.scales.cpu(), layer.mins.cpu(), 0, layer.weight.shape[0])
    if not isinstance(layer, Int4Linear):  # a shipped format's: fp8, mxfp4, GGUF blocks (stages/kernels/)
        return layer.dequantized()
    g, sz = layer.group_size, layer.scales_and_zeros  # [K/G, N, 2]
    groups, rows = sz.shape[0], sz.shape[1]
    unit = torch.empty_like(sz, dtype=torch.bfloat16)
    unit[..., 0], unit[..., 1] = 1.0, 8.0  # code c -> (c - 8) * 1 + 8 = c, exact in bfloat16
    eye = torch.eye(groups * g, dtype=torch.bfloat16, device=sz.device)
    probe = Int4Linear(layer.weight, unit, g, None)
    codes = probe.matmul(eye).float().T.cpu().reshape(rows, groups, g)  # [N, K/G, G]
    scales, zeros = (sz[..., i].float().T.cpu()[..., None] for i in (0, 1))  # [N, K/G, 1]
    return ((codes - 8) * scales + zeros).reshape(rows, groups * g)
