"""The two ends of a multi-token-prediction module, around its decoder block (families/mtp.py).

    into the block:  x = W_proj [enorm(emb(t_{i+1})) ; hnorm(h_i)]     (hnorm's half first: `hidden_first`)
    out of it:       o = out_norm(block(x))

h_i is the model's last hidden state after its final norm; o is what the model's head reads
(and what a chained draft reads in place of h_{i+1}). The block between them is a `Block` of the
model's own kinds, run with its cache by a Stage (stages/engine/mtp.py). Norms are RMSNorms (a
zero-centred family's offset added at load, as every other norm's), the projection has no bias;
in float32 this module is the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.stages.layers.norm import RMSNorm


class MtpEnds(nn.Module):
    """enorm, hnorm, the projection [H, 2H] and the output norm of one MTP module."""

    def __init__(self, hidden: int, eps: float, *, hidden_first: bool = False) -> None:
        super().__init__()
        self.embed_norm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.out_norm = RMSNorm(hidden, eps)
        self.hidden_first = hidden_first

    def into_block(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Embeddings of the next tokens and the hidden states before them, [T, H] each -> the block's input [T, H]."""
        e, h = self.embed_norm.forward(embedded), self.hidden_norm.forward(hidden)
        return self.proj(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))

    def out_of_block(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output [T, H] -> what the head reads [T, H]."""
        return self.out_norm.forward(x)
