"""The closed sets of kinds a layer's token mixer and its session state name, what every state kind
answers about its bytes (`StateSize`), and the check every spec's field goes through.

Whoever reads a kind (layers/block.py builds modules, layers/cache.py allocates caches) refuses
one it does not know, so a kind added to a set here without its module fails loudly, never
silently. The MLP's, router's and activation's kinds sit with their specs (spec/mlp.py), RoPE's
with `RopeSpec` (spec/rope.py).
"""

from __future__ import annotations

from tessera.stages.errors import ModelFormatError

# grouped-query attention (multi-head and multi-query included); multi-head latent; MLA with DeepSeek's sparse
# attention; Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5: a recurrent state, no rows per position);
# Kimi Delta Attention (Kimi Linear: the same with a decay per channel); Mamba2's state-space mixer (Nemotron-H);
# DeepSeek-V4's one-head attention over a window and compressed entries (CompressedAttentionSpec)
ATTENTION_KINDS = ("gqa", "mla", "dsa", "gated_deltanet", "kda", "mamba2", "compressed")
# keys and values of every position (only the window is read); MLA's latent; the latent and DSA's index keys;
# a fixed recurrent state and convolution window (linear attention: RecurrentStateSpec); nothing (a layer
# with no token mixer, only an MLP: StatelessSpec); DeepSeek-V4's window and compressed entries
# (CompressedCacheSpec); nothing of its own, the layer reading another layer's keys and values (Gemma 4's
# KV-shared layers: SharedCacheSpec)
CACHE_KINDS = ("full", "sliding", "latent", "latent_indexed", "recurrent", "none", "compressed", "shared")


class StateSize:
    """What every session-state spec (a layer's `cache`: CACHE_KINDS) answers, for admission and
    placement to budget a session: `fixed_bytes`, what it holds whatever its length (a recurrent
    state, rings), `bytes_per_position`, what each position adds (rows of keys and values, latents,
    compressed entries), and `bytes(capacity)` = fixed + per position x capacity, checked before
    allocating. A kind says what it holds; what it does not hold counts 0."""

    def fixed_bytes(self, itemsize: int) -> int:
        return 0

    def bytes_per_position(self, itemsize: int) -> int:
        return 0

    def bytes(self, capacity: int, itemsize: int) -> int:
        """Bytes a session of `capacity` positions costs in this layer (checked before allocating)."""
        return self.fixed_bytes(itemsize) + self.bytes_per_position(itemsize) * capacity


def check_field(ok: bool, name: str, value: object) -> None:
    """ModelFormatError naming config field `name` and its `value` unless `ok`."""
    if not ok:
        raise ModelFormatError(f"config field {name} has an impossible value {value!r}")
