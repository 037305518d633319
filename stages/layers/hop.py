"""What crosses a stage boundary: the hop tensor [T, hop_width] a step carries from one stage to the next.

A stage hands the next one what its last layer hands the next layer, plus what the embedding
alone knows that a later layer reads (`ModelSpec.hop_width`). Its columns, in order:

    the residual stream     `streams` rows of H (one, or DeepSeek-V4's `hc_mult` hyper-connection
                            streams: stream s of a token is columns [s H, (s + 1) H))
    the token id            `hop_id_digits` base-256 digits, digit j (least significant first) as
                            d_j / 256, where a layer routes by token id (DeepSeek-V4's hash layers)

A model with one stream and no such layer has a hop of [T, H]: its residual, as before.

The token id rides in digits rather than as one number so that it survives every float a peer
may compute and send in: d / 256 for d < 256 has at most 8 significant bits, exact in float32,
float16 and bfloat16 (an id of 129,279 is not exact in bfloat16). A row-scaled fp8 wire form
would round the digits away: a requester does not send such a hop as fp8 (peer/request).
Everything that moves hops — the wire, a requester's history, spot checks, a replacement's
replay — moves these columns with the residual, and so needs no field of its own.
"""

from __future__ import annotations

import torch

from tessera.stages.families.spec import HOP_ID_DIGIT_BASE, ModelSpec


class Hop:
    """The hop tensor of `spec` (module docstring): packed from an embedding, split into what the
    layers read, joined again after them."""

    def __init__(self, spec: ModelSpec) -> None:
        self.hidden = spec.hidden_size
        self.streams = spec.streams
        self.digits = spec.hop_id_digits
        self.width = spec.hop_width

    @property
    def plain(self) -> bool:
        """Whether the hop is the residual alone, [T, H]: nothing to split or join."""
        return self.width == self.hidden

    def from_embedding(self, embedded: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows [T, H] (of `token_ids` [T]) as the first layer's hop: the residual
        copied into every stream (DeepSeek-V4), then the ids' digits."""
        if self.plain:
            return embedded
        residual = embedded.unsqueeze(1).expand(-1, self.streams, -1) if self.streams > 1 else embedded
        return self.join(residual, token_ids)

    def split(self, hop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A hop [T, hop_width] -> (the residual: [T, H], or [T, streams, H]; the token ids [T] (long)
        where the hop carries them, else None)."""
        if self.plain:
            return hop, None
        t, h = hop.shape[0], self.hidden
        residual = hop[:, : self.streams * h]
        residual = residual.reshape(t, self.streams, h) if self.streams > 1 else residual
        if not self.digits:
            return residual, None
        digits = torch.round(hop[:, self.streams * h :].float() * HOP_ID_DIGIT_BASE).long()  # [T, digits]
        weights = HOP_ID_DIGIT_BASE ** torch.arange(self.digits, device=hop.device)
        return residual, (digits * weights).sum(-1)

    def join(self, residual: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """(residual [T, H] or [T, streams, H], token ids [T]) -> the hop [T, hop_width], in the
        residual's dtype."""
        if self.plain:
            return residual
        flat = residual.reshape(residual.shape[0], self.streams * self.hidden)
        if not self.digits:
            return flat
        assert token_ids is not None, "a hop that carries token ids needs them"
        ids = token_ids.to(device=flat.device, dtype=torch.long)[:, None]
        powers = HOP_ID_DIGIT_BASE ** torch.arange(self.digits, device=flat.device)
        digits = (ids // powers) % HOP_ID_DIGIT_BASE  # [T, digits], least significant first
        return torch.cat((flat, (digits.float() / HOP_ID_DIGIT_BASE).to(flat.dtype)), dim=-1)
