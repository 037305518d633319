"""Rotary position embedding: the frequencies of a `RopeSpec`, and the rotation.

A stage holds one `Rotary` per distinct (RopeSpec, head_dim) among its layers (`RopeTables`)
and, once per step, the cos/sin tables every layer of that kind shares (`StepContext.rope`),
so that a layer's rotation is 4 kernels. A new RoPE kind is a branch of `rope_frequencies`
(and of `attention_scaling` if it scales cos and sin). Kind "none" (NoPE: Kimi Linear's MLA,
Nemotron-H's attention) is the identity: angles 0, so x cos + rotate(x) sin = x exactly, and
every attention path (eager, compiled, CUDA graphs, shards) runs unchanged.

YaRN (transformers' `_compute_yarn_parameters`): frequencies blended between the original
ones (extrapolated, the fast dims) and ones divided by `factor` (interpolated, the slow dims)
by a linear ramp over the dims whose wavelengths lie between `beta_fast` and `beta_slow`
rotations in the original context; and cos and sin multiplied by `attention_factor` (when
the config gives none: 0.1 ln(factor) + 1, or with `mscale` and `mscale_all_dim` the ratio
of those two `yarn_mscale`s), which scales every attention logit by its square.

Proportional (Gemma 4's global layers, `proportional_frequencies`): a head's first pairs turn at
the frequencies of the whole head's, the rest not at all.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.rope import RopeSpec

# The key of a layer's RoPE tables: its RopeSpec and the dims it turns (layers/attention.py's StepContext.rope):
# the head dim, the first dims of a head under partial rotary (GLM), MLA's rope head.
RopeKey = tuple[RopeSpec, int]


class Rotary(nn.Module):
    """RoPE frequencies; `cos_sin(positions)` gives the tables `apply_rope` takes."""

    def __init__(self, rope: RopeSpec, head_dim: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_frequencies(rope, head_dim, device), persistent=False)
        self.scaling = attention_scaling(rope)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables `apply_rope` takes, [T, 1, D]: (cos, cos) and (-sin, sin) per half.

        Computed in float32 whatever the model dtype, then cast to the activations' `dtype`,
        as the reference implementation does.
        """
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = angles.cos(), angles.sin()
        if self.scaling != 1.0:  # YaRN: float32, before the cast, as the reference scales them
            cos, sin = cos * self.scaling, sin * self.scaling
        cos, sin = torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, D]


class RopeTables:
    """One `Rotary` per distinct (RopeSpec, dims turned) among `layers`, and each step's tables."""

    def __init__(self, layers: Sequence[LayerSpec], device: torch.device | str = "cpu") -> None:
        # a layer without a rotary embedding (linear attention, state-space: rope None; no mixer) has no tables
        keys = {(layer.attention.rope, layer.attention.rope_dim) for layer in layers
                if layer.attention is not None and layer.attention.rope is not None}
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
    elif rope.kind == "yarn":
        inv_freq = yarn_frequencies(rope, d, device)
    elif rope.kind == "none":  # no position encoding: every angle 0, so cos 1 and sin 0 turn nothing (exactly)
        inv_freq = torch.zeros_like(inv_freq)
    elif rope.kind == "proportional":
        inv_freq = proportional_frequencies(rope, d, device)
    elif rope.kind != "default":
        raise UnsupportedModel(f"rope type {rope.kind!r} has no frequencies here "
                               "(default, linear, llama3, yarn, none, proportional)")
    return inv_freq


def proportional_frequencies(rope: RopeSpec, dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gemma 4's "proportional" RoPE (transformers' `_compute_proportional_rope_parameters`): over the
    whole head, the first `partial_rotary_factor` x D/2 pairs at theta^(-2i/D) (D, not the dims turned),
    the rest at frequency 0 (cos 1, sin 0: passed through unchanged), all divided by `factor`. The
    pairs are (i, i + D/2) as everywhere here, so the dims turned are the first ones of each half."""
    angles = int(rope.param("partial_rotary_factor") * dim // 2)
    turned = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).float() / dim))
    inv_freq = torch.cat((turned, torch.zeros(dim // 2 - angles, dtype=torch.float32, device=device)))
    return inv_freq / float(rope.optional("factor") or 1.0)


def yarn_frequencies(rope: RopeSpec, dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """YaRN's inverse frequencies [dim/2] (module docstring), the reference's float32 arithmetic op for op."""
    base, factor = rope.theta, rope.param("factor")
    old_context = rope.param("original_max_position_embeddings")
    beta_fast = rope.optional("beta_fast") or 32  # `or`: 0 means the default too, as transformers reads it
    beta_slow = rope.optional("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` in the old context
        return (dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.optional("truncate") is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    extrapolated = 1 - ramp  # 1: the dim keeps its original frequency
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the original: 0.1 mscale ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(rope: RopeSpec) -> float:
    """What cos and sin are multiplied by: 1, except YaRN's `attention_factor` (module docstring)."""
    if rope.kind != "yarn":
        return 1.0
    given = rope.optional("attention_factor")
    if given is not None:
        return float(given)
    factor, mscale, mscale_all_dim = rope.param("factor"), rope.optional("mscale"), rope.optional("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by `Rotary.cos_sin`'s tables (the half-split layout Hugging Face uses):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the same products and sums as the reference.
    Tables narrower than D (partial rotary) turn the first dims and pass the rest through."""
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :turned], cos, sin), x[..., turned:]), dim=-1)
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (x2, x1)
    return x * cos + swapped * sin
