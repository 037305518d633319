"""Kimi Delta Attention: Gated DeltaNet with a decay per key channel (Kimi Linear, Kimi K3's layout).

Shapes: T = tokens in this step, H = hidden size, Hk = heads (q, k and v alike), d = their dim,
C = 3 Hk d (the convolution's channels: q, k, v), Kc = the convolution's kernel. The math is
families/spec/recurrent.py's `KdaSpec`; float32 reference semantics are transformers'
`KimiLinearDeltaAttention` with its torch kernels (`chunk_kimi_delta_attention` for a step of
many tokens, `recurrent_kimi_delta_attention` for one): the same algorithm in the same order but
for the chunk's triangular system, solved here by `solve_triangular` where the reference
substitutes row by row (the same solution; logits agree to ~1e-6).

Where Gated DeltaNet decays the whole state of a head by one number per token, KDA decays each
row of it (each key channel) by its own: g [Hk, T, d], not [Hv, T]. Per head (S [d, d]):

    S = diag(exp(g_t)) S;   S = S + k_t ((v_t - k_tᵀ S) beta_t)ᵀ;   o_t = q_tᵀ S

token by token delta_rule.py's `recurrent_delta_rule` (Gated DeltaNet's too, its g one per head).
`chunked_kda` computes the same in chunks of 64 tokens: within a chunk the decay between two
positions is exp(g_i - g_j) per channel (a [c, c, d] tensor per head, made one chunk at a time so
that a long prefill holds one chunk's), the UT transform turns the chunk's updates into matmuls,
and the state carries across chunks.

The session's state and its rollback are Gated DeltaNet's (layers/state.py): a step hands its
store NEW state tensors through `fold`, whose inputs per token (`KdaSpec.replay_width`: the
convolution's inputs, the forget gate's f and b) are what a rollback folds in again, no
projection. No compiled form: a decode step runs this module eagerly (the compiled runner falls
back per layer kind, stages/engine/compiled/inductor.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.families.spec.recurrent import KdaSpec
from tessera.stages.layers.attention import StepRows
from tessera.stages.layers.norm import SigmoidGatedRMSNorm
from tessera.stages.layers.recurrent.delta_rule import CHUNK, L2_EPS, recurrent_delta_rule
from tessera.stages.layers.recurrent.short_conv import causal_conv
from tessera.stages.layers.state import RecurrentState, fold_sessions

SOFTPLUS_LINEAR = 20.0  # above it the reference's softplus is the identity (its overflow guard)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the reference's form for KDA: a division)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above SOFTPLUS_LINEAR (the reference's form, op for op)."""
    return torch.where(x > SOFTPLUS_LINEAR, x, torch.log(1.0 + torch.exp(x)))


def chunked_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in chunks of `chunk` tokens (same arguments and result as delta_rule.py's
    `recurrent_delta_rule`, g [Hk, T, d]: a decay per key channel; the reference's algorithm, step for
    step). A step shorter than a chunk is one chunk of its own length; a longer one is padded to whole
    chunks with rows that change nothing (beta and g 0, after every real row of a lower-triangular
    system)."""
    hk, t, d = k.shape
    chunk = min(chunk, t)
    pad = (-t) % chunk
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v, g = (x.reshape(hk, n, chunk, d) for x in (q, k, v, g))
    beta = beta.reshape(hk, n, chunk, 1)
    g = g.cumsum(-2)  # [Hk, n, c, d]: log of each channel's decay from the chunk's start
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)[..., None]  # [c, c, 1]: j > i
    out = torch.empty_like(v)  # [Hk, n, c, d]
    for i in range(n):
        q_i, k_i, v_i, g_i, beta_i = q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]
        # exp(g_i - g_j) per channel for j <= i, 0 after: [Hk, c, c, d]
        pairs = (g_i[:, :, None, :] - g_i[:, None, :, :]).masked_fill(later, float("-inf")).exp()
        k_beta = k_i * beta_i
        system = (k_beta[:, :, None, :] * k_i[:, None, :, :] * pairs).sum(-1)  # [Hk, c, c], below its diagonal
        intra = (q_i[:, :, None, :] * k_i[:, None, :, :] * pairs).sum(-1)  # [Hk, c, c], diagonal included
        new_values = torch.linalg.solve_triangular(system, v_i * beta_i, upper=False, unitriangular=True)
        k_decayed = torch.linalg.solve_triangular(system, k_beta * g_i.exp(), upper=False, unitriangular=True)
        v_new = new_values - k_decayed @ state
        out[:, i] = (q_i * g_i.exp()) @ state + intra @ v_new
        last = g_i[:, -1:, :]  # [Hk, 1, d]: the chunk's whole decay
        state = state * last.transpose(1, 2).exp() + (k_i * (last - g_i).exp()).transpose(-1, -2) @ v_new
    return out.reshape(hk, n * chunk, d)[:, :t], state


class KimiDeltaAttention(nn.Module):
    """Kind "kda" (module docstring). Engine names: w_in (q, k, v, b, f_a, g_a), w_fb, w_gb, conv, A_log,
    dt_bias, out_norm, w_out."""

    def __init__(self, hidden: int, spec: KdaSpec, eps: float) -> None:
        super().__init__()
        self.spec = spec
        size, d = spec.size, spec.head_dim
        self.w_in = nn.Linear(hidden, spec.in_size, bias=False)
        self.w_fb = nn.Linear(d, size, bias=False)
        self.w_gb = nn.Linear(d, size, bias=False)
        self.conv = nn.Parameter(torch.empty(spec.conv_channels, 1, spec.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(1, 1, spec.num_heads, 1))  # as checkpoints store it
        self.dt_bias = nn.Parameter(torch.empty(size))
        self.out_norm = SigmoidGatedRMSNorm(d, eps)
        self.w_out = nn.Linear(size, hidden, bias=False)

    def fold(self, inputs: torch.Tensor, state: torch.Tensor, window: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One session's rows through the convolution and the recurrence: inputs [T, C + Hk d + Hk]
        (q, k, v before the convolution; the forget gate's f; b) from `state` and `window` ->
        (o [T, Hk, d] in the inputs' dtype, the new state, the new window)."""
        s, t = self.spec, inputs.shape[0]
        hk, d = s.num_heads, s.head_dim
        mixed, f, b = inputs.split([s.conv_channels, s.size, hk], dim=-1)
        mixed, window = causal_conv(window, mixed, self.conv)
        q, k, v = (x.float().view(t, hk, d).transpose(0, 1) for x in mixed.split(s.size, dim=-1))  # [Hk, T, d]
        gate = (f.float() + self.dt_bias.float()).view(t, hk, d)
        g = (-self.A_log.float().view(hk, 1).exp() * softplus(gate)).transpose(0, 1)  # [Hk, T, d]
        beta = b.float().sigmoid().t()  # [Hk, T]
        q, k = l2norm(q) * d ** -0.5, l2norm(k)
        rule = recurrent_delta_rule if t == 1 else chunked_kda
        out, state = rule(q, k, v, g, beta, state)
        return out.transpose(0, 1).to(inputs.dtype), state, window  # [T, Hk, d]

    def step(self, inputs: torch.Tensor, store: RecurrentState) -> torch.Tensor:
        """One session's rows [T, replay_width] folded into its store (after what a rollback left pending)."""
        return store.step(inputs, self.fold)

    def forward(self, x: torch.Tensor, ctx: StepRows, cache: RecurrentState | Sequence[RecurrentState]) -> torch.Tensor:
        """x [T, H] -> [T, H]. cache: the session's store, or one per segment of a stacked step."""
        s, t = self.spec, x.shape[0]
        mixed, b, f_a, g_a = self.w_in.forward(x).split([s.conv_channels, s.num_heads, s.head_dim, s.head_dim], dim=-1)
        inputs = torch.cat((mixed, self.w_fb.forward(f_a), b), dim=-1)
        # a StepContext's segments; a compiled step's rows never run this layer
        out = fold_sessions(inputs, getattr(ctx, "segments", ()), cache, self.fold)  # [T, Hk, d]
        out = self.out_norm.forward(out, self.w_gb.forward(g_a).view(t, s.num_heads, s.head_dim))
        return self.w_out.forward(out.reshape(t, s.size))
