"""Grouped-query attention (kind "gqa") and what it keeps per session: `AttentionSpec`, its keys and
values a row per position (`CacheSpec`: "full" or "sliding"), or none of its own where it reads an
earlier layer's (`SharedCacheSpec`: Gemma 4's KV-shared layers). Computed in layers/attention.py."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.stages.families.spec.kinds import ATTENTION_KINDS, StateSize, check_field
from tessera.stages.families.spec.rope import RopeSpec


@dataclass(frozen=True)
class CacheSpec(StateSize):
    """What one layer keeps per session and position.

    kind:         "full" or "sliding" (CACHE_KINDS).
    num_kv_heads, head_dim: the keys' and values' shape per position.
    window:       for "sliding", the positions a query reads (its own and the W - 1 before).
    value_dim:    the values' width per head where it differs from the keys' (MiMo-V2-Flash: 128
                  against 192), else None.

    A sliding layer keeps every position too: a write at position p rolls the cache back to
    p (speculation, a step re-sent after a repair, the chunks of a prefill re-sent after one),
    and the requester may rewrite from any earlier position (a spot check's checker goes back
    to the step it doubts; a pipelined prefill re-sends every chunk after a repaired one), so
    a ring of W positions (plus any slack) could not honour every rollback it is sent. What
    the window saves is reading: decode reads W positions, not the whole context. (A span
    with a recurrent layer honours only near rollbacks anyway, `RecurrentStateSpec`; a ring
    there would be a store with fixed bytes W + its reach, `reachable` as the recurrent
    store's: no family run here mixes the two yet, docs/pages/models.md.)
    """

    kind: str
    num_kv_heads: int
    head_dim: int
    window: int | None = None
    value_dim: int | None = None

    def __post_init__(self) -> None:
        check_field(self.kind in ("full", "sliding"), "cache kind", self.kind)
        check_field((self.kind == "sliding") == (self.window is not None), "sliding_window", self.window)

    @property
    def value_width(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    def bytes_per_position(self, itemsize: int) -> int:
        return self.num_kv_heads * (self.head_dim + self.value_width) * itemsize


@dataclass(frozen=True)
class SharedCacheSpec(StateSize):
    """What a layer that reads another layer's keys and values keeps per session (kind "shared"):
    nothing. Gemma 4's KV-shared layers (`AttentionSpec.kv_source`) attend over the store of layer
    `source` (absolute index), which runs before them in the same span (`ModelSpec.span_starts`
    keeps them together), so the session's cache holds that store once (layers/cache.py)."""

    source: int
    kind: str = "shared"

    def __post_init__(self) -> None:
        check_field(self.kind == "shared", "cache kind", self.kind)
        check_field(self.source >= 0, "num_kv_shared_layers", self.source)


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention. kind "gqa": grouped-query attention.

    num_heads (A) query heads share num_kv_heads (K) key/value heads, A % K == 0; head_dim (D).
    rope:     the rotary embedding of q and k.
    window:   attend only to the last `window` positions (sliding), or None (all of them).
    qkv_bias: q, k and v projections carry a bias (Qwen2; Qwen3 with attention_bias).
    o_bias:   the output projection carries one (Qwen3 with attention_bias).
    qk_norm:  q and k get an RMSNorm over each head's D before RoPE (Qwen3);
    qk_norm_whole: with `qk_norm`, the RMSNorm runs over all of q's heads at once (A D values, one
              weight each) and over all of k's (K D), not per head (MiniMax-M2).
    rotary_dim: RoPE turns only the first `rotary_dim` dims of each head (GLM's partial rotary,
              `partial_rotary_factor`), the rest pass unrotated; None: all D.
    sinks:    each head has a learned logit that joins its softmax's denominator and no value
              (gpt-oss's attention sinks): the weights of a row sum to less than one.
    output_gate: the query projection gives each head a gate beside its query (rows per head: D
              of query, D of gate), and the attention's output is multiplied by sigmoid(gate)
              before Wo (Qwen3-Next's and Qwen3.5's gated attention).
    value_dim: the width of each value head where it differs from `head_dim` (MiMo-V2-Flash: 128
              against q/k's 192); the output projection reads A x value_dim. None: head_dim.
    value_scale: values are multiplied by it before they are cached (MiMo-V2-Flash's
              `attention_value_scale`, 0.707); 1.0: not at all.
    scale:    the scores' scale; None: 1/sqrt(head_dim). Gemma 4 scales by 1 (its q and k norms
              set their size).
    v_norm:   each value head is RMSNormed without a weight before it is cached (Gemma 4).
    k_eq_v:   no value projection: the values are the key projection's output, before the key's
              norm and RoPE (Gemma 4's `attention_k_eq_v` global layers).
    kv_source: the layer (absolute index) whose cached keys and values this layer attends over; it
              projects only queries and caches nothing (Gemma 4's KV-shared layers: the last
              `num_kv_shared_layers` read the last earlier layer of their kind). None: its own.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec = RopeSpec()
    kind: str = "gqa"
    window: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rotary_dim: int | None = None
    sinks: bool = False
    qk_norm_whole: bool = False
    output_gate: bool = False
    value_dim: int | None = None
    value_scale: float = 1.0
    scale: float | None = None
    v_norm: bool = False
    k_eq_v: bool = False
    kv_source: int | None = None

    def __post_init__(self) -> None:
        check_field(self.kind in ATTENTION_KINDS, "attention kind", self.kind)
        check_field(self.value_dim is None or self.value_dim > 0, "v_head_dim", self.value_dim)
        check_field(self.value_scale > 0, "attention_value_scale", self.value_scale)
        check_field(self.scale is None or self.scale > 0, "attention scale", self.scale)
        check_field(not self.k_eq_v or self.value_dim is None, "attention_k_eq_v", self.k_eq_v)
        check_field(self.kv_source is None or (self.kv_source >= 0 and not self.k_eq_v), "num_kv_shared_layers",
               self.kv_source)
        check_field(self.num_heads > 0, "num_attention_heads", self.num_heads)
        check_field(self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0, "num_key_value_heads",
               self.num_kv_heads)
        check_field(self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim", self.head_dim)
        check_field(self.window is None or self.window > 0, "sliding_window", self.window)
        check_field(self.rotary_dim is None or (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0),
               "partial_rotary_factor", self.rotary_dim)
        check_field(self.qk_norm or not self.qk_norm_whole, "use_qk_norm", self.qk_norm)

    @property
    def rope_dim(self) -> int:
        """The dims of each head RoPE turns (its tables' width: layers/rope.py)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def value_width(self) -> int:
        """Each value head's width (`value_dim`, else `head_dim`)."""
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def v_size(self) -> int:
        return self.num_kv_heads * self.value_width

    @property
    def kv_rows(self) -> int:
        """Rows of the stacked projection after q's: k and v; k alone (`k_eq_v`); none (`kv_source`)."""
        if self.kv_source is not None:
            return 0
        return self.kv_size if self.k_eq_v else self.kv_size + self.v_size

    @property
    def cache(self) -> CacheSpec | SharedCacheSpec:
        if self.kv_source is not None:
            return SharedCacheSpec(self.kv_source)
        kind = "full" if self.window is None else "sliding"
        return CacheSpec(kind, self.num_kv_heads, self.head_dim, self.window, self.value_dim)

    @property
    def q_rows(self) -> int:
        """Rows of the query projection: the queries, and each head's gate beside its query."""
        return 2 * self.q_size if self.output_gate else self.q_size

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of its weight matrices as the engine stacks them: wqkv (q, and its gate, k, v as
        the layer has them), wo."""
        return [(self.q_rows + self.kv_rows, hidden), (hidden, self.num_heads * self.value_width)]

    def param_count(self, hidden: int) -> int:
        bias = (self.q_rows + self.kv_rows if self.qkv_bias else 0) + (hidden if self.o_bias else 0)
        if self.qk_norm_whole:
            norms = self.q_size + self.kv_size
        else:  # per head: q's, and k's unless the layer reads another's keys (the value norm has no weight)
            norms = self.head_dim * (1 if self.kv_source is not None else 2) if self.qk_norm else 0
        sinks = self.num_heads if self.sinks else 0
        return sum(r * c for r, c in self.matrices(hidden)) + bias + norms + sinks
