"""A block's decode form: the same modules and parameters, with one-row products inductor streams well.

Measured on this machine's CPU (AMD EPYC, AVX-512, one thread, float32, weights in huge pages):
torch's matmul for one row through a [N, K] weight moves 9-14 GB/s for K = 576-1536 (MKL's
GEMV takes short rows poorly here); the same product written as a reduction,
`(x[:, None, :] * W).sum(-1)`, which inductor turns into one vectorised loop over W's rows,
moves 17-23 GB/s for one row. So under torch.compile a `RowLinear` multiplies one row that
way (ROW_REDUCTION_ROWS); more rows, and every eager call, take F.linear. For more rows the
reduction's loop runs row by row and reads W once per row: over SmolLM2's 120 matrices (one
thread, rounds side by side on a loaded 2-core box) two rows took 1.7-2x F.linear's time and
four 2.3-3x; a compiled SmolLM2 stage stacking 2 sessions decoded 13-14 tok/s where one decoded
12.9 and an eager stage's stack 23-33, 4 sessions 20 tok/s against eager's 29-32 (the stacked
steps of bench/batching.py's stage, the two stages' rounds alternating in one process). It was
4 rows until then, which cost a compiled peer's stacked steps of 2-4 sessions up to half their
throughput.

A matrix stored as a checkpoint ships it (fp8 blocks, MXFP4, GGUF blocks: stages/kernels/)
is a `FusedRows` in the decode form when its format has a fused form: the same reduction, over
the weight written as elementwise operations of its stored codes, which inductor fuses into one
loop that reads each code once (measured, one thread, an 8192 x 2048 matrix: fp8 5.2 and Q8_0
9.9 G weights/s against float32's 3.2; the eager chunked forms run at 0.5-0.7x float32).

`decode_form(block)` is a shallow copy of the block's module tree whose nn.Linear modules are
RowLinear and whose shipped matrices are FusedRows: no weight is copied (the parameters are the
block's own; FusedRows holds views of them), and the eager path keeps running the block itself.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.kernels.linear import RowStack, ShippedLinear
from tessera.stages.kernels.chunked import DEQUANT_CHUNK_BYTES
from tessera.stages.kernels.quant import QuantLinear

ROW_REDUCTION_ROWS = 1  # float32 rows up to which the reduction beats torch's matmul (module docstring)
# rows up to which a shipped matrix's fused reduction runs; more dequantize a chunk at a time and
# multiply (its integer work per weight is what the reduction saves; not re-measured at 2-4 rows)
FUSED_ROWS = 4


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] @ weight [N, K]ᵀ (+ bias) -> [R, N]; as a reduction under torch.compile for few rows."""
    if torch.compiler.is_compiling() and x.shape[0] <= ROW_REDUCTION_ROWS:
        y = (x[:, None, :] * weight).sum(-1)  # [R, N], summed over K in one pass over each row of W
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class RowLinear(nn.Linear):
    """nn.Linear whose product goes through `rows_linear` (made by `decode_form`, never built)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows_linear(x, self.weight, self.bias)


Stored = tuple[torch.Tensor, ...]  # a part's `fused_inputs`


class FusedRows(nn.Module):
    """A shipped matrix (or a RowStack of them) in a decode form: under torch.compile, up to
    FUSED_ROWS rows as one reduction per stored part (`fused_rows`), more as matmuls over
    its `fused_weight` a chunk at a time; eagerly, the matrix's own forward. Its buffers are the
    parts' `fused_inputs` (views of the matrix's), so that the graph reads them as stored."""

    def __init__(self, matrix: QuantLinear, parts: list[tuple[ShippedLinear, Stored]]) -> None:
        super().__init__()
        self.matrix = matrix
        self.parts = [part for part, _ in parts]  # a plain list: the modules are the matrix's own
        self.stored_names = [tuple(f"stored_{i}_{j}" for j in range(len(stored))) for i, (_, stored) in enumerate(parts)]
        for (_, stored), names in zip(parts, self.stored_names):
            for name, tensor in zip(names, stored):
                self.register_buffer(name, tensor, persistent=False)  # graph inputs, shared by every layer's graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self.matrix.forward(x)
        rows = x.reshape(-1, x.shape[-1]).float()
        outs = []  # each [R, part's N]
        for part, names in zip(self.parts, self.stored_names):
            stored = [getattr(self, name) for name in names]
            if rows.shape[0] <= FUSED_ROWS:
                outs.append(part.fused_rows(rows, *stored))
            else:  # the weight widened DEQUANT_CHUNK_BYTES at a time by the graph, each chunk a matmul
                weight = part.fused_weight(*stored)
                step = max(1, DEQUANT_CHUNK_BYTES // (4 * weight.shape[1]))
                outs += [F.linear(rows, weight[lo : lo + step]) for lo in range(0, weight.shape[0], step)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.matrix.bias is not None:
            y = y + self.matrix.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def fused_parts(module: nn.Module) -> list[tuple[ShippedLinear, Stored]] | None:
    """Each stored part of a shipped matrix with its `fused_inputs`, when every part has a fused
    form; None otherwise (not a shipped matrix, or a part without one)."""
    if not isinstance(module, (RowStack, ShippedLinear)):
        return None
    parts = list(module.parts) if isinstance(module, RowStack) else [module]
    stored = [part.fused_inputs() for part in parts]
    return None if any(s is None for s in stored) else list(zip(parts, stored))


def unfused(form: nn.Module) -> set[str]:
    """The stored forms of the shipped matrices in a decode form that have no fused form (their
    eager code does not trace: a layer kind holding one decodes eagerly)."""
    if isinstance(form, FusedRows):
        return set()
    found = {form.stored_as} if isinstance(form, ShippedLinear) and form.fused_inputs() is None else set()
    return found.union(*(unfused(child) for child in form.children()))


def stored_signature(form: nn.Module) -> tuple:
    """What a compiled graph of a decode form specialises on besides its layer kind: each fused
    matrix's stored form and dtypes, in order. Layers of one kind may store differently (a GGUF
    file mixes block types across layers), and each such variant needs a graph of its own."""
    return tuple((part.stored_as, tuple(getattr(f, name).dtype for name in names))
                 for f in form.modules() if isinstance(f, FusedRows) for part, names in zip(f.parts, f.stored_names))


def decode_form(module: nn.Module) -> nn.Module:
    """A copy of `module`'s tree sharing every parameter and buffer, each plain nn.Linear a RowLinear and
    each shipped matrix with a fused form a FusedRows."""
    parts = fused_parts(module)
    if parts is not None:
        return FusedRows(module, parts)
    form = copy.copy(module)  # shares _parameters and _buffers: the same tensors
    form._modules = {name: None if child is None else decode_form(child) for name, child in module._modules.items()}
    if type(module) is nn.Linear:
        form.__class__ = RowLinear
    return form
