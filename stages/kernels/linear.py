"""What every shipped-format matrix has in common: stored as it ships, dequantized at compute time.

A `ShippedLinear` holds one checkpoint matrix in its stored form (fp8 codes and block scales,
MXFP4 nibbles and exponents, GGUF blocks, or a float in its shipped dtype) and nothing else:
no float copy of the weight lives between calls. Its `matmul` dequantizes rows of the weight
into this thread's scratch buffer (stages/kernels/quant.py `chunked_matmul`, at most
DEQUANT_CHUNK_BYTES of float32 at a time) and multiplies each chunk with the dense float32
matmul, which is what a CPU does fastest; on another device it dequantizes the whole matrix
for the call (gpt-fast's form) unless the format has a kernel of torch's there
(kernels/fp8.py: `torch.nn.functional.scaled_mm` on SM90). Its `dequantized` is the
reference: the float32 weight the stored values mean, computed by the published formula
(checked against transformers' and the gguf package's own dequantizers in the tests).

Under torch.compile a format may also offer its weight as elementwise torch operations over the
stored tensors (`fused_inputs`, `fused_weight`): integer shifts, masks and selects, one
integer-to-float conversion and the scale's multiply, no scratch, no table lookup, no bit cast
inside the kernel (the dtype views are taken before, as graph inputs). Inductor fuses such an
expression into the one-row product that reads it (stages/engine/compiled/forms.py), so a decode
step reads the codes once, as stored, and never widens them into memory: on this machine's CPU
that product is faster than float32's, where the eager chunked form is slower (bench/shipped.py).

The engine stacks matrices a checkpoint keeps apart (q, k, v into wqkv; gate and up into
w_gate_up); shipped, those parts may be stored differently (a GGUF's q in Q4_K and v in
Q6_K; fp8 scale grids that do not line up across the parts), so a stacked engine matrix is a
`RowStack` of its parts, each computing its own rows of the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.kernels.chunked import chunked_matmul, dequantizes_in_chunks
from tessera.stages.kernels.quant import QuantLinear


class ShippedLinear(QuantLinear):
    """One stored matrix [N, K]: `rows_into` (the fast dequantization of rows [lo, hi), float32, into
    `out`) and `dequantized` (the reference weight) are the format's."""

    out_features: int
    in_features: int
    bias: torch.Tensor | None

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> [T, N], without the bias."""
        if dequantizes_in_chunks(rows.device, rows.dtype):
            return chunked_matmul(rows, self.out_features, self.rows_into)
        if rows.device.type == "cpu":  # bfloat16 activations on a CPU: the float32 chunks, then the cast
            return chunked_matmul(rows.float(), self.out_features, self.rows_into).to(rows.dtype)
        return F.linear(rows, self.dequantized_on(rows.device).to(rows.dtype))

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] on the CPU: the reference model's."""
        raise NotImplementedError

    def dequantized_on(self, device: torch.device) -> torch.Tensor:
        """The float32 weight on `device` for one call (a device without a kernel of torch's for the format)."""
        return self.dequantized().to(device)

    @property
    def stored_as(self) -> str:
        """The stored form in a few words ('Fp8BlockLinear', 'GGUF Q4_K'), for messages."""
        return type(self).__name__

    def fused_inputs(self) -> tuple[torch.Tensor, ...] | None:
        """The stored tensors as `fused_weight` reads them (views of the buffers, in the dtypes a
        vectorised kernel loads directly), or None: this format has no fused form."""
        return None

    def fused_weight(self, *stored: torch.Tensor) -> torch.Tensor:
        """The float32 weight [N, K] of `fused_inputs`, as elementwise operations only (module
        docstring); equal to `dequantized()`, value for value."""
        raise NotImplementedError

    def fused_rows(self, x: torch.Tensor, *stored: torch.Tensor) -> torch.Tensor:
        """x [R, K] float32 @ the fused weight^T -> [R, N] as one reduction over K per output, for a
        few rows (a format whose codes lie in another order than the inputs arranges its own)."""
        return (x[:, None, :] * self.fused_weight(*stored)).sum(-1)


class FloatLinear(ShippedLinear):
    """A float matrix kept in the dtype it ships in (bf16 beside fp8 or mxfp4 matrices; F16 in a
    GGUF): widened to float32 a chunk at a time instead of held widened."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == rows.dtype:  # nothing to widen: torch's own matmul over the stored matrix
            return F.linear(rows, self.weight)
        return super().matmul(rows)

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.weight[lo:hi])

    def dequantized(self) -> torch.Tensor:
        return self.weight.detach().float().cpu().clone()

    def dequantized_on(self, device: torch.device) -> torch.Tensor:
        return self.weight

    def fused_inputs(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)

    def fused_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.float()


class RowStack(QuantLinear):
    """An engine matrix made of checkpoint matrices stacked on their output rows, each in its own
    stored form: y = [x W_0^T, x W_1^T, ...] (+ b)."""

    def __init__(self, parts: list[ShippedLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        assert len({p.in_features for p in parts}) == 1, "stacked parts share their inputs"
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.register_buffer("bias", bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], self.out_features)  # [T, N]
        at = 0
        for part in self.parts:
            out[:, at : at + part.out_features] = part.matmul(rows)
            at += part.out_features
        return out

    def dequantized(self) -> torch.Tensor:
        return torch.cat([part.dequantized() for part in self.parts])
