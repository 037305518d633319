"""Rotary position embedding: the frequencies of a `RopeSpec`, and the rotation.

A stage holds one `Rotary` per distinct (RopeSpec, head_dim) among its layers (`RopeTables`)
and, once per step, the cos/sin tables every layer of that kind shares (`StepContext.rope`),
so that a layer's rotation is 4 kernels. A new RoPE kind (YaRN; partial rotary, which rotates only the
first dims of a head) is a branch of `rope_frequencies` (and, for partial, of `apply_rope`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.spec import LayerSpec, RopeSpec

# The key of a layer's RoPE tables: its RopeSpec and head dim (layers/attention.py's StepContext.rope).
RopeKey = tuple[RopeSpec, int]


class Rotary(nn.Module):
    """RoPE frequencies; `cos_sin(positions)` gives the tables `apply_rope` takes."""

    def __init__(self, rope: RopeSpec, head_dim: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_frequencies(rope, head_dim, device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables `apply_rope` takes, [T, 1, D]: (cos, cos) and (-sin, sin) per half.

        Computed in float32 whatever the model dtype, then cast to the activations' `dtype`,
        as the reference implementation does.
        """
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = angles.cos(), angles.sin()
        cos, sin = torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, D]


class RopeTables:
    """One `Rotary` per distinct (RopeSpec, head_dim) among `layers`, and each step's tables."""

    def __init__(self, layers: Sequence[LayerSpec], device: torch.device | str = "cpu") -> None:
        keys = {(layer.attention.rope, layer.attention.head_dim) for layer in layers}
        self.rotaries = {key: Rotary(*key, device=device) for key in sorted(keys, key=repr)}

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[RopeKey, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin [T, 1, D] of every rotary, for rows at `positions` [T]."""
        return {key: rotary.cos_sin(positions, dtype) for key, rotary in self.rotaries.items()}


def rope_frequencies(rope: RopeSpec, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies [D/2], with Llama-3 or linear scaling when the spec asks."""
    d = head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.param("factor")
    elif rope.kind == "llama3":
        factor = rope.param("factor")
        low, high = rope.param("low_freq_factor"), rope.param("high_freq_factor")
        old_context = rope.param("original_max_position_embeddings")
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope.kind != "default":
        raise UnsupportedModel(f"rope type {rope.kind!r} has no frequencies here (default, linear, llama3)")
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by `Rotary.cos_sin`'s tables (the half-split layout Hugging Face uses):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the same products and sums as the reference."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (x2, x1)
    return x * cos + swapped * sin
