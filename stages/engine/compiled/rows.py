"""The step of a torch.compile'd decode graph: every row one session's next token.

A row's cache write and attention are data-dependent in a way a compiled graph should not
see (its position moves every step; its session's store has its own capacity, and grows), so
they are one opaque op per layer, `tessera::decode_attend`: inside, the eager code
(`layers.attention.attend` over the session's `KeyValues`) runs as it always does. Everything
around it (norms, projections, RoPE, the residuals, the MLP, and where the graph holds them the
embedding, the final norm, the head and the argmax) is compiled.

The op takes no store and no position: a graph whose inputs were every session's stores would
guard on each one's size (a session's capacity: one symbol per store, and a recompile when two
stacked sessions' capacities differ), and would take 2 x layers x rows tensors a call. Instead
the caller names the step's rows before it calls a graph (`rows_of_step`): each row's position
and, per layer of the graph, each row's store; the op reads them by the layer's index within
the graph. The names live in a thread-local, since stages in one process (a test's swarm, the
requester beside a peer) run on different threads at once. Rows past the step's own (padding
up to a row bucket) attend nowhere: their outputs are zeros, dropped by the caller.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence  # Optional: custom_op reads the annotations

import torch
from torch import Tensor

from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.layers.attention import attend
from tessera.stages.layers.cache import KeyValues

@dataclass
class StepRows:
    """The rows of the step being run: row i (of `rows` real ones) is at positions[i]; stores[j][i]
    is its store in layer j of the graph being called (set per graph: `stores`)."""

    positions: list[int]
    rows: int
    stores: Sequence[Sequence[KeyValues]] = ()


_current = threading.local()


@contextmanager
def rows_of_step(rows: StepRows) -> Iterator[StepRows]:
    """Name `rows` as this thread's step while the graphs of one step run."""
    outer = getattr(_current, "rows", None)
    _current.rows = rows
    try:
        yield rows
    finally:
        _current.rows = outer


@torch.library.custom_op("tessera::decode_attend", mutates_args=())
def decode_attend(qk: Tensor, v: Tensor, layer: int, num_heads: int, scale: float, sinks: Optional[Tensor]) -> Tensor:
    """Each row's next token: write its k, v [1, K, D] at its position of its store in layer `layer`
    of the graph, and attend over the store's window (its CacheSpec's: the layer's own). qk
    [R, A + K, D] (rotated); sinks [A] or None (layers/attention.py `attend`). Returns [R, A Dv]; a
    padding row's is zeros. It mutates no argument: the stores it writes are not graph inputs, and
    each layer's call feeds the next layer's input, so the graph neither drops nor reorders it."""
    step: StepRows = _current.rows
    stores = step.stores[layer]
    outs = [attend(qk[i : i + 1], v[i : i + 1], num_heads, stores[i], step.positions[i], None, scale, sinks)
            for i in range(step.rows)]
    if qk.shape[0] > step.rows:
        outs.append(qk.new_zeros(qk.shape[0] - step.rows, num_heads * v.shape[2]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


@decode_attend.register_fake
def _decode_attend_shape(qk: Tensor, v: Tensor, layer: int, num_heads: int, scale: float,
                         sinks: Optional[Tensor]) -> Tensor:
    return qk.new_empty(qk.shape[0], num_heads * v.shape[2])  # [R, A Dv]: values may be narrower (MiMo)


class RowsStep:
    """`StepRows` (layers/attention.py) of a compiled decode graph. A layer's cache is its index in
    the graph (the op finds the rows' stores by it); `table` is the RoPE of the layer running
    (cos, sin [R, 1, D]), set by the graph before each layer."""

    def __init__(self, table: tuple[Tensor, Tensor] | None = None) -> None:
        self.table = table

    def rope(self, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
        assert self.table is not None, "the graph sets each layer's RoPE before it runs"
        return self.table

    def attend(self, qk: Tensor, v: Tensor, num_heads: int, cache: int, window: int | None, scale: float,
               sinks: Tensor | None = None) -> Tensor:
        return decode_attend(qk, v, cache, num_heads, scale, sinks)  # the store keeps `window`
