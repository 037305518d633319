"""Configs whose layers mix sliding-window and global attention by `layer_types`, each kind with a
RoPE block of its own (Gemma 4, MiMo-V2-Flash): reading both, as transformers reads them.

`layer_types` lists "sliding_attention" or "full_attention" per layer (a family's default pattern
when absent), and `rope_parameters` is then one RoPE block per kind:

    "rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 1e6, ...},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}

What each block's keys mean is the family's to read (Gemma 4's proportional RoPE, MiMo's
partial rotary); here only their shape is checked (a block of a kind no layer has turns
nothing, as in transformers). Gpt-oss's single window pattern reads its own.
"""

from __future__ import annotations

from typing import Any, Callable

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.config import ConfigReader

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_KINDS = (FULL, SLIDING)


def read_layer_types(config: ConfigReader, num_layers: int, default: Callable[[int], str]) -> list[str]:
    """`layer_types` (one of LAYER_KINDS per layer), or `default(i)` for each layer when absent."""
    kinds = config.value("layer_types", None)
    if kinds is None:
        return [default(i) for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or not all(isinstance(k, str) for k in kinds):
        raise ModelFormatError(f"config field layer_types has an impossible value {kinds!r} "
                               f"(one kind per layer: {num_layers})")
    if set(kinds) - set(LAYER_KINDS):
        raise config.refuse("layer_types", f"only {list(LAYER_KINDS)} are computed")
    return kinds


def rope_blocks(config: ConfigReader, kinds: list[str], defaults: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The RoPE block of each layer kind in `kinds` (`rope_parameters`, or the family's `defaults` when
    absent, as transformers fills them in). ModelFormatError for a block that is not a JSON object or
    is missing for a kind the layers use; a block for a kind no layer has is refused."""
    blocks = config.value("rope_parameters", None)
    config.read.add("rope_scaling")
    if config.has("rope_scaling"):
        raise config.refuse("rope_scaling", "this family reads one RoPE block per layer kind from rope_parameters")
    if blocks is None:
        blocks = defaults
    if not isinstance(blocks, dict) or not all(isinstance(b, dict) for b in blocks.values()):
        raise ModelFormatError(f"config rope_parameters {blocks!r} is not one JSON object per layer kind")
    missing = sorted(set(kinds) - set(blocks))
    if missing:
        raise ModelFormatError(f"config rope_parameters has no block for {missing[0]!r}")
    extra = sorted(set(blocks) - set(LAYER_KINDS))
    if extra:
        raise config.refuse("rope_parameters", f"it holds a block for {extra[0]!r}, which is no layer kind")
    return {kind: dict(blocks[kind]) for kind in set(kinds)}  # a block of a kind no layer has turns nothing
