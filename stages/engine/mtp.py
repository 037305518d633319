"""An MTP module at run time: its ends, its block as a one-layer Stage with sessions, and the head's edges.

`MtpStage` runs where the model's head runs (a requester, beside its sampler): it borrows that
Stage's embedding, final norm and head (the module shares them: families/mtp.py), and keeps, per
session, its block's cache, which moves as any Stage's does (a write at position p rolls it back
to p; `rollback` cuts it). Its positions are the module's own: position j holds the pair (h, next
token) of the j-th pair it was fed, whatever the model position (attention reads relative
positions, so where a pair's RoPE angle starts changes nothing but rounding).
`stages/assembly/mtp.py` builds one from a folder; stages/decoding/mtp.py drafts with it.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
import torch.nn.functional as F

from tessera.stages.engine.stage import Stage
from tessera.stages.errors import SpanError
from tessera.stages.families.mtp import MtpSpec
from tessera.stages.layers.mtp import MtpEnds


class MtpStage:
    """The first MTP module of a model over `head`'s embedding and head (module docstring)."""

    def __init__(self, spec: MtpSpec, ends: MtpEnds, block: Stage, head: Stage) -> None:
        if head.embedding is None or head.head is None or head.norm is None:
            raise SpanError("an MTP module runs beside the model's embedding, final norm and head")
        self.spec = spec
        self.ends = ends
        self.block = block
        self.edges = head

    # -- sessions: the block's cache -----------------------------------------------------------

    def open(self, session: Hashable, *, capacity: int) -> None:
        self.block.open(session, capacity=capacity)

    def close(self, session: Hashable) -> None:
        self.block.close(session)

    def rollback(self, session: Hashable, position: int) -> None:
        self.block.rollback(session, position)

    def position(self, session: Hashable) -> int:
        return self.block.position(session)

    # -- compute -------------------------------------------------------------------------------

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last layer's output [T, H] -> after the model's final norm (what the module reads)."""
        x = hidden.to(self.block.device, self.block.dtype)
        return F.rms_norm(x, self.edges.norm.shape, self.edges.norm.to(x.dtype), self.edges.spec.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, session: Hashable, next_tokens: Sequence[int], hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Pairs (hidden[j], next_tokens[j]) at the session's positions [start, start + T): `hidden` [T, H]
        after the model's final norm (or a chained output) -> the outputs o [T, H] the head reads."""
        embedded = self.edges.embed(list(next_tokens)).to(self.block.device, self.block.dtype)
        x = self.ends.into_block(embedded, hidden.to(self.block.device, self.block.dtype))
        return self.ends.out_of_block(self.block.forward(session, x, start))

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs [T, H] -> float32 logits [T, V] of the tokens two ahead, through the model's head."""
        return F.linear(out.to(self.edges.head.dtype), self.edges.head).float()
