"""Static KV slots, and the decode step that attends through them: what a CUDA graph replays.

A CUDA graph replays fixed kernels on fixed addresses, so a graph-decoded span keeps one
pool per layer, keys and values [slots, K, capacity, D], allocated once. A session whose
capacity fits takes a slot when it opens: its `SessionCache` is views of that slot
(`KeyValues.over`), so its prefill and any other eager step write exactly where the graph
reads. A decode step names its rows' slots and positions in index tensors: each row writes
its k, v at (slot, position), then attends over positions [0, L) of its slot, masked to its
own (at most its position, within its window). L is the step's length bucket, so one graph
serves every session shorter than L, and short sessions do not read long buffers.

The slot after the last is scratch: a step of fewer rows than its bucket fills the rest
with rows there (position 0), whose outputs are dropped.

`SlotStep` runs on any device; the CPU tests hold it to the eager path in float32. Masked
positions weigh exactly 0 after the softmax, so the sums differ from the eager step's only
in their order.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from tessera.stages.families.spec.attention import AttentionSpec, CacheSpec
from tessera.stages.layers.cache import KeyValues, SessionCache
from tessera.stages.layers.rope import RopeKey


class SlotPool:
    """Keys [slots + 1, K, capacity, D] and values [..., Dv] per layer of a span; slot `scratch` pads steps."""

    def __init__(self, specs: Sequence[CacheSpec], *, slots: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if slots < 1 or capacity < 2:
            raise ValueError(f"a slot pool needs slots >= 1 and capacity >= 2, got {slots!r}, {capacity!r}")
        self.capacity = capacity
        self.scratch = slots
        self.keys = [torch.zeros(slots + 1, s.num_kv_heads, capacity, s.head_dim, dtype=dtype, device=device)
                     for s in specs]
        self.values = [torch.zeros(slots + 1, s.num_kv_heads, capacity, s.value_width, dtype=dtype, device=device)
                       for s in specs]  # values' width may differ from the keys' (MiMo-V2-Flash)
        self.windows = [s.window for s in specs]
        self.free = list(range(slots))
        self.slot_of: dict[SessionCache, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def take(self, capacity: int) -> SessionCache | None:
        """A session's cache in a free slot (every layer of the span), or None: none free, or too long."""
        if not self.free or capacity > self.capacity:
            return None
        slot = self.free.pop(0)
        cache = SessionCache.over([KeyValues.over(k[slot, :, :capacity], v[slot, :, :capacity], w)
                                   for k, v, w in zip(self.keys, self.values, self.windows)], capacity)
        self.slot_of[cache] = slot
        return cache

    def give_back(self, cache: SessionCache) -> None:
        slot = self.slot_of.pop(cache, None)
        if slot is not None:
            self.free.append(slot)


class SlotStep:
    """`StepRows` of a decode step over slots: row i is slots[i]'s next token at positions[i];
    a layer's cache is its pool (keys, values [slots + 1, K, capacity, D]); attention reads
    positions [0, length) of each row's slot."""

    def __init__(self, tables: dict[RopeKey, tuple[Tensor, Tensor]], positions: Tensor, slots: Tensor,
                 length: int) -> None:
        self.tables, self.positions, self.slots, self.length = tables, positions, slots, length

    def rope(self, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
        return self.tables[(spec.rope, spec.rope_dim)]

    def attend(self, qk: Tensor, v: Tensor, num_heads: int, cache: tuple[Tensor, Tensor], window: int | None,
               scale: float, sinks: Tensor | None = None) -> Tensor:
        keys, values = cache  # [S, K, C, D]
        r, a, d = qk.shape[0], num_heads, qk.shape[2]
        kv = keys.shape[1]
        heads = torch.arange(kv, device=keys.device)
        at = (self.slots[:, None], heads[None, :], self.positions[:, None])  # [R, K] each, broadcast
        keys.index_put_(at, qk[:, a:])  # [R, K, D] at (slot, head, position)
        values.index_put_(at, v)
        k_rows = keys[:, :, : self.length].index_select(0, self.slots)  # [R, K, L, D]
        v_rows = values[:, :, : self.length].index_select(0, self.slots)
        q = qk[:, :a].reshape(r, kv, a // kv, d)  # [R, K, G, D] (heads h = kv * G + g)
        scores = torch.matmul(q, k_rows.transpose(-1, -2)).mul_(scale)  # [R, K, G, L]
        where = torch.arange(self.length, device=keys.device)[None, :]  # [1, L]
        allowed = where <= self.positions[:, None]  # [R, L]
        if window is not None:
            allowed &= where > self.positions[:, None] - window
        scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:  # each head's sink logit joins the denominator (gpt-oss; layers/attention.py)
            sink = sinks.to(scores.dtype).view(1, kv, a // kv, 1).expand(r, kv, a // kv, 1)
            probs = torch.cat((scores, sink), -1).softmax(-1)[..., : self.length]
        return torch.matmul(probs, v_rows).reshape(r, -1)  # [R, A Dv]
