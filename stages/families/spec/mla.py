"""Multi-head latent attention (kind "mla": DeepSeek-V2/V3, GLM-5) and its sparse form with an indexer
(kind "dsa": `DsaSpec`), with what each keeps per session and position: one latent row shared by every
head (`LatentCacheSpec`), and the indexer's key beside it (`IndexedLatentCacheSpec`). Computed in
layers/mla.py and layers/dsa.py."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.stages.families.spec.kinds import StateSize, check_field
from tessera.stages.families.spec.rope import RopeSpec


@dataclass(frozen=True)
class LatentCacheSpec(StateSize):
    """What an MLA layer keeps per session and position (kind "latent"): the compressed key/value
    `latent_dim` wide (kv_lora_rank, after its norm) and the rotated RoPE key `rope_dim` wide,
    one row shared by every head — not K and V per head. DeepSeek-V3: 512 + 64 values a
    position, against 2 x 128 heads x 192/128 for the keys and values they expand to.

    A sparse-attention layer (DSA, GLM-5) whose indexer runs keeps its index keys beside these:
    `IndexedLatentCacheSpec`.
    """

    latent_dim: int
    rope_dim: int
    kind: str = "latent"

    def __post_init__(self) -> None:
        check_field(self.kind == "latent", "cache kind", self.kind)
        check_field(self.latent_dim > 0, "kv_lora_rank", self.latent_dim)
        check_field(self.rope_dim > 0, "qk_rope_head_dim", self.rope_dim)

    @property
    def width(self) -> int:
        return self.latent_dim + self.rope_dim

    def bytes_per_position(self, itemsize: int) -> int:
        return self.width * itemsize


@dataclass(frozen=True)
class MlaSpec:
    """One layer's multi-head latent attention (kind "mla": DeepSeek-V2/V3, GLM-5).

    num_heads (A) query heads. Queries: x Wq, or low-rank x Wq_a (`q_lora_rank` wide), RMSNorm,
    Wq_b; each head's `qk_nope_head_dim` (Dn) dims then `qk_rope_head_dim` (Dr) dims. Keys and
    values from one latent: x Wkv_a gives the compressed kv (`kv_lora_rank`, C, then RMSNorm) and
    ONE rope key (Dr) shared by all heads; Wkv_b expands the latent to each head's key (Dn) and
    value (`v_head_dim`, Dv). A head's key is its Dn expanded dims then the shared rope key.
    RoPE turns only the Dr dims of q and of the rope key (interleaved pairs when
    `rope_interleave`: DeepSeek's layout). Scores are scaled by (Dn + Dr)^-1/2, times
    yarn_mscale(factor, mscale_all_dim)^2 when the RoPE is YaRN with `mscale_all_dim`.
    bias:     Wq_a, Wkv_a and the output projection carry a bias (`attention_bias`).
    norm_eps: epsilon of the q and kv latent RMSNorms (transformers builds them with its default,
              1e-6, not the model's rms_norm_eps).

    The cache holds the latent and the rope key (`LatentCacheSpec`); layers/mla.py attends
    either by expanding keys and values from it, or in latent space (Wkv_b absorbed into q and
    into the output), whichever costs less for the step.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope: RopeSpec = RopeSpec()
    rope_interleave: bool = False
    bias: bool = False
    norm_eps: float = 1e-6
    kind: str = "mla"

    def __post_init__(self) -> None:
        check_field(self.kind == "mla", "attention kind", self.kind)
        for name, value in (("num_attention_heads", self.num_heads), ("kv_lora_rank", self.kv_lora_rank),
                            ("qk_nope_head_dim", self.qk_nope_head_dim), ("v_head_dim", self.v_head_dim)):
            check_field(value > 0, name, value)
        check_field(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
               self.qk_rope_head_dim)
        check_field(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", self.q_lora_rank)

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache(self) -> LatentCacheSpec:
        return LatentCacheSpec(self.kv_lora_rank, self.qk_rope_head_dim)

    @property
    def kv_b_shape(self) -> tuple[int, int]:
        """Wkv_b [A (Dn + Dv), C]: kept in float (not a matrix quantization stores), since absorbed
        decode reads it as a matrix per head rather than calling it as a linear."""
        return (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of the matrices quantization stores: Wq (or Wq_a, Wq_b), Wkv_a, Wo."""
        q = self.num_heads * self.qk_head_dim
        queries = [(q, hidden)] if self.q_lora_rank is None else [(self.q_lora_rank, hidden), (q, self.q_lora_rank)]
        return [*queries, (self.kv_lora_rank + self.qk_rope_head_dim, hidden),
                (hidden, self.num_heads * self.v_head_dim)]

    def param_count(self, hidden: int) -> int:
        kv_b = self.kv_b_shape[0] * self.kv_b_shape[1]
        norms = self.kv_lora_rank + (self.q_lora_rank or 0)
        bias = (self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim + hidden if self.bias else 0
        return sum(r * c for r, c in self.matrices(hidden)) + kv_b + norms + bias


@dataclass(frozen=True)
class IndexedLatentCacheSpec(StateSize):
    """What a DSA layer that runs its indexer keeps per session and position (kind
    "latent_indexed"): MLA's latent row (`latent_dim` + `rope_dim`, as `LatentCacheSpec`) and the
    indexer's key (`index_dim`, rotated and normed), one of each for all heads. GLM-5: 512 + 64
    + 128 values a position. A layer that reuses another's selection keeps the latent only."""

    latent_dim: int
    rope_dim: int
    index_dim: int
    kind: str = "latent_indexed"

    def __post_init__(self) -> None:
        check_field(self.kind == "latent_indexed", "cache kind", self.kind)
        check_field(self.latent_dim > 0, "kv_lora_rank", self.latent_dim)
        check_field(self.rope_dim > 0, "qk_rope_head_dim", self.rope_dim)
        check_field(self.index_dim > 0, "index_head_dim", self.index_dim)

    @property
    def width(self) -> int:
        """The latent row's width (the index key lies in a store of its own)."""
        return self.latent_dim + self.rope_dim

    def bytes_per_position(self, itemsize: int) -> int:
        return (self.width + self.index_dim) * itemsize


@dataclass(frozen=True)
class DsaSpec:
    """One layer's DeepSeek sparse attention (kind "dsa": GLM-5's MLA with an indexer).

    mla:           the attention itself (`MlaSpec`: low-rank q required, interleaved RoPE), which
                   each query runs over only the `index_topk` positions its selection picked.
    index_heads (Hi), index_head_dim (Di), index_topk (k): the indexer ("lightning indexer"): from
                   the query latent (after Wq_a and its norm) q_i = Wq_i [T, Hi, Di]; from the
                   layer's input k_i = LayerNorm(x Wk) [T, Di] (weight and bias, eps 1e-6), one
                   key for all heads, cached; RoPE (interleaved pairs, MLA's tables) on the first
                   `qk_rope_head_dim` dims of both; a query's score of position j is
                   sum_h w_h relu(q_i[h] . k_i[j] / sqrt(Di)) with w = x Ww / sqrt(Hi) (float32);
                   it attends to the k best of the positions up to its own (all of them while
                   there are at most k). Ties go to the earlier position: the choice does not
                   depend on how a step is cut or stacked (layers/dsa.py).
    shared:        this layer runs no indexer and reuses the selection of the last layer before
                   it that did (`indexer_types` "shared", GLM-5.2's cross-layer sharing); its
                   cache is the latent only. A span never starts on such a layer:
                   `ModelSpec.span_starts`.
    """

    mla: MlaSpec
    index_heads: int
    index_head_dim: int
    index_topk: int
    shared: bool = False
    kind: str = "dsa"

    def __post_init__(self) -> None:
        check_field(self.kind == "dsa", "attention kind", self.kind)
        check_field(self.mla.q_lora_rank is not None, "q_lora_rank", self.mla.q_lora_rank)  # the indexer's queries
        check_field(self.index_heads > 0, "index_n_heads", self.index_heads)
        check_field(self.index_head_dim >= self.mla.qk_rope_head_dim, "index_head_dim", self.index_head_dim)
        check_field(self.index_topk > 0, "index_topk", self.index_topk)

    @property
    def rope(self) -> RopeSpec:
        return self.mla.rope

    @property
    def rope_dim(self) -> int:
        return self.mla.rope_dim

    @property
    def cache(self) -> LatentCacheSpec | IndexedLatentCacheSpec:
        if self.shared:
            return self.mla.cache
        return IndexedLatentCacheSpec(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim, self.index_head_dim)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """MLA's matrices (what quantization stores). The indexer's stay in float, as a router's do:
        they choose which keys are read."""
        return self.mla.matrices(hidden)

    def indexer_param_count(self, hidden: int) -> int:
        """Wq_i [Hi Di, q_lora_rank], Wk [Di, H], the key norm's weight and bias, Ww [Hi, H]; 0 when shared."""
        if self.shared:
            return 0
        assert self.mla.q_lora_rank is not None
        hi, di = self.index_heads, self.index_head_dim
        return hi * di * self.mla.q_lora_rank + di * hidden + 2 * di + hi * hidden

    def param_count(self, hidden: int) -> int:
        return self.mla.param_count(hidden) + self.indexer_param_count(hidden)
