"""Per-layer inputs (Gemma 4's PLE): a second input to every decoder layer, computed from the token.

Besides the residual stream, every layer of a Gemma 4 E-model reads a small vector of its own per
token (P = `hidden_size_per_layer_input` values, 256 in the published E2B and E4B). All L of
them come from the token at once, where the embedding is (`PerLayerInputs`, transformers'
`get_per_layer_inputs` and `project_per_layer_inputs`):

    e      = embed(ids) * sqrt(H)                              the embedding the first layer reads
    lookup = table[ids] * sqrt(P)                              [T, L P]: a row of the [V, L P] table
    proj   = RMSNorm_P((e Wpᵀ) * H^-1/2, per layer's P)        [T, L P]: from the embedding
    inputs = (proj + lookup) * 2^-1/2                          layer l's are columns [l P, (l + 1) P)

and each layer adds, after its MLP (`PerLayerGate`, the Block's `per_layer`):

    x = x + RMSNorm_H(W_proj (gelu(W_gate x) * inputs_l))

Where they are computed and how they travel (`ModelSpec.hop_width`): the requester, which holds
the embedding, computes all L slices with it and sends them beside the residual stream; each
stage takes the slices of its layers and hands on those of the layers after it, so a hop into
layer l carries H + (L - l) P values per token (E2B at its first hop: 1,536 + 35 x 256 = 10,496).
The alternative, each peer holding the table columns of its own layers (a [V, P] lookup each:
67M values per layer for E2B, twice the layer's weights) and the hop carrying the token ids,
would also need the embedding at every peer (the projection reads it); not done.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.layers.norm import RMSNorm


class PerLayerGate(nn.Module):
    """A layer's use of its per-layer input (module docstring): gate [P, H], projection [H, P] (called as
    modules, so quantized spans hold their integer forms) and the norm after them."""

    def __init__(self, hidden: int, width: int, eps: float) -> None:
        super().__init__()
        self.w_gate = nn.Linear(hidden, width, bias=False)
        self.w_proj = nn.Linear(width, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
        """x [T, H], the layer's per-layer input [T, P] -> [T, H]."""
        gated = F.gelu(self.w_gate.forward(x), approximate="tanh") * per_layer
        return x + self.norm.forward(self.w_proj.forward(gated))


class PerLayerInputs(nn.Module):
    """Every layer's per-layer input from the token ids and their embedding (module docstring): the
    table [V, L P], the projection [L P, H] and the norm over each layer's P."""

    def __init__(self, vocab: int, hidden: int, num_layers: int, width: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.num_layers, self.width = hidden, num_layers, width
        self.table = nn.Parameter(torch.empty(vocab, num_layers * width))
        self.projection = nn.Parameter(torch.empty(num_layers * width, hidden))
        self.norm = RMSNorm(width, eps)

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """ids [T], the scaled embedding [T, H] -> every layer's inputs [T, L P] (layer l's P at l P),
        in the reference's order of operations and scalars (its scale is a float32 scalar cast to the
        table's dtype, as the embedding's)."""
        t, n, p = ids.shape[0], self.num_layers, self.width
        lookup = F.embedding(ids, self.table) * torch.tensor(p**0.5).to(self.table.dtype)
        projected = F.linear(embedded, self.projection) * self.hidden**-0.5
        projected = self.norm.forward(projected.view(t, n, p)).view(t, n * p)
        return (projected + lookup) * 2.0**-0.5
