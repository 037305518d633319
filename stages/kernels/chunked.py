"""Dequantize a chunk of rows, multiply, repeat: the float32 CPU form of every stored-weight matmul.

A float32 span on a CPU computes a quantized or shipped matrix (kernels/quant.py's int8 and
int4 blocks, kernels/linear.py's shipped formats) by dequantizing `DEQUANT_CHUNK_BYTES` of its
rows at a time into this thread's scratch buffer and multiplying each chunk with the dense
float32 matmul (`chunked_matmul`): torch's integer kernels take a slow generic path for float32
activations, and the float32 matmul is what a CPU does fastest. Loading such a span makes
matrix-sized float temporaries; `release_freed_memory` hands them back to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Callable

import torch

# float32 weights dequantized at once by a float32 CPU span. The transient (and what glibc keeps of
# it once freed) counts against the span's memory bound: measured on SmolLM2 layers [0, 15), RSS
# over (weights + KV) was 0.98 int8 / 1.14 int4 at 1 MiB, 1.11 / 1.53 at 4 MiB; decode speed
# differed by ~10% between 1, 2 and 4 MiB (int8 0.48-0.57x, int4 0.21-0.26x float32, one thread)
DEQUANT_CHUNK_BYTES = 1 << 20


def dequantizes_in_chunks(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a span computes by dequantizing rows (float32 on a CPU) instead of torch's int kernels."""
    return device.type == "cpu" and dtype == torch.float32


class Scratch(threading.local):
    """One thread's dequantization buffers, allocated once at DEQUANT_CHUNK_BYTES and reused by
    every chunk of every matrix: no heap churn, so a float32 span's RSS stays its weights plus
    this (fresh temporaries per chunk left 0-7 MiB in glibc's heap, measured)."""

    def take(self, numel: int, dtype: torch.dtype, slot: str = "") -> torch.Tensor:
        """A flat tensor of `numel` elements of this thread's buffer for `dtype` (grown when asked more);
        another `slot` is another buffer of that dtype (a dequantizer holding two at once)."""
        name = f"buffer_{dtype}{slot}".replace(".", "_")
        buf = getattr(self, name, None)
        if buf is None or buf.numel() < numel:
            # a normal tensor even when first asked for under inference_mode: an inference tensor
            # could not be written by a later forward outside it (the same thread serves both)
            with torch.inference_mode(False):
                buf = torch.empty(max(numel, DEQUANT_CHUNK_BYTES // dtype.itemsize), dtype=dtype)
            setattr(self, name, buf)
        return buf[:numel]


SCRATCH = Scratch()


def chunked_matmul(rows: torch.Tensor, n_out: int,
                   dequantize: Callable[[int, int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """rows [T, K] float32 @ W^T for W [n_out, K] produced by `dequantize(lo, hi, out)` into this
    thread's scratch, rows [lo, hi) at a time (at most DEQUANT_CHUNK_BYTES of float32) -> [T, n_out]."""
    k = rows.shape[-1]
    step = max(1, DEQUANT_CHUNK_BYTES // (4 * k))
    out = rows.new_empty(rows.shape[0], n_out)
    for lo in range(0, n_out, step):
        hi = min(n_out, lo + step)
        w = dequantize(lo, hi, SCRATCH.take((hi - lo) * k, torch.float32).view(hi - lo, k))  # [hi - lo, K]
        if hi - lo == n_out:
            torch.matmul(rows, w.T, out=out)
        else:
            out[:, lo:hi] = rows @ w.T  # [T, hi - lo]
    return out


def _libc_trim():  # glibc's malloc_trim, or None on another C library
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    return trim


_MALLOC_TRIM = _libc_trim()


def release_freed_memory() -> None:
    """Hand the float temporaries of quantization back to the OS. glibc raises its mmap threshold
    after large frees, so matrix-sized temporaries land in its heap and stay resident once freed
    (measured: +1.3x to +4x the quantized span's bytes in RSS); malloc_trim returns them."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
