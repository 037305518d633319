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
layers among full ones; a Nemotron-H layer has only one of the two halves, `None` the other):
`ModelSpec.layers` holds one `LayerSpec` per layer, equal ones shared. Every sub-spec names
its kind from a closed set below; whoever reads a kind (layers/block.py builds modules,
layers/cache.py allocates caches) refuses one it does not know, so a kind added here without
its module fails loudly, never silently.

Extending (the kinds are the extension points):

- an attention kind: add it to ATTENTION_KINDS with a dataclass of its own sizes (as
  `MlaSpec` sits beside `AttentionSpec`, with `rope`, `rope_dim`, `matrices`, `param_count`
  and `cache`), its module in layers/ (registered in layers/block.py), and its cache kind.
  DeepSeek sparse attention (kind "dsa", GLM-5) is MLA plus an indexer that picks each
  query's top-k keys: `DsaSpec` holds an `MlaSpec` and the indexer's sizes, its module
  (layers/dsa.py) is built on layers/mla.py's over the picked rows;
- a session-state kind (what a layer keeps per session: its `cache`): add it to CACHE_KINDS with
  a spec of its sizes and `fixed_bytes` / `bytes_per_position` / `bytes` (as `LatentCacheSpec`:
  MLA's compressed kv + rope key per position), and its store in layers/cache.py (or, for a
  state that is not a row per position, layers/state.py). Peers budget sessions with
  `bytes(capacity)` = fixed + per position x capacity, so a smaller state is seen by admission
  and placement with no change in peer/. DSA's ("latent_indexed", `IndexedLatentCacheSpec`)
  holds the latent rows and the indexer's keys; a linear-attention or state-space layer's
  ("recurrent", `RecurrentStateSpec`) a fixed matrix per head and a convolution window, whatever
  the context; a layer without a token mixer's ("none", `StatelessSpec`) nothing;
  DeepSeek-V4's ("compressed", `CompressedCacheSpec`) a window of rows and, every `ratio`
  positions, one compressed entry (and the indexer's), going back only as far as its rings reach;
- an MLP or router kind: fields on `MlpSpec` / `RouterSpec` (as `shared_width` and the
  sigmoid router's groups and scale), the kind in MLP_KINDS / ROUTER_KINDS, its module in
  layers/routers.py;
- what crosses a stage boundary: `ModelSpec.hop_width(layer)`, the values a step carries per
  token into layer `layer` (the residual stream, `hyper.streams` of them under DeepSeek-V4's
  hyper-connections; the token id where a layer routes by it; Gemma 4's per-layer inputs of the
  layers still to run); stages/layers/hop.py packs it;
- RoPE variants: a `RopeSpec.kind` with its parameters, computed in layers/rope.py (YaRN;
  Gemma 4's "proportional", which turns the first pairs of each half of a head); partial
  rotary over the first dims of a head is `AttentionSpec.rotary_dim`;
- what a layer does around its two halves (Gemma's norms after each half, its per-layer input,
  its layer scalar): fields of `LayerSpec`, built in layers/block.py.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from tessera.stages.errors import ModelFormatError, SpanError
from tessera.stages.families.shipped import ShippedFormat

# grouped-query attention (multi-head and multi-query included); multi-head latent; MLA with DeepSeek's sparse
# attention; Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5: a recurrent state, no rows per position);
# Kimi Delta Attention (Kimi Linear: the same with a decay per channel); Mamba2's state-space mixer (Nemotron-H);
# DeepSeek-V4's one-head attention over a window and compressed entries (CompressedAttentionSpec)
ATTENTION_KINDS = ("gqa", "mla", "dsa", "gated_deltanet", "kda", "mamba2", "compressed")
# SwiGLU (or GluSpec's other activations); a sparse mixture of such experts; a dense MLP and a sparse mixture
# side by side, each normed (Gemma 4)
MLP_KINDS = ("dense", "moe", "dense_and_moe")
ROUTER_KINDS = (
    "softmax_topk",  # softmax over experts, top-k, optionally renormalised
    "topk_softmax",  # top-k of the logits, softmax over those k (gpt-oss)
    "sigmoid_group_topk",  # DeepSeek's sigmoid, group-limited top-k
    "sqrtsoftplus_topk",  # DeepSeek-V4's sqrt(softplus), top-k with a correction bias
    "normed_softmax_topk",  # Gemma 4's: its input normed and scaled, softmax, top-k renormalised, a scale per expert
)
# silu(gate) * up; gpt-oss's clamped form; relu(up)^2 with no gate (Nemotron-H); DeepSeek-V4's silu with
# gate and up clamped; gelu(gate) * up (Gemma's GeGLU): GluSpec
GLU_KINDS = ("silu", "clamped_swiglu", "relu2", "clamped_silu", "gelu_tanh")
# keys and values of every position (only the window is read); MLA's latent; the latent and DSA's index keys;
# a fixed recurrent state and convolution window (linear attention: RecurrentStateSpec); nothing (a layer
# with no token mixer, only an MLP: StatelessSpec); DeepSeek-V4's window and compressed entries
# (CompressedCacheSpec); nothing of its own, the layer reading another layer's keys and values (Gemma 4's
# KV-shared layers: SharedCacheSpec)
CACHE_KINDS = ("full", "sliding", "latent", "latent_indexed", "recurrent", "none", "compressed", "shared")
# How far back a recurrent state can be taken (layers/state.py, docs/pages/models.md's measurement):
# the state at the start of each of the last RECURRENT_CHECKPOINTS runs of steps is kept (two:
# the requester keeps at most two speculative blocks of a session in flight, peer/request/decode.py
# MAX_IN_FLIGHT, and a rejected draft or a re-sent step goes back into one of them), and the
# inputs of a run (a step, and the one-token steps after it) of at most REPLAY_TOKENS tokens in all
# (a draft block is at most K_MAX + 1 = 9; a local draft model feeds its drafts one token a step),
# from which any position inside it is recomputed.
RECURRENT_CHECKPOINTS = 2
REPLAY_TOKENS = 16
# state kinds that go back only to their checkpoints or as far as their rings reach (or to 0)
CHECKPOINTED_KINDS = ("recurrent", "compressed")
# How far back from its end a compressed layer's session state goes by moving a pointer
# (CompressedCacheSpec): it keeps the rows of its last positions in rings, not every position, and
# this many past what its window and its open compression windows need — what a recurrent state
# reaches inside its runs of steps (the same two speculative blocks in flight, the same local draft
# model's one-token drafts); the start of a longer step is kept apart (its snapshot), as a recurrent
# state keeps its checkpoint. A rollback further back is refused (StateRewindError): the requester
# replays from position 0.
COMPRESSED_REACH = RECURRENT_CHECKPOINTS * REPLAY_TOKENS
COMPRESSED_SNAPSHOTS = RECURRENT_CHECKPOINTS  # the starts of the last steps longer than the reach
# Digits (base 256) a token id takes on the hop tensor where a layer routes by it (`ModelSpec.hop_width`):
# each is exact in float32, float16 and bfloat16 (integers to 256 have at most 8 significant bits), so
# the id survives a peer computing in any of them; 3 digits hold ids up to 2^24.
HOP_ID_DIGIT_BASE = 256
# "proportional": Gemma 4's, turning only the first pairs of each half of a head (RopeSpec).
# "none": no position encoding at all (NoPE: Kimi Linear's MLA, Nemotron-H's attention), turned by identity
# tables (cos 1, sin 0: layers/rope.py), so that every attention path runs unchanged and exactly
ROPE_KINDS = ("default", "linear", "llama3", "yarn", "none", "proportional")


def _check(ok: bool, name: str, value: object) -> None:
    if not ok:
        raise ModelFormatError(f"config field {name} has an impossible value {value!r}")


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
        _check(self.kind in ROPE_KINDS, "rope_type", self.kind)
        _check(self.theta > 0, "rope_theta", self.theta)

    def param(self, name: str) -> float:
        return float(dict(self.params)[name])

    def optional(self, name: str) -> Any:
        """A parameter the config may leave out (None when it did)."""
        return dict(self.params).get(name)


@dataclass(frozen=True)
class CacheSpec:
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
        _check(self.kind in ("full", "sliding"), "cache kind", self.kind)
        _check((self.kind == "sliding") == (self.window is not None), "sliding_window", self.window)

    def fixed_bytes(self, itemsize: int) -> int:
        return 0
    @property
    def value_width(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    def bytes_per_position(self, itemsize: int) -> int:
        return self.num_kv_heads * (self.head_dim + self.value_width) * itemsize

    def bytes(self, capacity: int, itemsize: int) -> int:
        """Bytes a session of `capacity` positions costs in this layer (checked before allocating)."""
        return self.bytes_per_position(itemsize) * capacity


@dataclass(frozen=True)
class RecurrentStateSpec:
    """What a linear-attention or state-space layer keeps per session (kind "recurrent"): a fixed
    state, not a row per position, so its bytes do not grow with the context.

    num_heads (Hv), key_dim (dk), value_dim (dv): the recurrent matrix, [Hv, dk, dv], kept in
        float32 whatever the model's dtype (the reference computes the recurrence in float32).
        A Mamba2 layer's SSM state is [heads, head_dim, ssm_state_size] in these three.
    conv_channels (C), conv_kernel (Kc): the short causal convolution before the recurrence reads
        the last Kc - 1 inputs of each channel: a window [Kc - 1, C] in the model's dtype.
    replay_width: values a step keeps per token to recompute the state from a checkpoint (the
        convolution's inputs and the gates' logits: Gated DeltaNet's C + 2 Hv, KDA's C + Hv dk + Hv,
        Mamba2's C + heads).

    Rollback (layers/state.py): the state cannot be cut back to a position, so the store keeps
    the state at the start of each of its last RECURRENT_CHECKPOINTS steps, and the inputs of a
    step of at most REPLAY_TOKENS tokens; going back to position p inside such a step restores
    its checkpoint and recomputes the recurrence over the inputs before p (no projection runs
    again). Its bytes: (1 + checkpoints) x (matrix + window) + the kept inputs.
    """

    num_heads: int
    key_dim: int
    value_dim: int
    conv_channels: int
    conv_kernel: int
    replay_width: int
    kind: str = "recurrent"

    def __post_init__(self) -> None:
        _check(self.kind == "recurrent", "cache kind", self.kind)
        for name, value in (("linear_num_value_heads", self.num_heads), ("linear_key_head_dim", self.key_dim),
                            ("linear_value_head_dim", self.value_dim), ("conv channels", self.conv_channels),
                            ("replay width", self.replay_width)):
            _check(value > 0, name, value)
        _check(self.conv_kernel >= 1, "linear_conv_kernel_dim", self.conv_kernel)

    def state_bytes(self, itemsize: int) -> int:
        """One copy of the state: the float32 matrix and the convolution window."""
        return 4 * self.num_heads * self.key_dim * self.value_dim + (self.conv_kernel - 1) * self.conv_channels * itemsize

    def fixed_bytes(self, itemsize: int) -> int:
        """The most a session's store holds: the state, a checkpoint per kept step, their inputs."""
        kept_inputs = RECURRENT_CHECKPOINTS * REPLAY_TOKENS * self.replay_width * itemsize
        return (1 + RECURRENT_CHECKPOINTS) * self.state_bytes(itemsize) + kept_inputs

    def bytes_per_position(self, itemsize: int) -> int:
        return 0

    def bytes(self, capacity: int, itemsize: int) -> int:
        """Bytes a session costs in this layer, whatever its `capacity` (checked before allocating)."""
        return self.fixed_bytes(itemsize)


@dataclass(frozen=True)
class StatelessSpec:
    """What a layer without a token mixer keeps per session (kind "none"): nothing. A Nemotron-H layer
    is one mixer or one MLP (`LayerSpec.attention` None): its MLP-only layers hold no session state."""

    kind: str = "none"

    def __post_init__(self) -> None:
        _check(self.kind == "none", "cache kind", self.kind)

    def fixed_bytes(self, itemsize: int) -> int:
        return 0

    def bytes_per_position(self, itemsize: int) -> int:
        return 0

    def bytes(self, capacity: int, itemsize: int) -> int:
        return 0


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """One layer's Gated DeltaNet linear attention (kind "gated_deltanet": Qwen3-Next, Qwen3.5).

    In-projection x W_in (one matrix, engine name `attn.w_in`) gives, per token: q and k
    (Hk heads of dk), v and the output gate z (Hv heads of dv), and per value head b and a.
    `layout` says how its rows are ordered: "split" (Qwen3.5: q, k, v, z, b, a, each whole) or
    "grouped" (Qwen3-Next: per key head its q, k, its Hv/Hk heads' v and z; then per key head
    its Hv/Hk heads' b and a). Then:

        q, k, v = silu(causal_conv1d(q, k, v))   per channel, kernel Kc, over the session's inputs
        q, k = l2norm(q), l2norm(k) (eps 1e-6); q /= sqrt(dk); each q/k head serves Hv/Hk v heads
        beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)            (per value head)
        S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_tᵀ exp(g_t) S_{t-1}))ᵀ     (the gated delta rule)
        o_t = q_tᵀ S_t                                                          [Hv, dv]
        out = W_out (rms_norm(o) * norm_weight * silu(z))                       (norm over dv, eps)

    A step of many tokens runs the rule chunk-wise (64 tokens, as the reference), one token
    the recurrent form. The session's state (`cache`) is S and the last Kc - 1 convolution inputs.
    """

    num_key_heads: int
    num_value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    layout: str = "split"
    kind: str = "gated_deltanet"

    def __post_init__(self) -> None:
        _check(self.kind == "gated_deltanet", "attention kind", self.kind)
        _check(self.num_key_heads > 0, "linear_num_key_heads", self.num_key_heads)
        _check(self.num_value_heads > 0 and self.num_value_heads % self.num_key_heads == 0,
               "linear_num_value_heads", self.num_value_heads)
        _check(self.key_dim > 0, "linear_key_head_dim", self.key_dim)
        _check(self.value_dim > 0, "linear_value_head_dim", self.value_dim)
        _check(self.conv_kernel >= 1, "linear_conv_kernel_dim", self.conv_kernel)
        _check(self.layout in ("split", "grouped"), "linear attention layout", self.layout)

    rope = None  # no rotary embedding: positions reach it only through the recurrence
    rope_dim = 0

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_dim

    @property
    def conv_channels(self) -> int:
        """q, k and v: what the convolution runs over."""
        return 2 * self.key_size + self.value_size

    @property
    def in_size(self) -> int:
        """Rows of W_in: q, k, v, z, b, a."""
        return self.conv_channels + self.value_size + 2 * self.num_value_heads

    @property
    def cache(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(self.num_value_heads, self.key_dim, self.value_dim, self.conv_channels,
                                  self.conv_kernel, self.conv_channels + 2 * self.num_value_heads)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of its weight matrices: W_in, W_out."""
        return [(self.in_size, hidden), (hidden, self.value_size)]

    def param_count(self, hidden: int) -> int:
        # the depthwise convolution [C, Kc], A_log and dt_bias [Hv], the gated norm's weight [dv]
        extra = self.conv_channels * self.conv_kernel + 2 * self.num_value_heads + self.value_dim
        return sum(r * c for r, c in self.matrices(hidden)) + extra


@dataclass(frozen=True)
class KdaSpec:
    """One layer's Kimi Delta Attention (kind "kda": Kimi Linear), Gated DeltaNet with a decay per
    key channel rather than per head. H heads of d dims each for q, k and v (no grouping), a short
    causal convolution of kernel Kc over each of q, k and v.

    In-projection x W_in (engine name `attn.w_in`, stacked from the checkpoint's q, k, v and b
    projections and the two low-rank down-projections of the forget gate and the output gate):
    q, k, v [H d each], b [H], f_a [d], g_a [d]; then f = W_fb f_a [H d], gate = W_gb g_a [H d].

        q, k, v = act(causal_conv1d(q, k, v))   per channel (`hidden_act`, SiLU), no bias
        q, k = l2norm(q), l2norm(k) (x / sqrt(sum x^2 + 1e-6)); q /= sqrt(d)
        beta = sigmoid(b);  g = -exp(A_log) * softplus(f + dt_bias)        (g per head and channel)
        S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t - k_tᵀ diag(exp(g_t)) S_{t-1}))ᵀ
        o_t = q_tᵀ S_t                                                    [H, d]
        out = W_out (rms_norm(o) * norm_weight * sigmoid(gate))           (norm over d, the model's eps)

    A step of many tokens runs the rule chunk-wise (64 tokens, as the reference), one token the
    recurrent form. The session's state (`cache`) is S [H, d, d] and the last Kc - 1 inputs of the
    3 H d convolution channels.
    """

    num_heads: int
    head_dim: int
    conv_kernel: int
    kind: str = "kda"

    def __post_init__(self) -> None:
        _check(self.kind == "kda", "attention kind", self.kind)
        _check(self.num_heads > 0, "linear_num_heads", self.num_heads)
        _check(self.head_dim > 0, "linear_head_dim", self.head_dim)
        _check(self.conv_kernel >= 1, "linear_conv_kernel_dim", self.conv_kernel)

    rope = None  # no rotary embedding: positions reach it only through the recurrence
    rope_dim = 0

    @property
    def size(self) -> int:
        """H d: each of q, k, v, the forget gate and the output gate."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return 3 * self.size

    @property
    def in_size(self) -> int:
        """Rows of W_in: q, k, v, b, f_a, g_a."""
        return self.conv_channels + self.num_heads + 2 * self.head_dim

    @property
    def replay_width(self) -> int:
        """What a step keeps per token to fold it in again: the convolution's inputs, f and b."""
        return self.conv_channels + self.size + self.num_heads

    @property
    def cache(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(self.num_heads, self.head_dim, self.head_dim, self.conv_channels, self.conv_kernel,
                                  self.replay_width)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of its weight matrices: W_in, W_fb, W_gb, W_out."""
        return [(self.in_size, hidden), (self.size, self.head_dim), (self.size, self.head_dim), (hidden, self.size)]

    def param_count(self, hidden: int) -> int:
        # the depthwise convolution [3 H d, Kc], A_log [H], dt_bias [H d], the output norm's weight [d]
        extra = self.conv_channels * self.conv_kernel + self.num_heads + self.size + self.head_dim
        return sum(r * c for r, c in self.matrices(hidden)) + extra


@dataclass(frozen=True)
class Mamba2Spec:
    """One layer's Mamba2 state-space mixer (kind "mamba2": Nemotron-H). H heads of P dims (the
    inner width I = H P), a state of N per head, B and C shared by the heads of each of G groups.

    In-projection x W_in (engine name `attn.w_in`, with a bias when `proj_bias`): z [I], then the
    convolution's channels xBC [I + 2 G N], then dt [H]. Then:

        x, B, C = silu(causal_conv1d(xBC) (+ conv bias))    x [H, P], B and C [G, N]
        dt = softplus(dt + dt_bias), clamped below at `dt_min`;  A = -exp(A_log)        (per head)
        S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_tᵀ                     S [H, P, N], B of the head's group
        y_t = S_t C_t + D x_t                                         [H, P]
        out = W_out (group_rms_norm(y * silu(z)) * norm_weight)       (RMS over each of G groups of I / G)

    A step of many tokens runs the scan chunk-wise (`chunk` tokens: the config's chunk_size), one
    token the recurrent form. The session's state (`cache`) is S and the last Kc - 1 convolution inputs.
    """

    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel: int
    chunk: int = 128
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0
    kind: str = "mamba2"

    def __post_init__(self) -> None:
        _check(self.kind == "mamba2", "attention kind", self.kind)
        _check(self.num_heads > 0, "mamba_num_heads", self.num_heads)
        _check(self.head_dim > 0, "mamba_head_dim", self.head_dim)
        _check(self.state_size > 0, "ssm_state_size", self.state_size)
        _check(self.num_groups > 0 and self.num_heads % self.num_groups == 0, "n_groups", self.num_groups)
        _check(self.conv_kernel >= 1, "conv_kernel", self.conv_kernel)
        _check(self.chunk > 0, "chunk_size", self.chunk)
        _check(self.dt_min >= 0 and math.isfinite(self.dt_min), "time_step_limit", self.dt_min)

    rope = None  # no rotary embedding: positions reach it only through the recurrence
    rope_dim = 0

    @property
    def inner(self) -> int:
        """I = H P: the width of x, z and y."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """x, B and C: what the convolution runs over."""
        return self.inner + 2 * self.num_groups * self.state_size

    @property
    def in_size(self) -> int:
        """Rows of W_in: z, xBC, dt."""
        return self.inner + self.conv_channels + self.num_heads

    @property
    def cache(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(self.num_heads, self.head_dim, self.state_size, self.conv_channels, self.conv_kernel,
                                  self.conv_channels + self.num_heads)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of its weight matrices: W_in, W_out."""
        return [(self.in_size, hidden), (hidden, self.inner)]

    def param_count(self, hidden: int) -> int:
        # the depthwise convolution [C, Kc] (+ bias), dt_bias, A_log and D [H], the gated norm's weight [I]
        conv = self.conv_channels * (self.conv_kernel + (1 if self.conv_bias else 0))
        bias = self.in_size + hidden if self.proj_bias else 0
        return sum(r * c for r, c in self.matrices(hidden)) + conv + 3 * self.num_heads + self.inner + bias


@dataclass(frozen=True)
class SharedCacheSpec:
    """What a layer that reads another layer's keys and values keeps per session (kind "shared"):
    nothing. Gemma 4's KV-shared layers (`AttentionSpec.kv_source`) attend over the store of layer
    `source` (absolute index), which runs before them in the same span (`ModelSpec.span_starts`
    keeps them together), so the session's cache holds that store once (layers/cache.py)."""

    source: int
    kind: str = "shared"

    def __post_init__(self) -> None:
        _check(self.kind == "shared", "cache kind", self.kind)
        _check(self.source >= 0, "num_kv_shared_layers", self.source)

    def fixed_bytes(self, itemsize: int) -> int:
        return 0

    def bytes_per_position(self, itemsize: int) -> int:
        return 0

    def bytes(self, capacity: int, itemsize: int) -> int:
        return 0


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
        _check(self.kind in ATTENTION_KINDS, "attention kind", self.kind)
        _check(self.value_dim is None or self.value_dim > 0, "v_head_dim", self.value_dim)
        _check(self.value_scale > 0, "attention_value_scale", self.value_scale)
        _check(self.scale is None or self.scale > 0, "attention scale", self.scale)
        _check(not self.k_eq_v or self.value_dim is None, "attention_k_eq_v", self.k_eq_v)
        _check(self.kv_source is None or (self.kv_source >= 0 and not self.k_eq_v), "num_kv_shared_layers",
               self.kv_source)
        _check(self.num_heads > 0, "num_attention_heads", self.num_heads)
        _check(self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads == 0, "num_key_value_heads",
               self.num_kv_heads)
        _check(self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim", self.head_dim)
        _check(self.window is None or self.window > 0, "sliding_window", self.window)
        _check(self.rotary_dim is None or (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0),
               "partial_rotary_factor", self.rotary_dim)
        _check(self.qk_norm or not self.qk_norm_whole, "use_qk_norm", self.qk_norm)

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


@dataclass(frozen=True)
class LatentCacheSpec:
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
        _check(self.kind == "latent", "cache kind", self.kind)
        _check(self.latent_dim > 0, "kv_lora_rank", self.latent_dim)
        _check(self.rope_dim > 0, "qk_rope_head_dim", self.rope_dim)

    @property
    def width(self) -> int:
        return self.latent_dim + self.rope_dim

    def fixed_bytes(self, itemsize: int) -> int:
        return 0

    def bytes_per_position(self, itemsize: int) -> int:
        return self.width * itemsize

    def bytes(self, capacity: int, itemsize: int) -> int:
        """Bytes a session of `capacity` positions costs in this layer (checked before allocating)."""
        return self.bytes_per_position(itemsize) * capacity


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
        _check(self.kind == "mla", "attention kind", self.kind)
        for name, value in (("num_attention_heads", self.num_heads), ("kv_lora_rank", self.kv_lora_rank),
                            ("qk_nope_head_dim", self.qk_nope_head_dim), ("v_head_dim", self.v_head_dim)):
            _check(value > 0, name, value)
        _check(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
               self.qk_rope_head_dim)
        _check(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", self.q_lora_rank)

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
class IndexedLatentCacheSpec:
    """What a DSA layer that runs its indexer keeps per session and position (kind
    "latent_indexed"): MLA's latent row (`latent_dim` + `rope_dim`, as `LatentCacheSpec`) and the
    indexer's key (`index_dim`, rotated and normed), one of each for all heads. GLM-5: 512 + 64
    + 128 values a position. A layer that reuses another's selection keeps the latent only."""

    latent_dim: int
    rope_dim: int
    index_dim: int
    kind: str = "latent_indexed"

    def __post_init__(self) -> None:
        _check(self.kind == "latent_indexed", "cache kind", self.kind)
        _check(self.latent_dim > 0, "kv_lora_rank", self.latent_dim)
        _check(self.rope_dim > 0, "qk_rope_head_dim", self.rope_dim)
        _check(self.index_dim > 0, "index_head_dim", self.index_dim)

    @property
    def width(self) -> int:
        """The latent row's width (the index key lies in a store of its own)."""
        return self.latent_dim + self.rope_dim

    def fixed_bytes(self, itemsize: int) -> int:
        return 0

    def bytes_per_position(self, itemsize: int) -> int:
        return (self.width + self.index_dim) * itemsize

    def bytes(self, capacity: int, itemsize: int) -> int:
        """Bytes a session of `capacity` positions costs in this layer (checked before allocating)."""
        return self.bytes_per_position(itemsize) * capacity


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
        _check(self.kind == "dsa", "attention kind", self.kind)
        _check(self.mla.q_lora_rank is not None, "q_lora_rank", self.mla.q_lora_rank)  # the indexer's queries
        _check(self.index_heads > 0, "index_n_heads", self.index_heads)
        _check(self.index_head_dim >= self.mla.qk_rope_head_dim, "index_head_dim", self.index_head_dim)
        _check(self.index_topk > 0, "index_topk", self.index_topk)

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


@dataclass(frozen=True)
class CompressedCacheSpec:
    """What a DeepSeek-V4 layer keeps per session (kind "compressed"): its window of key-value rows
    and, every `ratio` positions, one compressed entry (and, with an indexer, one index entry).

    head_dim (D): a window row and a compressed entry (one key-value head: keys are values).
    window (W):   the positions a query reads as rows (its own and the W - 1 before).
    ratio (m):    positions per compressed entry; 0 for a layer with the window only.
    overlap:      an entry mixes two windows of positions (CSA: window w's second half of each
                  row with window w - 1's first half), so each position keeps 2 D of projections
                  (and of gate logits) until it is compressed; else D (HCA).
    index_dim (Di): the indexer's entries (its own compression of the same windows, with overlap);
                  0 without an indexer.

    What grows with the context is the entries: (D + Di) values every m positions
    (`bytes_per_position`, rounded up). What does not is the window and the projections of the
    positions whose compression window is still open — kept in rings of their last positions
    plus COMPRESSED_REACH (layers/cache.py `CompressedRows`), so that a rollback that far back
    is a pointer move — and a snapshot of them at the starts of the last COMPRESSED_SNAPSHOTS
    long steps (`fixed_bytes`). V4-Flash (D 512, W 128, CSA m 4 with Di 128; HCA m 128): a CSA
    layer 160 values a position, an HCA layer 4, against MLA's 576.
    """

    head_dim: int
    window: int
    ratio: int = 0
    overlap: bool = False
    index_dim: int = 0
    kind: str = "compressed"

    def __post_init__(self) -> None:
        _check(self.kind == "compressed", "cache kind", self.kind)
        _check(self.head_dim > 0, "head_dim", self.head_dim)
        _check(self.window > 0, "sliding_window", self.window)
        _check(self.ratio >= 0, "compress_rates", self.ratio)
        _check(self.ratio > 0 or not (self.overlap or self.index_dim), "compress_rates", self.ratio)
        _check(self.index_dim >= 0, "index_head_dim", self.index_dim)

    @property
    def raw_width(self) -> int:
        """Values a position keeps until its compression window closes: the compressor's projection and
        gate logits (2 D each with overlap, else D), and the indexer's (2 Di each)."""
        if not self.ratio:
            return 0
        return 2 * (2 if self.overlap else 1) * self.head_dim + 4 * self.index_dim

    @property
    def raw_span(self) -> int:
        """The most positions before the next one whose projections its compression may still read:
        the open window's (m - 1), and with overlap the whole window before it (m)."""
        return 0 if not self.ratio else self.ratio - 1 + (self.ratio if self.overlap else 0)

    @property
    def entry_width(self) -> int:
        return self.head_dim + self.index_dim

    def ring_rows(self) -> tuple[int, int]:
        """Rows of the window's ring and of the projections' ring (layers/cache.py `CompressedRows`)."""
        return self.window - 1 + COMPRESSED_REACH, (self.raw_span + COMPRESSED_REACH if self.ratio else 0)

    def entries(self, positions: int) -> int:
        """Compressed entries a session of `positions` positions holds room for."""
        return -(-positions // self.ratio) if self.ratio else 0

    def fixed_bytes(self, itemsize: int) -> int:
        """What a session holds whatever its length: the rings, the snapshots of the window and open
        projections, and one entry of rounding (`bytes_per_position` rounds the rest up)."""
        window, raw = self.ring_rows()
        rings = window * self.head_dim + raw * self.raw_width
        snapshots = COMPRESSED_SNAPSHOTS * ((self.window - 1) * self.head_dim + self.raw_span * self.raw_width)
        return (rings + snapshots + (self.entry_width if self.ratio else 0)) * itemsize

    def bytes_per_position(self, itemsize: int) -> int:
        """An entry's bytes over the `ratio` positions it stands for, rounded up (0: window only)."""
        return -(-self.entry_width * itemsize // self.ratio) if self.ratio else 0

    def bytes(self, capacity: int, itemsize: int) -> int:
        """Bytes a session of `capacity` positions costs in this layer (checked before allocating)."""
        return self.fixed_bytes(itemsize) + self.bytes_per_position(itemsize) * capacity


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """One layer's DeepSeek-V4 attention (kind "compressed"): one key-value head whose rows are keys
    and values at once, read over a sliding window and over compressed entries.

    num_heads (A) query heads of head_dim (D), from a low-rank query (`q_lora_rank`, normed, then
    each head's D normed without a weight); one key-value row of D per position (normed);
    RoPE in interleaved pairs on the LAST `rope_dim` (Dr) dims of each, by `rope` (DeepSeek-V4's
    "main" RoPE for a window-only layer, its "compress" RoPE for the others); the attention's
    output turned back by the same angle at its query's position (keys are values, so each
    read value carries its own position: the reverse turn leaves its distance to the query).
    Each head has a sink logit (as gpt-oss). The output projection is grouped: the A heads in
    `o_groups` groups, each group's A D / g values to `o_lora_rank`, then all g of those to H.

    window (W):  a query reads the rows of its position and the W - 1 before.
    ratio (m):   every m positions are compressed into one entry a query reads once its m
                 positions are all at or before it (0: no compression, the window only: a
                 "sliding_attention" layer). An entry: the softmax over the window's positions of
                 gate logits (plus a learned bias per position in the window) weighting their
                 projections, summed, normed, and turned by RoPE at the window's first position.
    index_heads (Hi), index_head_dim (Di), index_topk (k): the indexer of a "compressed sparse
                 attention" layer (0 heads: none, a "heavily compressed" layer, which reads every
                 entry). Its entries are its own compression of the same windows at Di; a query
                 q_i = Wq_i(query latent) [Hi, Di], rotated at its position, scores entry j as
                 sum_h w_h relu(q_i[h] . e_j) / sqrt(Di), w = x Ww / sqrt(Hi), and reads only its k
                 best entries (all while there are at most k). With an indexer an entry overlaps
                 two windows (`CompressedCacheSpec.overlap`).
    norm_eps:    epsilon of every RMSNorm of the layer (the model's rms_norm_eps).
    """

    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rope: RopeSpec = RopeSpec()
    ratio: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    norm_eps: float = 1e-6
    kind: str = "compressed"

    def __post_init__(self) -> None:
        _check(self.kind == "compressed", "attention kind", self.kind)
        for name, value in (("num_attention_heads", self.num_heads), ("head_dim", self.head_dim),
                            ("q_lora_rank", self.q_lora_rank), ("o_lora_rank", self.o_lora_rank),
                            ("sliding_window", self.window)):
            _check(value > 0, name, value)
        _check(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, "partial_rotary_factor", self.rope_dim)
        _check(self.o_groups > 0 and self.num_heads % self.o_groups == 0, "o_groups", self.o_groups)
        _check(self.ratio >= 0, "compress_rates", self.ratio)
        if self.index_heads:
            _check(self.ratio > 0, "compress_rates", self.ratio)
            _check(self.index_head_dim >= self.rope_dim, "index_head_dim", self.index_head_dim)
            _check(self.index_topk > 0, "index_topk", self.index_topk)

    @property
    def indexed(self) -> bool:
        return self.index_heads > 0

    @property
    def cache(self) -> CompressedCacheSpec:
        return CompressedCacheSpec(self.head_dim, self.window, self.ratio, self.indexed,
                                   self.index_head_dim if self.indexed else 0)

    @property
    def group_width(self) -> int:
        """Each output group's input: A D / g."""
        return self.num_heads * self.head_dim // self.o_groups

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of the matrices quantization stores: Wq_a, Wq_b, Wkv, Wo_b. The grouped Wo_a
        (a matrix per group, read as one block-diagonal product), the compressor's and the indexer's
        projections stay in float, as DeepSeek ships them."""
        return [(self.q_lora_rank, hidden), (self.num_heads * self.head_dim, self.q_lora_rank),
                (self.head_dim, hidden), (hidden, self.o_groups * self.o_lora_rank)]

    def param_count(self, hidden: int) -> int:
        d, m = self.head_dim, self.ratio
        own = self.q_lora_rank + d + self.num_heads + self.o_groups * self.o_lora_rank * self.group_width
        compressor = 0
        if m:  # kv and gate projections, the bias per window position, the norm
            width = (2 if self.indexed else 1) * d
            compressor = 2 * width * hidden + m * width + d
        indexer = 0
        if self.indexed:
            hi, di = self.index_heads, self.index_head_dim
            indexer = 2 * 2 * di * hidden + m * 2 * di + di + hi * di * self.q_lora_rank + hi * hidden
        return sum(r * c for r, c in self.matrices(hidden)) + own + compressor + indexer


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
        _check(self.streams > 0, "hc_mult", self.streams)
        _check(self.sinkhorn_iters > 0, "hc_sinkhorn_iters", self.sinkhorn_iters)
        _check(self.eps > 0, "hc_eps", self.eps)

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


@dataclass(frozen=True)
class RouterSpec:
    """How a token picks its experts.

    kind "softmax_topk": softmax over the router's logits (float32), the `top_k` largest, divided
    by their sum when `renormalize` (Mixtral always; Qwen3-MoE when `norm_topk_prob`).
    kind "topk_softmax": the `top_k` largest logits, their softmax the weights (gpt-oss;
    `renormalize` is moot: they sum to one).
    kind "sigmoid_group_topk" (DeepSeek-V3, GLM-4.5): sigmoid scores (float32); a learned
    correction bias added to them only to choose; the experts split into `num_groups` groups
    (`n_group`), each ranked by its two best corrected scores, and the top `top_k` chosen
    within the best `topk_groups` groups; weighted by their uncorrected scores, divided by
    their sum when `renormalize`, times `scale` (`routed_scaling_factor`).
    kind "sqrtsoftplus_topk" (DeepSeek-V4): the same with scores sqrt(softplus(x Wᵀ)) and one group.
    kind "normed_softmax_topk" (Gemma 4): the router's input RMSNormed (no weight), times a learned
    vector [H] and H^-1/2, then softmax over x Wᵀ (float32), the `top_k` largest divided by their
    sum, each times its expert's learned scale [E].
    bias: the router's logits carry a learned bias (gpt-oss).
    hash_vocab: when > 0, the experts are not chosen by score: a token's `top_k` experts are row
              `token id` of a fixed table [hash_vocab, top_k] (DeepSeek-V4's hash layers,
              `tid2eid`), and the scores only weight them (there is no correction bias). The
              layer then reads each row's token id (carried on the hop: `ModelSpec.hop_width`).
    """

    kind: str = "softmax_topk"
    top_k: int = 2
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    bias: bool = False
    hash_vocab: int = 0

    def __post_init__(self) -> None:
        _check(self.kind in ROUTER_KINDS, "router kind", self.kind)
        _check(self.top_k > 0, "num_experts_per_tok", self.top_k)
        _check(0 < self.topk_groups <= self.num_groups, "topk_group", self.topk_groups)
        _check(self.scale > 0, "routed_scaling_factor", self.scale)
        if self.kind not in ("sigmoid_group_topk", "sqrtsoftplus_topk"):
            _check(self.num_groups == 1 and self.scale == 1.0, "n_group", self.num_groups)
        _check(self.kind != "sqrtsoftplus_topk" or self.num_groups == 1, "n_group", self.num_groups)
        _check(not self.bias or self.kind == "topk_softmax", "router bias", self.bias)
        _check(self.hash_vocab >= 0, "vocab_size", self.hash_vocab)
        _check(not self.hash_vocab or (self.scored and self.num_groups == 1), "hash routing", self.kind)

        _check(self.kind != "normed_softmax_topk" or self.renormalize, "router renormalize", self.renormalize)

    @property
    def scored(self) -> bool:
        """A correction-biased top-k of per-expert scores (DeepSeek's routers), hashed or not."""
        return self.kind in ("sigmoid_group_topk", "sqrtsoftplus_topk")

    def param_count(self, hidden: int, num_experts: int) -> int:
        """The [E, H] logit projection, and the correction bias or the logits' bias [E], or a hash
        layer's table [hash_vocab, k] of expert ids (Gemma 4's: its input scale [H] and expert scales [E])."""
        if self.kind == "normed_softmax_topk":
            return num_experts * hidden + hidden + num_experts
        extra = num_experts if (self.scored and not self.hash_vocab) or self.bias else 0
        return num_experts * hidden + extra + self.hash_vocab * self.top_k


@dataclass(frozen=True)
class GluSpec:
    """The activation of an MLP (each expert's), between its gate/up and its down projection.

    kind "silu":           silu(gate) * up.
    kind "clamped_swiglu": gpt-oss's: gate clamped above at `limit`, up to [-limit, limit],
                           then gate * sigmoid(alpha * gate) * (up + 1).
    kind "relu2":          relu(up)^2, with no gate projection at all (Nemotron-H's MLP).
    kind "clamped_silu":   DeepSeek-V4's: gate clamped above at `limit`, up to [-limit, limit],
                           then silu(gate) * up (no alpha).
    kind "gelu_tanh":      gelu(gate) * up, gelu's tanh approximation (Gemma's GeGLU,
                           `gelu_pytorch_tanh`).
    """

    kind: str = "silu"
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        _check(self.kind in GLU_KINDS, "activation", self.kind)
        swiglu, clamped = self.kind == "clamped_swiglu", self.kind in ("clamped_swiglu", "clamped_silu")
        _check(not swiglu or (self.alpha is not None and self.alpha > 0), "swiglu_alpha", self.alpha)
        _check(not clamped or (self.limit is not None and self.limit > 0), "swiglu_limit", self.limit)
        _check(swiglu or self.alpha is None, "swiglu_alpha", self.alpha)
        _check(clamped or self.limit is None, "swiglu_limit", self.limit)

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate projection beside its up projection."""
        return self.kind != "relu2"


@dataclass(frozen=True)
class MlpSpec:
    """One layer's MLP.

    kind "dense": SwiGLU of `width` (the intermediate size).
    kind "moe":   `num_experts` SwiGLU experts of `width` each (the expert intermediate
                  size), `router` choosing `router.top_k` of them per token, their outputs
                  summed with the router's weights; plus, when `shared_width`, one SwiGLU of
                  that width every token goes through (DeepSeek's `n_shared_experts` shared
                  experts, n x `moe_intermediate_size`), added unweighted — or, with
                  `shared_gate`, times sigmoid(x · w) of a learned [H] vector w (Qwen3-Next's
                  and Qwen3.5's shared expert).
    kind "dense_and_moe": Gemma 4's: a dense MLP of `shared_width` and `num_experts` experts of
                  `width` side by side, each with a norm before and after (the experts' router
                  reads the layer's residual stream, not the normed input), their outputs summed.
                  The MLP holds its input norms itself (layers/moe.py `DenseAndMoE`).
    glu:  the gated activation of the SwiGLU (each expert's).
    bias: the gate/up and down projections (each expert's) carry biases (gpt-oss).
    """

    width: int
    kind: str = "dense"
    num_experts: int = 0
    router: RouterSpec | None = None
    shared_width: int = 0
    glu: GluSpec = GluSpec()
    bias: bool = False
    shared_gate: bool = False

    def __post_init__(self) -> None:
        _check(self.kind in MLP_KINDS, "MLP kind", self.kind)
        _check(self.width > 0, "intermediate_size", self.width)
        _check(self.kind != "dense_and_moe" or self.shared_width > 0, "intermediate_size", self.shared_width)
        _check((self.kind == "dense_and_moe") == (self.router is not None and self.router.kind == "normed_softmax_topk"),
               "router kind", self.router and self.router.kind)
        if self.kind in ("moe", "dense_and_moe"):
            _check(self.num_experts > 0, "num_experts", self.num_experts)
            _check(self.router is not None and self.router.top_k <= self.num_experts, "num_experts_per_tok",
                   self.router and self.router.top_k)
            assert self.router is not None
            groups, per_group = self.router.num_groups, self.num_experts // self.router.num_groups
            _check(self.num_experts % groups == 0, "n_group", groups)
            # a group is ranked by its two best scores; the chosen groups must hold top_k experts
            _check(groups == 1 or per_group >= 2, "n_group", groups)
            _check(self.router.top_k <= self.router.topk_groups * per_group, "num_experts_per_tok", self.router.top_k)
            _check(self.shared_width >= 0, "n_shared_experts", self.shared_width)
            _check(not self.shared_gate or self.shared_width > 0, "shared_expert_intermediate_size", self.shared_width)
        else:
            _check(self.num_experts == 0 and self.router is None and self.shared_width == 0, "num_experts",
                   self.num_experts)

    def matrices(self, hidden: int) -> list[tuple[int, int]]:
        """[rows, cols] of its weight matrices as the engine stacks them: (gate+up, down) per expert,
        then the shared experts' (gate+up, down)."""
        ups = 2 if self.glu.gated else 1
        one = [(ups * self.width, hidden), (hidden, self.width)]
        shared = [(ups * self.shared_width, hidden), (hidden, self.shared_width)] if self.shared_width else []
        return one if self.kind == "dense" else one * self.num_experts + shared

    def param_count(self, hidden: int) -> int:
        # the router's [E, H] (and correction bias or logits' bias), kept in float: it picks the experts
        router = self.router.param_count(hidden, self.num_experts) if self.router is not None else 0
        ups = 2 if self.glu.gated else 1
        biases = (ups * self.width + hidden) * max(self.num_experts, 1) if self.bias else 0
        # `matrices`' sum, counted without listing every expert's: 3 W H a SwiGLU (2 W H ungated)
        matrices = (ups + 1) * (self.width * hidden * max(self.num_experts, 1) + self.shared_width * hidden)
        gate = hidden if self.shared_gate else 0  # the shared expert's gate vector, in float as a router
        norms = 4 * hidden if self.kind == "dense_and_moe" else 0  # its own: before and after each branch
        return matrices + router + biases + gate + norms


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
        _check(self.attention is not None or self.mlp is not None, "layer", "neither a mixer nor an MLP")
        _check(self.per_layer_input >= 0, "hidden_size_per_layer_input", self.per_layer_input)

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


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a model's shape.

    family:         the config's `model_type` ("llama", "mistral", "qwen2", "qwen3",
                    "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "glm_moe_dsa",
                    "qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "nemotron_h");
                    stages/families/catalog.py reads each.
    vocab_size:     rows of the embedding matrix; hidden_size (H): width of the residual stream.
    layers:         one LayerSpec per decoder layer (L = len(layers)).
    rms_norm_eps:   epsilon of every RMSNorm.
    max_position:   the longest context the model was trained for.
    tie_embeddings: the head reuses the embedding matrix.
    bos_token_id, eos_token_ids: special ids from the config.
    mtp_layers:     multi-token-prediction modules a checkpoint holds after the decoder layers
                    (DeepSeek-V3's and GLM-4.5's `num_nextn_predict_layers`, as layers L, L+1...;
                    Qwen3.5's under "mtp."; MiMo-V2-Flash's under "model.mtp.layers.", not drafted
                    with yet): run by no span, their tensors accepted in a folder; `--speculate mtp`
                    drafts with the first where the head runs (families/mtp.py).
    shipped:        how the checkpoint stores its matrices when not as floats (fp8 blocks, mxfp4,
                    GGUF blocks: families/shipped.py), else None. The arithmetic is the same; the
                    bytes a span holds are the shipped ones.
    norm_offset:    what every RMSNorm's stored weight is short of the scale it applies (every
                    layer's two norms, q/k norms and the final norm; 0.0 but for Qwen3-Next's and
                    Qwen3.5's zero-centred norms, which scale by 1 + w): added once, at load.
    prefix:         where the decoder's tensors lie in the checkpoint: "model." (a causal LM),
                    "model.language_model." (the text model of a multimodal checkpoint, whose
                    other towers are not run), or "backbone." (Nemotron-H's).
    embed_scale:    the embedding's rows are multiplied by it (Gemma: sqrt(H), as a float32 scalar
                    cast to the model's dtype, as transformers does), else None.
    logit_softcap:  the logits are softcapped, c tanh(logits / c) (Gemma's
                    `final_logit_softcapping`), else None.
    per_layer_vocab: rows of the per-layer input table (Gemma 4's `vocab_size_per_layer_input`)
                    when the layers take per-layer inputs (`LayerSpec.per_layer_input`), else 0.

    Under hyper-connections (every layer's `hyper`, DeepSeek-V4) the residual is several streams
    and the head mixes them back into one before the final norm; what a step carries between
    stages is `hop_width` values a token.
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
    mtp_layers: int = 0
    shipped: ShippedFormat | None = None
    norm_offset: float = 0.0
    prefix: str = "model."
    embed_scale: float | None = None
    logit_softcap: float | None = None
    per_layer_vocab: int = 0

    def __post_init__(self) -> None:
        _check(len(self.layers) > 0, "num_hidden_layers", len(self.layers))
        _check(self.hidden_size > 0, "hidden_size", self.hidden_size)
        _check(self.vocab_size > 0, "vocab_size", self.vocab_size)
        _check(self.max_position > 0, "max_position_embeddings", self.max_position)
        _check(self.mtp_layers >= 0, "num_nextn_predict_layers", self.mtp_layers)
        _check(self.embed_scale is None or self.embed_scale > 0, "embedding scale", self.embed_scale)
        _check(self.logit_softcap is None or self.logit_softcap > 0, "final_logit_softcapping", self.logit_softcap)
        widths = {layer.per_layer_input for layer in self.layers}
        _check(len(widths) == 1 and (self.per_layer_vocab > 0) == (0 not in widths), "hidden_size_per_layer_input",
               sorted(widths))
        _check(0 in self.span_starts, "indexer_types", "shared at layer 0")
        for i, layer in enumerate(self.layers):  # a layer reads the keys and values of an earlier one of its shape
            at = layer.attention
            source = getattr(at, "kv_source", None)
            if source is not None:
                giver = self.layers[source].attention if source < i else None
                _check(isinstance(giver, AttentionSpec) and giver.kv_source is None
                       and (giver.num_kv_heads, giver.head_dim, giver.value_dim, giver.window)
                       == (at.num_kv_heads, at.head_dim, at.value_dim, at.window), "num_kv_shared_layers", source)
        _check(len({layer.hyper for layer in self.layers}) == 1, "hc_mult", [layer.hyper for layer in self.layers])

    @property
    def hyper(self) -> HyperSpec | None:
        """The hyper-connections every layer has (DeepSeek-V4), or None: one residual stream."""
        return self.layers[0].hyper

    @property
    def streams(self) -> int:
        """Rows of H the residual is per token: `hyper.streams`, else 1."""
        return self.hyper.streams if self.hyper is not None else 1

    @cached_property
    def hop_id_digits(self) -> int:
        """Base-256 digits of a token id the hop carries (HOP_ID_DIGIT_BASE): enough for every id of the
        vocabulary where some layer routes by token id (a hash router), else 0."""
        if not any(layer.mlp is not None and layer.mlp.router is not None and layer.mlp.router.hash_vocab
                   for layer in self.layers):
            return 0
        return max(1, -(-(self.vocab_size - 1).bit_length() // 8))


    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property  # a frozen spec: hashing every layer's shape once, not per byte count asked
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

    @cached_property  # a frozen spec: each distinct layer shape counted once
    def param_count(self) -> int:
        """Parameters of the whole model: embedding, every decoder layer, the final norm, and the
        head unless tied, and the per-layer input table, projection and norm (Gemma 4's PLE) (MTP
        modules, which are not run, left out)."""
        edges = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2) + self.hidden_size
        edges += self.hyper.head_params(self.hidden_size) if self.hyper is not None else 0
        p = self.per_layer_width * self.num_layers
        edges += self.per_layer_vocab * p + p * self.hidden_size + self.per_layer_width
        return edges + sum(n * layer.param_count(self.hidden_size) for layer, n in Counter(self.layers).items())

    @property
    def per_layer_width(self) -> int:
        """P: each layer's per-layer input width (Gemma 4's `hidden_size_per_layer_input`), or 0."""
        return self.layers[0].per_layer_input

    def hop_width(self, layer: int) -> int:
        """Values a step carries per token into layer `layer` (0 <= layer <= L): what a stage whose span
        starts there takes (from the requester at 0), and what one ending there hands on. What a layer
        hands the next one, and what only the embedding knows that a layer still to run reads:

            the residual stream      `streams` rows of H (DeepSeek-V4's hyper-connections: several)
            the token id             `hop_id_digits` digits, where a layer routes by it (DeepSeek-V4)
            the per-layer inputs     P each of layers layer..L-1 (Gemma 4's E-models: computed by the
                                     requester with the embedding, layers/per_layer.py)

        So the width shrinks by P a layer run where layers take per-layer inputs and is the same at
        every layer otherwise (docs/pages/models.md says why it is not kept constant). A hop of T
        tokens is [T, hop_width(layer)] (stages/layers/hop.py packs and unpacks it): what the wire, the
        requester's history at that cut, the spot checks and a peer's frame limit carry; its bytes per
        token are `hop_bytes`. At L it is what the head reads."""
        if not 0 <= layer <= self.num_layers:
            raise SpanError(f"layer {layer} is outside [0, {self.num_layers}]")
        return (self.streams * self.hidden_size + self.hop_id_digits
                + self.per_layer_width * (self.num_layers - layer))

    def hop_bytes(self, layer: int, itemsize: int = 4) -> int:
        """Bytes one token's hop into layer `layer` (`hop_width`) takes at `itemsize` bytes a value."""
        return self.hop_width(layer) * itemsize

    def max_layer_bytes(self, itemsize: int = 4) -> int:
        """Bytes of the largest layer."""
        return max(self.layer_bytes(itemsize, layer=i) for i in range(self.num_layers))

    @cached_property  # a frozen spec: asked at every session a peer opens
    def span_starts(self) -> tuple[int, ...]:
        """The layers a span may start at (and L): every layer but those that reuse a selection made
        before them (`DsaSpec.shared`), and but those between a layer whose keys and values later
        layers attend over and the last of those (`AttentionSpec.kv_source`: Gemma 4's KV-shared
        layers). A step carries a DSA selection from layer to layer in one stage, never between
        peers, and a layer that reuses it cannot recompute it: that needs the selecting layer's
        weights, its input and its cache of index keys. Likewise a shared layer attends over the
        whole cache of the layer it reads, which lives in that layer's stage: the two are served
        together (sending the cache's new rows along every hop instead would cost 2 K D values
        per token per source layer; not done). So a stage's span and a session's sub-span start
        only here (`load_stage`, `SessionTable.open` refuse others)."""
        blocked = {i for i, layer in enumerate(self.layers) if getattr(layer.attention, "shared", False)}
        for i, layer in enumerate(self.layers):
            source = getattr(layer.attention, "kv_source", None)
            if source is not None:
                blocked.update(range(source + 1, i + 1))
        return tuple(i for i in range(self.num_layers + 1) if i not in blocked)

    def aligned_span(self, start: int, end: int) -> tuple[int, int]:
        """The span nearest [start, end) whose ends are `span_starts` (L among them): the largest such
        span inside it; where none is, the smallest one from the start moved down (a layer and those
        reusing its selection are served together, even past the length asked). What a peer claims
        where placement chose [start, end); any span of a model without reusing layers is itself."""
        starts = self.span_starts
        if len(starts) == self.num_layers + 1:
            return start, end
        inner = [i for i in starts if start <= i <= end]
        if len(inner) >= 2:
            return inner[0], inner[-1]
        first = max(i for i in starts if i <= start)
        return first, min(i for i in starts if i > first)

    def check_span_start(self, start: int, end: int) -> None:
        """SpanError unless a span [start, end) may start at layer `start` (`span_starts`; an empty
        span may start anywhere)."""
        if start < end and start not in self.span_starts:
            sources = [(i, getattr(self.layers[i].attention, "kv_source", None)) for i in range(start, self.num_layers)]
            reading = next(((i, source) for i, source in sources if source is not None and source < start), None)
            if reading is not None:
                what = f"layer {reading[0]} attends over the keys and values of layer {reading[1]}"
            else:
                what = f"it reuses the sparse-attention selection of layer {max(i for i in self.span_starts if i < start)}"
            raise SpanError(f"a span cannot start at layer {start} of this {self.family} model: {what}, which is not "
                            f"sent between peers (spans start at layers {list(self.span_starts[:-1])})")

    def rolls_back_anywhere(self, start: int, end: int) -> bool:
        """Whether a session over layers [start, end) can go back to any earlier position (every layer's
        state a row per position, cut by a pointer), or only to its recent checkpoints and to 0 (a
        recurrent layer's: `RecurrentStateSpec`): a requester that goes further back replays from 0."""
        return all(self.layers[i].cache.kind not in CHECKPOINTED_KINDS for i in range(start, end))

    def kv_bytes_per_position(self, start: int, end: int, itemsize: int = 4) -> int:
        """KV bytes one position costs a session over layers [start, end), each per its state kind
        (0 for a layer whose state does not grow with the context)."""
        return sum(self._kv_items_per_position[start:end]) * itemsize

    @cached_property  # asked at every session a peer opens or grows: each layer's cache spec built once
    def _kv_items_per_position(self) -> tuple[int, ...]:
        """Per layer: the cache entries one position holds (its bytes at an itemsize of 1)."""
        return tuple(layer.cache.bytes_per_position(1) for layer in self.layers)

    def state_fixed_bytes(self, start: int, end: int, itemsize: int = 4) -> int:
        """Bytes a session over layers [start, end) holds whatever its length (recurrent states)."""
        return sum(self.layers[i].cache.fixed_bytes(itemsize) for i in range(start, end))

    def state_bytes(self, start: int, end: int, positions: int, itemsize: int = 4) -> int:
        """Bytes a session of `positions` over layers [start, end) holds: fixed + per position x positions."""
        return self.state_fixed_bytes(start, end, itemsize) + self.kv_bytes_per_position(start, end, itemsize) * positions

    def context_tokens(self, start: int, end: int, budget: int, itemsize: int = 4) -> int:
        """The longest context one session over layers [start, end) can hold in `budget` bytes of
        session state (at most the model's context; 0 when not even its fixed state fits). A span
        of linear-attention layers holds the whole context in a fixed state: its bound is
        `max_position` as soon as that state fits."""
        fixed = self.state_fixed_bytes(start, end, itemsize)
        if budget < fixed or end <= start:
            return 0 if end > start else self.max_position
        per_token = self.kv_bytes_per_position(start, end, itemsize)
        return self.max_position if per_token == 0 else min(self.max_position, (budget - fixed) // per_token)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
