"""Where a CPU span's weights live: in transparent huge pages, where the kernel offers them.

A decode step streams every weight once from memory. With 4 KiB pages that is a TLB miss
every 4 KiB; with 2 MiB pages, one every 2 MiB. Measured on this machine (one thread,
SmolLM2's matrices, float32): the matrix-vector products of a whole step moved 15.1 GB/s
over 4 KiB pages and 16.2 GB/s over huge pages with torch's kernels, and the compiled step
(engine/compiled/) went from ~0.85 to ~1.0 of one large product's bandwidth.

Linux gives huge pages to anonymous memory that asks for them (`madvise(MADV_HUGEPAGE)`)
when /sys/kernel/mm/transparent_hugepage/enabled is "madvise" or "always"; torch asks only
when THP_MEM_ALLOC_ENABLE is set before it starts. So `settle` copies a module's tensors
into one fresh buffer per module, advised before anything touches it, and points the
parameters there: the same values, in one run of memory. The advice covers the 2 MiB-aligned
interior of the buffer (no byte is added); where the kernel or the platform says no, the
buffer is ordinary memory and nothing else changes.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGN = 64  # bytes between tensors in the buffer: a cache line, what torch's allocator gives


def advise_huge_pages(buffer: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned interior of `buffer` (untouched CPU memory) with huge
    pages. True if it agreed; False where it cannot (another OS, THP disabled, too small)."""
    if not sys.platform.startswith("linux") or buffer.device.type != "cpu":
        return False
    start = buffer.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + buffer.nbytes) // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(first, last - first, MADV_HUGEPAGE) == 0


def settled(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` side by side in one buffer advised for huge pages (same values,
    shapes and dtypes; each contiguous)."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.nbytes // ALIGN) * ALIGN
    arena = torch.empty(size, dtype=torch.uint8)
    advise_huge_pages(arena)
    homes = []
    with torch.no_grad():
        for t, at in zip(tensors, offsets):
            home = arena[at : at + t.nbytes].view(t.dtype).view(t.shape)
            home.copy_(t)
            homes.append(home)
    return homes


def settle(module: nn.Module) -> None:
    """Move every parameter and buffer of `module` on the CPU into one buffer advised for huge pages."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.device.type == "cpu" and t.numel()]
    for t, home in zip(tensors, settled(tensors)):
        t.data = home
