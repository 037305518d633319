"""The step of a torch.compile'd decode layer: every row one session's next token.

A row's cache write and attention are data-dependent in a way a compiled graph should not
see (its position moves every step; its session's store has its own capacity), so they are
one opaque op, `tessera::decode_attend`, over the session's own store: inside, the eager
code (`layers.attention.attend` over a `KeyValues` on the same buffers) runs as it always
does. Everything around it (norms, projections, RoPE, the residuals, the MLP) is compiled.
The position arrives as a tensor, so no step's position is baked into a graph.
"""

from __future__ import annotations

from typing import Optional, Sequence  # Optional: custom_op reads the annotations

import torch
from torch import Tensor

from tessera.stages.families.spec import AttentionSpec
from tessera.stages.layers.attention import attend
from tessera.stages.layers.cache import KeyValues

NO_WINDOW = -1  # `window` of decode_attend for a layer that attends to every position


@torch.library.custom_op("tessera::decode_attend", mutates_args=("keys", "values"))
def decode_attend(qk: Tensor, v: Tensor, keys: Tensor, values: Tensor, position: Tensor, num_heads: int,
                  window: int, scale: float, sinks: Optional[Tensor]) -> Tensor:
    """One session's next token: write its k, v [1, K, D] at `position` (a 0-d long tensor) of its
    store (keys, values [K, capacity, D]) and attend over its window. qk [1, A + K, D] (rotated);
    sinks [A] or None (layers/attention.py `attend`). Returns [1, A D]."""
    store = KeyValues.over(keys, values, None if window == NO_WINDOW else window)
    return attend(qk, v, num_heads, store, int(position), None, scale, sinks)


@decode_attend.register_fake
def _decode_attend_shape(qk: Tensor, v: Tensor, keys: Tensor, values: Tensor, position: Tensor, num_heads: int,
                         window: int, scale: float, sinks: Optional[Tensor]) -> Tensor:
    return qk.new_empty(qk.shape[0], num_heads * qk.shape[2])


class RowsStep:
    """`StepRows` of a compiled decode step over one layer kind: row i at positions[i], its store
    (keys, values) the i-th of the layer's cache list. cos, sin: the kind's RoPE tables [R, 1, D]."""

    def __init__(self, cos: Tensor, sin: Tensor, positions: Tensor) -> None:
        self.cos, self.sin, self.positions = cos, sin, positions

    def rope(self, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
        return self.cos, self.sin  # one layer kind per compiled function: one RoPE

    def attend(self, qk: Tensor, v: Tensor, num_heads: int, cache: Sequence[tuple[Tensor, Tensor]],
               window: int | None, scale: float, sinks: Tensor | None = None) -> Tensor:
        w = NO_WINDOW if window is None else window
        return torch.cat([  # [R, A D]
            decode_attend(qk[i : i + 1], v[i : i + 1], keys, values, self.positions[i], num_heads, w, scale, sinks)
            for i, (keys, values) in enumerate(cache)
        ])
