"""One decoder layer as plain data: `LayerSpec`, its token mixer (any of the attention kinds, or
None) and its MLP (or None), what it does around the two (Gemma's sandwich norms, per-layer
input and scalar; DeepSeek-V4's hyper-connections, `HyperSpec`), and what it keeps per session
(its mixer's state, or `StatelessSpec` where it has none). Built into a module in layers/block.py."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.stages.families.spec.attention import AttentionSpec, CacheSpec, SharedCacheSpec
from tessera.stages.families.spec.compressed import CompressedAttentionSpec, CompressedCacheSpec
from tessera.stages.families.spec.kinds import StateSize, check_field
from tessera.stages.families.spec.mla import DsaSpec, IndexedLatentCacheSpec, LatentCacheSpec, MlaSpec
from tessera.stages.families.spec.mlp import MlpSpec
from tessera.stages.families.spec.recurrent import GatedDeltaNetSpec, KdaSpec, Mamba2Spec, RecurrentStateSpec


@dataclass(frozen=True)
class StatelessSpec(StateSize):
    """What a layer without a token mixer keeps per session (kind "none"): nothing. A Nemotron-H layer
    is one mixer or one MLP (`LayerSpec.attention` None): its MLP-only layers hold no session state."""

    kind: str = "none"

    def __post_init__(self) -> None:
        check_field(self.kind == "none", "cache kind", self.kind)


@dataclass(frozen=True)
class HyperSpec:
    """Manifold-constrained hyper-connections (DeepSeek-V4's mHC, `hc_mult`): the residual is
    `streams` (n) rows of H per token, not one, carried from layer to layer (and so from stage to
    stage: `ModelSpec.hop_width`).

    Around each of a layer's attention and MLP, a connection reads the n streams (flattened, RMS-
    normed without a weight) through one projection [(2 + n) n, n H] into: `pre` [n] (sigmoid, + eps),
    which mixes the streams into the block's one input row; `post` [n] (2 sigmoid), which spreads the
    block's output over the streams; and `comb` [n, n] (softmax by row, + eps, then made doubly
    stochastic by `sinkhorn_iters` alternations of column and row normalisation), which mixes the
    streams into each other: streams' = post (x) block(pre . streams) + combᵀ streams. Each of the
    three has a learned scale and bias. The embedding enters as n copies; before the final norm a
    head connection (its own [n, n H] projection, bias and scale) mixes them back into one.
    """

    streams: int
    sinkhorn_iters: int = 20
    eps: float = 1e-6

    def __post_init__(self) -> None:
        check_field(self.streams > 0, "hc_mult", self.streams)
        check_field(self.sinkhorn_iters > 0, "hc_sinkhorn_iters", self.sinkhorn_iters)
        check_field(self.eps > 0, "hc_eps", self.eps)

    @property
    def mix_width(self) -> int:
        """Outputs of a connection's projection: pre and post (n each) and comb (n n)."""
        return (2 + self.streams) * self.streams

    def connection_params(self, hidden: int) -> int:
        """One connection: its projection [(2 + n) n, n H], bias [(2 + n) n] and scales [3]."""
        return self.mix_width * (self.streams * hidden + 1) + 3

    def head_params(self, hidden: int) -> int:
        """The head connection: projection [n, n H], bias [n], scale [1]."""
        return self.streams * (self.streams * hidden + 1) + 1


# A layer's session state, by kind: rows per position (KV, MLA's latent, DSA's), fixed (recurrent), none, DeepSeek-V4's
# window and entries, or none of its own (a KV-shared layer's)
StateSpec = CacheSpec | SharedCacheSpec | LatentCacheSpec | IndexedLatentCacheSpec | RecurrentStateSpec | StatelessSpec | CompressedCacheSpec
# A layer's token mixer, by kind (ATTENTION_KINDS)
MixerSpec = AttentionSpec | MlaSpec | DsaSpec | GatedDeltaNetSpec | KdaSpec | Mamba2Spec | CompressedAttentionSpec
NO_STATE = StatelessSpec()


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its attention (token mixer) and its MLP, each pre-normed (RMSNorm) and
    added to the residual. Either may be None, not both: a Nemotron-H layer is one mixer (Mamba2 or
    attention) or one MLP, each with its one norm. Under `hyper` (DeepSeek-V4) each goes through a
    hyper-connection over the residual's streams.

    sandwich:        each half's output is RMSNormed before it joins the residual stream (Gemma's
                     post-attention and post-feedforward norms).
    per_layer_input: the width P of the layer's per-layer input (Gemma 4's PLE), or 0: after the
                     MLP, x += RMSNorm(Wp (gelu(Wg x) * p)) with p the layer's slice of the per-layer
                     inputs the step carries (`ModelSpec.hop_width`; layers/per_layer.py).
    scalar:          the layer's output is multiplied by a learned scalar (Gemma 4's `layer_scalar`).
    """

    attention: MixerSpec | None
    mlp: MlpSpec | None
    hyper: HyperSpec | None = None
    sandwich: bool = False
    per_layer_input: int = 0
    scalar: bool = False

    def __post_init__(self) -> None:
        check_field(self.attention is not None or self.mlp is not None, "layer", "neither a mixer nor an MLP")
        check_field(self.per_layer_input >= 0, "hidden_size_per_layer_input", self.per_layer_input)

    @property
    def cache(self) -> StateSpec:
        """What the layer keeps per session (its session-state kind: CACHE_KINDS)."""
        return self.attention.cache if self.attention is not None else NO_STATE

    @property
    def attention_kind(self) -> str:
        """Its token mixer's kind (ATTENTION_KINDS), or "none"."""
        return self.attention.kind if self.attention is not None else "none"

    @property
    def mlp_kind(self) -> str:
        """Its MLP's kind (MLP_KINDS), or "none"."""
        return self.mlp.kind if self.mlp is not None else "none"

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """Every weight matrix of the layer (what quantization stores as integers)."""
        per_layer = [(self.per_layer_input, hidden), (hidden, self.per_layer_input)] if self.per_layer_input else []
        return [*(self.attention.matrices(hidden) if self.attention is not None else ()),
                *(self.mlp.matrices(hidden) if self.mlp is not None else ()), *per_layer]

    def param_count(self, hidden: int) -> int:
        # each half's own and its norm's (Gemma 4's MLP of two branches holds its own norms), Gemma's norm
        # after each half, its hyper-connection; the per-layer input's gate, projection and norm; the layer scalar
        halves = [part.param_count(hidden) + hidden for part in (self.attention, self.mlp) if part is not None]
        own_norms = hidden if self.mlp is not None and self.mlp.kind == "dense_and_moe" else 0
        sandwich = len(halves) * hidden if self.sandwich else 0
        connections = len(halves) * self.hyper.connection_params(hidden) if self.hyper is not None else 0
        per_layer = 2 * self.per_layer_input * hidden + hidden if self.per_layer_input else 0
        return sum(halves) - own_norms + sandwich + connections + per_layer + int(self.scalar)
