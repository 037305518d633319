"""What a requester keeps of a session: the hops that entered each cut of its route.

The requester feeds layer 0 itself and receives a tap — a copy of each span's
output — from every peer but the last. So for every layer boundary `b` where one
hop of the route ends and the next begins, it holds the inputs of the span that
starts at `b`, position by position. When a peer dies, those inputs rebuild a
replacement's KV cache in one prefill-shaped step (peer/request/repair.py).

Writes follow the KV cache's rule: writing at position p makes p the end of
what is known, so a re-sent step or a rolled-back draft overwrites, never
appends after stale rows.
"""

from __future__ import annotations

from typing import Callable

import torch


class HiddenHistory:
    """Rows of hops [capacity, W] at one layer boundary, valid for positions [0, length): W is the model's
    `hop_width` there (its hidden size H, or DeepSeek-V4's streams and token ids, or Gemma 4's residual
    and the per-layer inputs of the layers after it: stages/layers/hop.py)."""

    def __init__(self, capacity: int, width: int, dtype: torch.dtype = torch.float32) -> None:
        self.rows = torch.zeros(capacity, width, dtype=dtype)
        self.length = 0

    def write(self, start_pos: int, hidden: torch.Tensor) -> bool:
        """Store rows for positions [start_pos, start_pos + T); returns False (storing nothing)
        when that would leave positions before start_pos unknown, or overflow the capacity."""
        end = start_pos + hidden.shape[0]
        if start_pos > self.length or end > self.rows.shape[0]:
            return False
        self.rows[start_pos:end] = hidden
        self.length = end
        return True

    def upto(self, end: int) -> torch.Tensor:
        """Rows for positions [0, end) (raises if some are not known yet)."""
        if end > self.length:
            raise ValueError(f"history holds positions [0, {self.length}); {end} asked")
        return self.rows[:end]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class RouteHistory:
    """A `HiddenHistory` per layer boundary that some route of the session has cut at, each as wide as
    the hop into that layer (`width(layer)`: ModelSpec.hop_width)."""

    def __init__(self, capacity: int, width: Callable[[int], int]) -> None:
        self.capacity = capacity
        self.width = width
        self.cuts: dict[int, HiddenHistory] = {}

    def at(self, layer: int) -> HiddenHistory:
        if layer not in self.cuts:
            self.cuts[layer] = HiddenHistory(self.capacity, self.width(layer))
        return self.cuts[layer]

    def known(self, layer: int) -> int:
        """How many positions of the inputs at `layer` are held."""
        return self.cuts[layer].length if layer in self.cuts else 0
