"""The token mixers with a fixed recurrent state, not a row per position: Gated DeltaNet (kind
"gated_deltanet": Qwen3-Next, Qwen3.5), Kimi Delta Attention (kind "kda": Kimi Linear) and Mamba2's
state-space mixer (kind "mamba2": Nemotron-H), and the state they keep (`RecurrentStateSpec`, kind
"recurrent"), with how far back it can be taken. Computed in layers/recurrent/, kept in
layers/state.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.stages.families.spec.kinds import StateSize, check_field

# How far back a recurrent state can be taken (layers/state.py, docs/pages/models.md's measurement):
# the state at the start of each of the last RECURRENT_CHECKPOINTS runs of steps is kept (two:
# the requester keeps at most two speculative blocks of a session in flight, peer/request/decode.py
# MAX_IN_FLIGHT, and a rejected draft or a re-sent step goes back into one of them), and the
# inputs of a run (a step, and the one-token steps after it) of at most REPLAY_TOKENS tokens in all
# (a draft block is at most K_MAX + 1 = 9; a local draft model feeds its drafts one token a step),
# from which any position inside it is recomputed.
RECURRENT_CHECKPOINTS = 2
REPLAY_TOKENS = 16


@dataclass(frozen=True)
class RecurrentStateSpec(StateSize):
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
        check_field(self.kind == "recurrent", "cache kind", self.kind)
        for name, value in (("linear_num_value_heads", self.num_heads), ("linear_key_head_dim", self.key_dim),
                            ("linear_value_head_dim", self.value_dim), ("conv channels", self.conv_channels),
                            ("replay width", self.replay_width)):
            check_field(value > 0, name, value)
        check_field(self.conv_kernel >= 1, "linear_conv_kernel_dim", self.conv_kernel)

    def state_bytes(self, itemsize: int) -> int:
        """One copy of the state: the float32 matrix and the convolution window."""
        return 4 * self.num_heads * self.key_dim * self.value_dim + (self.conv_kernel - 1) * self.conv_channels * itemsize

    def fixed_bytes(self, itemsize: int) -> int:
        """The most a session's store holds: the state, a checkpoint per kept step, their inputs."""
        kept_inputs = RECURRENT_CHECKPOINTS * REPLAY_TOKENS * self.replay_width * itemsize
        return (1 + RECURRENT_CHECKPOINTS) * self.state_bytes(itemsize) + kept_inputs


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
        check_field(self.kind == "gated_deltanet", "attention kind", self.kind)
        check_field(self.num_key_heads > 0, "linear_num_key_heads", self.num_key_heads)
        check_field(self.num_value_heads > 0 and self.num_value_heads % self.num_key_heads == 0,
               "linear_num_value_heads", self.num_value_heads)
        check_field(self.key_dim > 0, "linear_key_head_dim", self.key_dim)
        check_field(self.value_dim > 0, "linear_value_head_dim", self.value_dim)
        check_field(self.conv_kernel >= 1, "linear_conv_kernel_dim", self.conv_kernel)
        check_field(self.layout in ("split", "grouped"), "linear attention layout", self.layout)

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
        check_field(self.kind == "kda", "attention kind", self.kind)
        check_field(self.num_heads > 0, "linear_num_heads", self.num_heads)
        check_field(self.head_dim > 0, "linear_head_dim", self.head_dim)
        check_field(self.conv_kernel >= 1, "linear_conv_kernel_dim", self.conv_kernel)

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
        check_field(self.kind == "mamba2", "attention kind", self.kind)
        check_field(self.num_heads > 0, "mamba_num_heads", self.num_heads)
        check_field(self.head_dim > 0, "mamba_head_dim", self.head_dim)
        check_field(self.state_size > 0, "ssm_state_size", self.state_size)
        check_field(self.num_groups > 0 and self.num_heads % self.num_groups == 0, "n_groups", self.num_groups)
        check_field(self.conv_kernel >= 1, "conv_kernel", self.conv_kernel)
        check_field(self.chunk > 0, "chunk_size", self.chunk)
        check_field(self.dt_min >= 0 and math.isfinite(self.dt_min), "time_step_limit", self.dt_min)

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
