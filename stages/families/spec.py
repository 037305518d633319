"""What a model is, as plain data: `ModelSpec` and the `LayerSpec` of each of its layers.

A family module (`llama.py`, `qwen3.py`, `mixtral.py`) reads a Hugging Face `config.json`
into these frozen dataclasses, and nothing else in stages/ reads a config: the layers
(`stages/layers/`) are built from a `LayerSpec`, the weights (`stages/weights/`) are
named and shaped from it, a session's KV cache is laid out from each layer's
`CacheSpec`, and a peer prices a span from `ModelSpec.layer_bytes`. No torch here: the
planner and the weight fetcher read specs without loading the engine.

A model is a list of layers, each pre-norm:

    x = x + attention(rms_norm(x))      LayerSpec.attention: AttentionSpec (its `kind`)
    x = x + mlp(rms_norm(x))            LayerSpec.mlp: MlpSpec (its `kind`)

and layers may differ (Qwen3-MoE's dense layers among sparse ones, Qwen3's sliding-window
layers among full ones): `ModelSpec.layers` holds one `LayerSpec` per layer, equal ones
shared. Every sub-spec names its kind from a closed set below; whoever reads a kind
(layers/block.py builds modules, layers/cache.py allocates caches) refuses one it does not
know, so a kind added here without its module fails loudly, never silently.

Extending (the kinds are the extension points):

- an attention kind (MLA: low-rank q/kv and a decoupled RoPE head; DSA: MLA plus an
  indexer): add it to ATTENTION_KINDS with a dataclass of its own sizes (an `MlaSpec`
  beside `AttentionSpec`, with `matrices`, `param_count` and `cache` as here), its module
  in layers/ (registered in layers/block.py), and its cache kind below;
- a cache kind ("latent": MLA's compressed kv + rope key per position; "indexer": DSA's
  index keys): add it to CACHE_KINDS, give `CacheSpec` its sizes and `bytes_per_position`,
  and its storage class in layers/cache.py. Peers budget sessions with `bytes(capacity)`,
  so a smaller cache is seen by admission and placement with no change in peer/;
- an MLP or router kind (shared experts; DeepSeek's sigmoid router with group-limited top-k
  and a correction bias, `routed_scaling_factor`): fields on `MlpSpec` / `RouterSpec`, the
  kind in MLP_KINDS / ROUTER_KINDS, its function in layers/routers.py;
- RoPE variants (YaRN, partial rotary): a `RopeSpec.kind` with its parameters, computed in
  layers/rope.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tessera.stages.errors import ModelFormatError

ATTENTION_KINDS = ("gqa",)  # grouped-query attention (multi-head and multi-query included)
MLP_KINDS = ("dense", "moe")  # SwiGLU; a sparse mixture of SwiGLU experts
ROUTER_KINDS = ("softmax_topk",)  # softmax over experts, top-k, optionally renormalised
CACHE_KINDS = ("full", "sliding")  # keys and values of every position; only the window is read
ROPE_KINDS = ("default", "linear", "llama3")


def _check(ok: bool, name: str, value: object) -> None:
    if not ok:
        raise ModelFormatError(f"config field {name} has an impossible value {value!r}")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding of one attention kind.

    kind:   "default" (plain RoPE), "linear" or "llama3" (scaled frequencies).
    theta:  the base frequency.
    params: the kind's parameters as sorted (name, value) pairs (hashable: the stage keeps
            one table of cos/sin per distinct RoPE): linear's `factor`; llama3's `factor`,
            `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`.
    """

    kind: str = "default"
    theta: float = 10000.0
    params: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        _check(self.kind in ROPE_KINDS, "rope_type", self.kind)
        _check(self.theta > 0, "rope_theta", self.theta)

    def param(self, name: str) -> float:
        return float(dict(self.params)[name])


@dataclass(frozen=True)
class CacheSpec:
    """What one layer keeps per session and position.

    kind:         "full" or "sliding" (CACHE_KINDS).
    num_kv_heads, head_dim: the keys' and values' shape per position.
    window:       for "sliding", the positions a query reads (its own and the W - 1 before).

    A sliding layer keeps every position too: a write at position p rolls the cache back to
    p (speculation, a step re-sent after a repair, the chunks of a prefill re-sent after one),
    and the requester may rewrite from any earlier position, so a ring of W positions (plus
    any slack) could not honour every rollback it is sent. What the window saves is reading:
    decode reads W positions, not the whole context.
    """

    kind: str
    num_kv_heads: int
    head_dim: int
    window: int | None = None

    def __post_init__(self) -> None:
        _check(self.kind in CACHE_KINDS, "cache kind", self.kind)
        _check((self.kind == "sliding") == (self.window is not None), "sliding_window", self.window)

    def bytes_per_position(self, itemsize: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * itemsize

    def bytes(self, capacity: int, itemsize: int) -> int:
        """Bytes a session of `capacity` positions costs in this layer (checked before allocating)."""
        return self.bytes_per_position(itemsize) * capacity


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention. kind "gqa": grouped-query attention.

    num_heads (A) query heads share num_kv_heads (K) key/value heads, A % K == 0; head_dim (D).
    rope:     the rotary embedding of q and k.
    window:   attend only to the last `window` positions (sliding), or None (all of them).
    qkv_bias: q, k and v projections carry a bias (Qwen2; Qwen3 with attention_bias).
    o_bias:   the output projection carries one (Qwen3 with attention_bias).
    qk_norm:  q and k get an RMSNorm over each head's D before RoPE (Qwen3).
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

    def __post_init__(self) -> None:
        _check(self.kind in ATTENTION_KINDS, "attention kind", self.kind)
        _check(self.num_heads > 0, "num_attention_heads", self.num_heads)
        _check(self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0, "num_key_value_heads",
               self.num_kv_heads)
        _check(self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim", self.head_dim)
        _check(self.window is None or self.window > 0, "sliding_window", self.window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def cache(self) -> CacheSpec:
        kind = "full" if self.window is None else "sliding"
        return CacheSpec(kind, self.num_kv_heads, self.head_dim, self.window)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of its weight matrices as the engine stacks them: wqkv, wo."""
        return [(self.q_size + 2 * self.kv_size, hidden), (hidden, self.q_size)]

    def param_count(self, hidden: int) -> int:
        bias = (self.q_size + 2 * self.kv_size if self.qkv_bias else 0) + (hidden if self.o_bias else 0)
        norms = 2 * self.head_dim if self.qk_norm else 0
        return sum(r * c for r, c in self.matrices(hidden)) + bias + norms


@dataclass(frozen=True)
class RouterSpec:
    """How a token picks its experts. kind "softmax_topk": softmax over the router's logits
    (float32), the `top_k` largest, divided by their sum when `renormalize` (Mixtral always;
    Qwen3-MoE when `norm_topk_prob`)."""

    kind: str = "softmax_topk"
    top_k: int = 2
    renormalize: bool = True

    def __post_init__(self) -> None:
        _check(self.kind in ROUTER_KINDS, "router kind", self.kind)
        _check(self.top_k > 0, "num_experts_per_tok", self.top_k)


@dataclass(frozen=True)
class MlpSpec:
    """One layer's MLP.

    kind "dense": SwiGLU of `width` (the intermediate size).
    kind "moe":   `num_experts` SwiGLU experts of `width` each (the expert intermediate
                  size), `router` choosing `router.top_k` of them per token, their outputs
                  summed with the router's weights.
    """

    width: int
    kind: str = "dense"
    num_experts: int = 0
    router: RouterSpec | None = None

    def __post_init__(self) -> None:
        _check(self.kind in MLP_KINDS, "MLP kind", self.kind)
        _check(self.width > 0, "intermediate_size", self.width)
        if self.kind == "moe":
            _check(self.num_experts > 0, "num_experts", self.num_experts)
            _check(self.router is not None and self.router.top_k <= self.num_experts, "num_experts_per_tok",
                   self.router and self.router.top_k)
        else:
            _check(self.num_experts == 0 and self.router is None, "num_experts", self.num_experts)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of its weight matrices as the engine stacks them: (gate+up, down) per expert."""
        one = [(2 * self.width, hidden), (hidden, self.width)]
        return one if self.kind == "dense" else one * self.num_experts

    def param_count(self, hidden: int) -> int:
        router = self.num_experts * hidden  # the router's [E, H] (kept in float: it picks the experts)
        return sum(r * c for r, c in self.matrices(hidden)) + router


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its attention and its MLP (each pre-normed, RMSNorm, residual)."""

    attention: AttentionSpec
    mlp: MlpSpec

    @property
    def cache(self) -> CacheSpec:
        return self.attention.cache

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """Every weight matrix of the layer (what quantization stores as integers)."""
        return self.attention.matrices(hidden) + self.mlp.matrices(hidden)

    def param_count(self, hidden: int) -> int:
        return self.attention.param_count(hidden) + self.mlp.param_count(hidden) + 2 * hidden  # + the two norms


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model's shape.

    family:         the config's `model_type` ("llama", "mistral", "qwen2", "qwen3",
                    "qwen3_moe", "mixtral"); stages/families/catalog.py reads each.
    vocab_size:     rows of the embedding matrix; hidden_size (H): width of the residual stream.
    layers:         one LayerSpec per decoder layer (L = len(layers)).
    rms_norm_eps:   epsilon of every RMSNorm.
    max_position:   the longest context the model was trained for.
    tie_embeddings: the head reuses the embedding matrix.
    bos_token_id, eos_token_ids: special ids from the config.
    """

    family: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float = 1e-5
    max_position: int = 4096
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _check(len(self.layers) > 0, "num_hidden_layers", len(self.layers))
        _check(self.hidden_size > 0, "hidden_size", self.hidden_size)
        _check(self.vocab_size > 0, "vocab_size", self.vocab_size)
        _check(self.max_position > 0, "max_position_embeddings", self.max_position)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same shape (the Llama block; not Qwen3-MoE's dense-first)."""
        return len(set(self.layers)) == 1

    def layer_param_count(self, layer: int | None = None) -> int:
        """Parameters in decoder layer `layer` (None: any layer of a uniform model)."""
        if layer is None:
            if not self.uniform:
                raise ValueError(f"the layers of this {self.family} model differ: name the layer")
            layer = 0
        return self.layers[layer].param_count(self.hidden_size)

    def layer_bytes(self, itemsize: int = 4, *, layer: int | None = None) -> int:
        """Bytes of layer `layer`'s weights in a float of `itemsize` bytes (None: any layer of a
        uniform model; ValueError where layers differ)."""
        return self.layer_param_count(layer) * itemsize

    def max_layer_bytes(self, itemsize: int = 4) -> int:
        """Bytes of the largest layer."""
        return max(self.layer_bytes(itemsize, layer=i) for i in range(self.num_layers))

    def kv_bytes_per_position(self, start: int, end: int, itemsize: int = 4) -> int:
        """KV bytes one position costs a session over layers [start, end), each per its cache kind."""
        return sum(self.layers[i].cache.bytes_per_position(itemsize) for i in range(start, end))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
