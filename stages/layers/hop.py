"""What crosses a stage boundary: the hop tensor [T, hop_width(layer)] a step carries into layer `layer`.

A stage hands the next one what its last layer hands the next layer, plus what only the embedding
knows that a layer still to run reads (`ModelSpec.hop_width`). Its columns, in order:

    the residual stream     `streams` rows of H (one, or DeepSeek-V4's `hc_mult` hyper-connection
                            streams: stream s of a token is columns [s H, (s + 1) H))
    the token id            `hop_id_digits` base-256 digits, digit j (least significant first) as
                            d_j / 256, where a layer routes by token id (DeepSeek-V4's hash layers)
    the per-layer inputs    P values for each layer still to run, in layer order (Gemma 4's
                            E-models: layers/per_layer.py), the first P those of the next layer

A model with one stream, no such layer and no per-layer inputs has a hop of [T, H] into every
layer: its residual, as before. Every part but the per-layer inputs is as wide into every layer;
those shrink by P a layer run, since a stage uses its layers' and hands on only the rest (the
width therefore depends on where a span starts: docs/pages/models.md says why it is not padded
to one width).

The token id rides in digits rather than as one number so that it survives every float a peer
may compute and send in: d / 256 for d < 256 has at most 8 significant bits, exact in float32,
float16 and bfloat16 (an id of 129,279 is not exact in bfloat16). A row-scaled fp8 wire form
would round the digits away: a requester does not send such a hop as fp8 (peer/request).
Everything that moves hops — the wire, a requester's history, spot checks, a replacement's
replay — moves these columns with the residual, and so needs no field of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tessera.stages.families.spec.model import HOP_ID_DIGIT_BASE, ModelSpec


class HopParts(NamedTuple):
    """A hop split into what the layers read (`Hop.split`)."""

    residual: torch.Tensor  # [T, H], or [T, streams, H]
    token_ids: torch.Tensor | None  # [T] (long) where the hop carries them
    per_layer: torch.Tensor | None  # [T, n P]: the per-layer inputs of the n layers still to run, in order


class Hop:
    """The hop tensor of `spec` (module docstring): packed from an embedding, split into what the
    layers read, joined again after them."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.hidden = spec.hidden_size
        self.streams = spec.streams
        self.digits = spec.hop_id_digits
        self.per_layer_width = spec.per_layer_width

    @property
    def plain(self) -> bool:
        """Whether the hop into every layer is the residual alone, [T, H]: nothing to split or join."""
        return self.streams == 1 and not self.digits and not self.per_layer_width

    def width(self, layer: int) -> int:
        """Values per token of the hop into layer `layer` (`ModelSpec.hop_width`)."""
        return self.spec.hop_width(layer)

    def from_embedding(self, embedded: torch.Tensor, token_ids: torch.Tensor,
                       per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """The embedding's rows [T, H] (of `token_ids` [T]) as the first layer's hop: the residual
        copied into every stream (DeepSeek-V4), the ids' digits, and every layer's per-layer input
        `per_layer` [T, L P] where the layers take them (Gemma 4)."""
        if self.plain:
            return embedded
        residual = embedded.unsqueeze(1).expand(-1, self.streams, -1) if self.streams > 1 else embedded
        return self.join(HopParts(residual, token_ids, per_layer))

    def split(self, hop: torch.Tensor) -> HopParts:
        """A hop [T, hop_width(layer)] -> its parts (HopParts); the per-layer inputs are whatever
        columns follow the residual and the digits, those of the layers still to run."""
        if self.plain:
            return HopParts(hop, None, None)
        t, h = hop.shape[0], self.hidden
        residual = hop[:, : self.streams * h]
        residual = residual.reshape(t, self.streams, h) if self.streams > 1 else residual
        after = self.streams * h + self.digits
        per_layer = hop[:, after:] if self.per_layer_width else None
        if not self.digits:
            return HopParts(residual, None, per_layer)
        digits = torch.round(hop[:, self.streams * h : after].float() * HOP_ID_DIGIT_BASE).long()  # [T, digits]
        weights = HOP_ID_DIGIT_BASE ** torch.arange(self.digits, device=hop.device)
        return HopParts(residual, (digits * weights).sum(-1), per_layer)

    def join(self, parts: HopParts) -> torch.Tensor:
        """Parts (residual [T, H] or [T, streams, H], token ids [T], per-layer inputs [T, n P]) -> the
        hop [T, hop_width], in the residual's dtype."""
        if self.plain:
            return parts.residual
        residual = parts.residual
        columns = [residual.reshape(residual.shape[0], self.streams * self.hidden)]
        if self.digits:
            assert parts.token_ids is not None, "a hop that carries token ids needs them"
            ids = parts.token_ids.to(device=residual.device, dtype=torch.long)[:, None]
            powers = HOP_ID_DIGIT_BASE ** torch.arange(self.digits, device=residual.device)
            digits = (ids // powers) % HOP_ID_DIGIT_BASE  # [T, digits], least significant first
            columns.append((digits.float() / HOP_ID_DIGIT_BASE).to(residual.dtype))
        if self.per_layer_width and parts.per_layer is not None and parts.per_layer.shape[1]:
            columns.append(parts.per_layer.to(residual.dtype))
        return columns[0] if len(columns) == 1 else torch.cat(columns, dim=-1)
