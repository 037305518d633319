"""What memory a compute device has, and how much of it a peer offers.

On CUDA the offer is the device's free memory (`torch.cuda.mem_get_info`) less a reserve:
CUDA's own context and the caching allocator's slack (~0.5-1 GiB on current cards) plus
activations and fragmentation, which grow with the card — 1 GiB or 10% of the card,
whichever is more. `read_device_memory` is the ONE place that asks torch.cuda; the arithmetic
is the pure `cuda_offer`. On CPU and MPS (unified memory) the peer's RAM rule applies
(peer/node/config.py: half the available RAM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CUDA_RESERVE_MIN = 1 << 30  # bytes kept free on any card: CUDA context + allocator slack
CUDA_RESERVE_FRACTION = 0.10  # of the card's total: activations and fragmentation grow with it


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as torch reports it.

    kind:  "cuda", "mps" or "cpu" (torch.device.type).
    free:  bytes free now (0 when unknown: CPU and MPS report through psutil instead).
    total: bytes the device has (0 when unknown).
    """

    kind: str
    free: int = 0
    total: int = 0


def cuda_reserve(total: int) -> int:
    """Bytes of a CUDA card of `total` bytes that a peer never offers."""
    return max(CUDA_RESERVE_MIN, int(total * CUDA_RESERVE_FRACTION))


def cuda_offer(free: int, total: int, reserve: int) -> int:
    """Bytes a peer offers on a CUDA card with `free` of `total` bytes free: free less `reserve`
    (never negative, never more than the card). Raises ValueError for impossible readings."""
    if not 0 <= free <= total or reserve < 0:
        raise ValueError(f"impossible device memory reading: free {free!r}, total {total!r}, reserve {reserve!r}")
    return max(0, free - reserve)


def read_device_memory(device: torch.device) -> DeviceMemory:
    """The device's free and total memory (CUDA only; other kinds report 0 = unknown)."""
    if device.type != "cuda":
        return DeviceMemory(device.type)
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory("cuda", int(free), int(total))
