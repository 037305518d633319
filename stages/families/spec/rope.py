"""Rotary position embedding as plain data: `RopeSpec`, one per distinct RoPE of a model (its kind and
parameters), computed in layers/rope.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.stages.families.spec.kinds import check_field

# "proportional": Gemma 4's, turning only the first pairs of each half of a head (RopeSpec).
# "none": no position encoding at all (NoPE: Kimi Linear's MLA, Nemotron-H's attention), turned by identity
# tables (cos 1, sin 0: layers/rope.py), so that every attention path runs unchanged and exactly
ROPE_KINDS = ("default", "linear", "llama3", "yarn", "none", "proportional")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding of one attention kind.

    kind:   "default" (plain RoPE), "linear", "llama3" or "yarn" (scaled frequencies; yarn also
            scales cos and sin: layers/rope.py's `attention_scaling`), or "none" (no position
            encoding: the rotation is the identity).
    theta:  the base frequency.
    params: the kind's parameters as sorted (name, value) pairs (hashable: the stage keeps
            one table of cos/sin per distinct RoPE): linear's `factor`; llama3's `factor`,
            `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`; yarn's
            `factor` and `original_max_position_embeddings`, and those of `attention_factor`,
            `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`, `truncate` the config sets;
            proportional's `partial_rotary_factor` (the fraction of each half of a head turned:
            frequencies theta^(-2i/D) for the first pairs, 0 for the rest) and optional `factor`.
    """

    kind: str = "default"
    theta: float = 10000.0
    params: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        check_field(self.kind in ROPE_KINDS, "rope_type", self.kind)
        check_field(self.theta > 0, "rope_theta", self.theta)

    def param(self, name: str) -> float:
        return float(dict(self.params)[name])

    def optional(self, name: str) -> Any:
        """A parameter the config may leave out (None when it did)."""
        return dict(self.params).get(name)
